"""Run a grid of algorithms x games x seeds, locally in a pool of processes or on a Ray cluster.

    python -m cleanrl_utils.tools.benchmark --algos dqn qrdqn --env-ids PongNoFrameskip-v4 \\
        --seeds 1 2 3 --workers 2 -- --total-timesteps 1000000

Each run's output goes to its own log file; runs whose ``receipt.json`` says ``finished`` are
skipped when the same grid is launched again. Failed runs are reported with their log's tail
and make the exit status non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cleanrl_utils.checks import fail

REPO_ROOT = Path(__file__).resolve().parents[2]
ALGOS_DIR = REPO_ROOT / "algos"


@dataclass
class RunSpec:
    algo: str
    env_id: str
    seed: int
    script: Path | None = None  # a script outside algos/ (a copy of the custom template, say); None: algos/ALGO.py
    resume: Path | None = None  # an unfinished earlier run of this spec that has checkpoints

    @property
    def name(self) -> str:
        return f"{self.env_id.replace('/', '_').replace(':', '_')}__{self.algo}__{self.seed}"


class LaunchError(ValueError):
    """A launch that cannot go ahead; the message says why and what to do."""


def known_algos() -> list[str]:
    return sorted(p.stem for p in ALGOS_DIR.glob("*.py"))


def resolve_algo(algo: str) -> tuple[str, Path | None]:
    """A name in algos/, or the path of a script file anywhere (e.g. a copy of algos/custom_value_atari.py):
    (its name, the script path or None for algos/NAME.py)."""
    if algo in known_algos():
        return algo, None
    path = Path(algo)
    if path.suffix == ".py" and path.is_file():
        return path.stem, path.resolve()
    raise LaunchError(
        f"--algos: unknown algorithm {algo}; choose among {', '.join(known_algos())} "
        "or give the path of a script file (e.g. a copy of algos/custom_value_atari.py)"
    )


def finished_run(run_dir: Path, spec: RunSpec) -> Path | None:
    """The folder of an earlier run of ``spec`` whose receipt says it finished, if any."""
    for receipt in sorted(run_dir.glob(f"{spec.name}__*/receipt.json")):
        try:
            if json.loads(receipt.read_text()).get("status") == "finished":
                return receipt.parent
        except (OSError, json.JSONDecodeError):
            continue
    return None


def resumable_run(run_dir: Path, spec: RunSpec) -> Path | None:
    """The newest earlier run of ``spec`` that was killed or interrupted and has a checkpoint, if any."""
    from cleanrl_utils.checkpoint import list_checkpoints

    for receipt in sorted(run_dir.glob(f"{spec.name}__*/receipt.json"), reverse=True):
        try:
            status = json.loads(receipt.read_text()).get("status")
        except (OSError, json.JSONDecodeError):
            continue
        if status in ("running", "interrupted") and list_checkpoints(receipt.parent):
            return receipt.parent
    return None


def command_for(spec: RunSpec, run_dir: Path, extra: list[str]) -> list[str]:
    script = str(spec.script or ALGOS_DIR / f"{spec.algo}.py")
    if spec.resume is not None:  # continues with the run's own settings, in its own folder
        return [sys.executable, script, "--resume", str(spec.resume)]
    return [
        sys.executable,
        script,
        "--env-id",
        spec.env_id,
        "--seed",
        str(spec.seed),
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def run_environment(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # One torch thread per process by default: several processes each spinning on every
    # core slow each other down several-fold.
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", str(threads))
    env["CI"] = "true"  # plain progress lines in the log instead of a progress bar
    return env


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def last_step(path: Path) -> int:
    """The newest agent step a run's log mentions (progress, metrics or episode lines)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return 0
    step = 0
    for line in tail.splitlines():
        for prefix in ("global_step=", "TRAIN_METRICS step=", "progress step="):
            if line.startswith(prefix):
                digits = line[len(prefix) :].split(",")[0].split("/")[0].split()[0]
                if digits.isdigit():
                    step = max(step, int(digits))
    return step


def total_timesteps(extra: list[str]) -> int:
    for i, flag in enumerate(extra):
        if flag == "--total-timesteps" and i + 1 < len(extra):
            return int(extra[i + 1])
        if flag.startswith("--total-timesteps="):
            return int(flag.split("=", 1)[1])
    return 10_000_000


def run_local(specs: list[RunSpec], run_dir: Path, logs: Path, extra: list[str], workers: int, threads: int) -> dict:
    """A pool of ``workers`` subprocesses with one status line per run."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    env = run_environment(threads)
    pending = list(specs)
    running: dict[str, tuple[subprocess.Popen, RunSpec, Path, IO[str]]] = {}
    results: dict[str, int] = {}
    total = total_timesteps(extra)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[state]}"), TimeElapsedColumn()]
    with Progress(*columns, refresh_per_second=2, transient=False) as progress:
        tasks = {s.name: progress.add_task(s.name, total=total, state="queued") for s in specs}
        while pending or running:
            while pending and len(running) < workers:
                spec = pending.pop(0)
                log = logs / f"{spec.name}.log"
                handle = open(log, "w")  # noqa: SIM115 - closed when the process ends
                process = subprocess.Popen(
                    command_for(spec, run_dir, extra), stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
                )
                running[spec.name] = (process, spec, log, handle)
                progress.update(tasks[spec.name], state="running")
            for name, (process, _, log, handle) in list(running.items()):
                progress.update(tasks[name], completed=last_step(log))
                code = process.poll()
                if code is not None:
                    handle.close()
                    results[name] = code
                    state = "finished" if code == 0 else f"FAILED (exit {code})"
                    progress.update(tasks[name], state=state, completed=total if code == 0 else None)
                    del running[name]
            time.sleep(0.5)
    return results


def reachable(address: str, timeout: float = 5.0) -> None:
    """Fail at once, with the fix, when nothing listens at a Ray head's HOST:PORT."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(f"--ray-address {address}: expected auto, local or HOST:PORT (e.g. 10.0.0.5:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise LaunchError(
            f"--ray-address {address}: cannot connect to a Ray cluster ({error}); start one with "
            "`ray start --head` there, or use --ray-address local to run Ray on this machine"
        ) from None


