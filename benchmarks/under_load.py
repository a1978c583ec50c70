"""Speed of a script as it ships, on a quiet machine and with one core kept busy by another process.

    OMP_NUM_THREADS= python benchmarks/under_load.py --algo dqn --threads 0 1 2

For each ``--threads`` value (passed to the script as ``--torch-threads``; 0 is the script's automatic
choice) and each OpenMP wait policy of ``--wait-policies`` (``default``: OMP_WAIT_POLICY unset), the
script runs twice per round, quiet and beside ``python3 -c "while True: pass"``, in two phases:

- learning: DQN's learning phase (one update of batch 32 per 4 agent steps), ``--learning-steps`` steps
  after ``--learning-starts`` random ones;
- acting: what the README's first command does between its exploration and its learning start
  (epsilon 0.01, a batch-1 forward per agent step, no updates), ``--acting-steps`` steps.

Each rate comes from the wall times of the script's own ``charts/SPS`` points (every 100 agent steps), from
the first point 500 steps into the phase to the last. Prints a table with busy / quiet per configuration;
``--json`` writes the figures. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def phase_flags(phase: str, cli: argparse.Namespace) -> tuple[list[str], int]:
    """The script's flags for a phase and the agent step from which its rate is read."""
    if phase == "learning":
        total = cli.learning_starts + cli.learning_steps
        flags = ["--total-timesteps", str(total), "--learning-starts", str(cli.learning_starts)]
        return flags, cli.learning_starts + 500
    # acting: epsilon reaches 0.01 after 100 steps, and learning never starts (the script warns, as it should)
    total = 1000 + cli.acting_steps
    flags = ["--total-timesteps", str(total), "--learning-starts", str(total), "--exploration-fraction", "0.0001"]
    return flags, 1000


def script_rate(
    cli: argparse.Namespace, phase: str, threads: int, policy: str, run_dir: Path, repo: Path = REPO
) -> float:
    """Agent steps per second of ``algos/ALGO.py`` in ``phase``, from its charts/SPS wall times."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags, from_step = phase_flags(phase, cli)
    command = [sys.executable, str(repo / "algos" / f"{cli.algo}.py"), "--env-id", cli.env_id, *flags,
               "--buffer-size", "50000", "--eval-every", "0", "--eval-episodes", "1", "--eval-epsilon", "1",
               "--checkpoint-every", "0", "--seed", "1", "--device", "cpu", "--run-dir", str(run_dir),
               "--torch-threads", str(threads), *cli.extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = str(repo)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy.upper()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    (events,) = run_dir.glob("*/events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    points = [(e.step, e.wall_time) for e in accumulator.Scalars("charts/SPS")]
    (s1, t1), (s2, t2) = next(p for p in points if p[0] >= from_step), points[-1]
    return (s2 - s1) / (t2 - t1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", default="dqn")
    parser.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    parser.add_argument("--threads", type=int, nargs="+", default=[0], help="--torch-threads values (0: automatic)")
    parser.add_argument("--wait-policies", nargs="+", default=["default"], choices=["default", "passive", "active"])
    parser.add_argument("--phases", nargs="+", default=["learning", "acting"], choices=["learning", "acting"])
    parser.add_argument("--learning-starts", type=int, default=2000)
    parser.add_argument("--learning-steps", type=int, default=3000)
    parser.add_argument("--acting-steps", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=1, help="quiet and busy runs of each configuration")
    parser.add_argument("--loads", nargs="+", default=["quiet", "busy"], choices=["quiet", "busy"])
    parser.add_argument(
        "--repos",
        nargs="+",
        type=Path,
        default=[REPO],
        help="checkouts whose scripts to run, alternating (e.g. a git worktree of an older commit)",
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("extra", nargs="*", help="more flags for the script, after --")
    cli = parser.parse_args()

    configs = [(repo, t, p) for repo in cli.repos for t in cli.threads for p in cli.wait_policies]
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(cli.rounds):
            for phase in cli.phases:
                for c, (repo, threads, policy) in enumerate(configs[:: 1 if r % 2 == 0 else -1]):
                    for load in cli.loads:
                        busy = None
                        if load == "busy":  # one core held by another process, as the reproduction
                            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        try:
                            folder = Path(tmp) / f"{phase}_{c}_{threads}_{policy}_{load}_{r}"
                            rate = script_rate(cli, phase, threads, policy, folder, repo)
                        finally:
                            if busy is not None:
                                busy.kill()
                                busy.wait()
                        rates.setdefault(f"{phase}|{repo}|{threads}|{policy}|{load}", []).append(rate)
                        print(f"# round {r + 1}: {phase:<8} {repo} threads={threads} wait={policy:<7} {load:<5} "
                              f"{rate:7.1f} steps/s", flush=True)  # fmt: skip

    print(f"\nalgos/{cli.algo}.py on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{cli.env_id}, agent steps/s (mean of {cli.rounds} round(s)):")  # fmt: skip
    print(f"{'phase':<9} {'checkout':<24} {'--torch-threads':>15} {'OMP_WAIT_POLICY':>16} "
          + " ".join(f"{load:>11}" for load in cli.loads) + ("  busy/quiet" if len(cli.loads) == 2 else ""))  # fmt: skip
    table = []
    for phase in cli.phases:
        for repo, threads, policy in configs:
            row = {load: sum(rates[f"{phase}|{repo}|{threads}|{policy}|{load}"]) / cli.rounds for load in cli.loads}
            table.append(dict(phase=phase, checkout=str(repo), threads=threads, wait_policy=policy, **row))
            ratio = f"  {row['busy'] / row['quiet']:>10.2f}" if len(cli.loads) == 2 else ""
            print(f"{phase:<9} {str(repo)[-24:]:<24} {threads:>15} {policy:>16} "
                  + " ".join(f"{row[load]:>11.1f}" for load in cli.loads) + ratio)  # fmt: skip
    if cli.json:
        Path(cli.json).write_text(json.dumps({"algo": cli.algo, "env_id": cli.env_id, "table": table}, indent=2))


if __name__ == "__main__":
    main()