def run_ray(specs: list[RunSpec], run_dir: Path, logs: Path, extra: list[str], address: str, threads: int, gpus: float):
    """Each run a Ray task (1 CPU, ``gpus`` GPUs); run folders and logs go to the paths given,
    which must be shared by the cluster's nodes (on one machine they are local)."""
    try:
        import ray
    except ImportError:
        raise LaunchError(
            "--ray-address needs Ray: pip install 'value-atari[ray]' (or pip install 'ray[default]')"
        ) from None
    if address not in ("local", "auto"):
        reachable(address)  # Ray itself retries an unreachable head for minutes
    try:
        ray.init(address=None if address == "local" else address, log_to_driver=False)
    except Exception as error:  # Ray raises several types for an unreachable head
        raise LaunchError(
            f"--ray-address {address}: cannot connect to a Ray cluster ({type(error).__name__}: {error})"
        ) from None

    @ray.remote(num_cpus=1, num_gpus=gpus)
    def one_run(command: list[str], log: str, env: dict[str, str]) -> int:
        with open(log, "w") as handle:
            return subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT).returncode

    env = run_environment(threads)
    futures = {s.name: one_run.remote(command_for(s, run_dir, extra), str(logs / f"{s.name}.log"), env) for s in specs}
    results = {}
    for name, future in futures.items():
        results[name] = ray.get(future)
        print(f"{name}: {'finished' if results[name] == 0 else f'FAILED (exit {results[name]})'}", flush=True)
    ray.shutdown()
    return results


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m cleanrl_utils.tools.benchmark",
        description="Run algorithms x games x seeds; flags after -- go to every run.",
    )
    parser.add_argument(
        "--algos", nargs="+", required=True, help=f"among: {' '.join(known_algos())}; or paths of script files"
    )
    parser.add_argument("--env-ids", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1, help="parallel local runs (default 1)")
    parser.add_argument("--threads-per-run", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--run-dir", default="runs", help="where the run folders go (shared path for Ray)")
    parser.add_argument("--logs-dir", default=None, help="per-run logs (default RUN_DIR/logs)")
    parser.add_argument("--ray-address", default=None, help="auto, HOST:PORT, or local (start Ray here)")
    parser.add_argument("--gpus-per-run", type=float, default=0.0, help="GPUs each Ray task asks for")
    return parser.parse_args(argv), extra


def main(argv: list[str] | None = None) -> int:
    try:
        return launch(argv)
    except LaunchError as error:
        fail(str(error))


def launch(argv: list[str] | None = None) -> int:
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    scripts = dict(resolve_algo(a) for a in dict.fromkeys(args.algos))
    if len(scripts) < len(dict.fromkeys(args.algos)):
        fail("--algos: two scripts share a file name; runs are named after it, so rename one copy")
    from cleanrl_utils.envs import EnvIdError, check_env_id

    for env_id in args.env_ids:
        try:
            check_env_id(env_id)
        except EnvIdError as error:
            fail(str(error))
    if args.workers < 1:
        fail(f"--workers {args.workers} must be at least 1")
    if "--seed" in extra or "--env-id" in extra or "--run-dir" in extra:
        fail("pass --seeds, --env-ids and --run-dir to the launcher, not after --")
    specs = [RunSpec(a, e, s, scripts[a]) for e in args.env_ids for a in scripts for s in dict.fromkeys(args.seeds)]
    if not specs:
        fail("the grid is empty: give at least one algorithm, game and seed")
    run_dir = Path(args.run_dir).resolve()
    logs = Path(args.logs_dir).resolve() if args.logs_dir else run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    todo = []
    for spec in specs:
        done = finished_run(run_dir, spec)
        if done is not None:
            print(f"{spec.name}: already finished in {done}, skipped", flush=True)
            continue
        spec.resume = resumable_run(run_dir, spec)
        if spec.resume is not None:
            print(f"{spec.name}: resuming the unfinished run in {spec.resume}", flush=True)
        todo.append(spec)
    print(f"{len(todo)} run(s) to do, {len(specs) - len(todo)} already finished; logs in {logs}", flush=True)
    if args.ray_address:
        results = run_ray(todo, run_dir, logs, extra, args.ray_address, args.threads_per_run, args.gpus_per_run)
    else:
        results = run_local(todo, run_dir, logs, extra, args.workers, args.threads_per_run)
    failed = [name for name, code in results.items() if code != 0]
    for name in failed:
        print(f"\n--- {name} failed (exit {results[name]}); last lines of {logs / (name + '.log')}:", file=sys.stderr)
        print(log_tail(logs / f"{name}.log"), file=sys.stderr)
    print(f"{len(results) - len(failed)} finished, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
