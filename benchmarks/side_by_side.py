"""Side by side with a reference implementation (issue 55; docs/side_by_side.md).

Trains one of our scripts, or the reference implementation of the same algorithm, with one schedule on this
machine, and scores both with our evaluator (``cleanrl_utils.evaluation.evaluate``): the same protocol, the same
evaluation seeds and the same number of games at the same agent steps. The references, each in its own virtual
environment at a pinned version and never copied into this repository:

- C51: CleanRL's ``cleanrl/c51_atari.py`` at ``CLEANRL_COMMIT``, obtained by ``get-cleanrl`` (its files checked
  against ``CLEANRL_FILES``' SHA-256) and patched at run time (``CLEANRL_C51_PATCHES``, each change asserted to
  match exactly once);
- QR-DQN: sb3-contrib's ``QRDQN`` (``REFERENCE_VERSIONS``) with rl-zoo3's Atari settings, driven by
  ``benchmarks/side_by_side_sb3.py`` (a callback saves the snapshots; nothing patched).

The reference's snapshots, saved at each evaluation step, are played by our evaluator through ``CleanRLC51`` and
``SB3QRDQN``: networks whose forward takes our uint8 (N, 4, 84, 84) stacks and returns the reference's Q-values.

    python benchmarks/side_by_side.py get-cleanrl                           # once: CleanRL's files at the pin
    python benchmarks/side_by_side.py run --algo c51 --side ours --seed 1   # train, then score; again: resume
    python benchmarks/side_by_side.py run --algo c51 --side reference --seed 1
    python benchmarks/side_by_side.py plot runs/side_by_side/c51 --out docs/side_by_side_c51.png
    python benchmarks/side_by_side.py table runs/side_by_side
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import tyro
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: the repository's package beside it
    sys.path.insert(0, str(ROOT))

from cleanrl_utils.record import write_json_atomic  # noqa: E402

# --- the references, pinned ---------------------------------------------------------------------------------------

CLEANRL_REPO = "vwxyzjn/cleanrl"
CLEANRL_COMMIT = (
    "fe8d8a03c41a7ef5b523e2e354bd01c363e786bb"  # master on 2026-04-20; c51_atari.py last changed in 004f8a0
)
CLEANRL_FILES = {  # the files c51_atari.py needs, and their SHA-256 at CLEANRL_COMMIT
    "cleanrl/c51_atari.py": "9662ae7cd512dc6521f687cf95f3953925e3e6648a32ddfe023b71c142e9a907",
    "cleanrl_utils/__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "cleanrl_utils/atari_wrappers.py": "7fbb7a5d6b9c020c99b6e1037f502657bbba4973f1e9c70c9629f66110c81f2d",
    "cleanrl_utils/buffers.py": "b43d54020783ac53f7d23fe7c0ed72aff20e1f377a633d134d66eb9bdbece4b8",
}
RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
# the reference virtual environment: torch first (the CPU build), then these (docs/side_by_side.md)
REFERENCE_VERSIONS = {
    "torch": "2.13.0",
    "stable-baselines3": "2.9.2",
    "sb3-contrib": "2.9.2",
    "gymnasium": "1.4.0",
    "ale-py": "0.12.1",
    "tyro": "1.0.17",
    "tensorboard": "2.21.0",
    "opencv-python-headless": "5.1.0.95",
    "psutil": "7.2.2",
}
SB3_DRIVER = ROOT / "benchmarks" / "side_by_side_sb3.py"


def refvenv_default() -> Path:
    """The reference virtual environment: $VALUE_ATARI_REFVENV, else ``refvenv`` beside the repository."""
    return Path(os.environ.get("VALUE_ATARI_REFVENV", ROOT.parent / "refvenv"))


def cleanrl_dir(refvenv: Path) -> Path:
    """Where ``get-cleanrl`` puts CleanRL's files: inside the reference virtual environment's folder."""
    return refvenv / f"cleanrl-{CLEANRL_COMMIT[:12]}"


# --- run-time patches ---------------------------------------------------------------------------------------------


class PatchError(ValueError):
    pass


@dataclass(frozen=True)
class Patch:
    old: str
    new: str
    why: str


def apply_patches(text: str, patches: list[Patch], name: str = "the reference") -> str:
    """Each patch's ``old`` must occur exactly once in ``text`` (else PatchError: the file is not the pinned one)."""
    for patch in patches:
        count = text.count(patch.old)
        if count != 1:
            raise PatchError(
                f"{name}: the patch for '{patch.why}' expects its text exactly once, found it {count} times: "
                f"{patch.old!r}; the file is not CleanRL's at {CLEANRL_COMMIT[:12]} (run get-cleanrl again)"
            )
        text = text.replace(patch.old, patch.new)
    return text


# Every change made to CleanRL's c51_atari.py before it runs; docs/side_by_side.md lists them line by line.
CLEANRL_C51_PATCHES = [
    Patch(
        "import gymnasium as gym\n",
        "import gymnasium as gym; import ale_py; gym.register_envs(ale_py)  # value-atari: Gymnasium 1.x\n",
        "Gymnasium 1.x finds ALE games only once ale_py registers them",
    ),
    Patch(
        '    """the frequency of training"""\n',
        '    """the frequency of training"""\n'
        "    snapshot_steps: tuple[int, ...] = ()  # value-atari: the snapshots for our evaluator\n"
        '    snapshot_dir: str = "snapshots"\n',
        "two flags: the agent steps at which to save the online network, and where",
    ),
    Patch(
        "gym.wrappers.GrayScaleObservation(env)",
        "gym.wrappers.GrayscaleObservation(env)",
        "Gymnasium 1.0 renamed GrayScaleObservation",
    ),
    Patch(
        "gym.wrappers.FrameStack(env, 4)",
        "gym.wrappers.FrameStackObservation(env, 4)",
        "Gymnasium 1.0 renamed FrameStack (the same stack: the first frame repeated at a reset)",
    ),
    Patch(
        "for i in range(args.num_envs)]\n",
        "for i in range(args.num_envs)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP\n",
        "Gymnasium 0.29's autoreset, which the script was written for (1.x's default, next-step, would store the "
        "step after every life loss and game end as a transition)",
    ),
    Patch(
        'if "final_info" in infos:\n            for info in infos["final_info"]:\n',
        'if "episode" in infos.get("final_info", {}):\n            for info in [infos["final_info"]]:\n',
        "Gymnasium 1.x's final_info is one dict of arrays, not a list of dicts",
    ),
    Patch(
        'infos["final_observation"][idx]',
        'infos["final_obs"][idx]',
        "Gymnasium 1.x's name of a truncated episode's last observation",
    ),
    Patch(
        "                target_network.load_state_dict(q_network.state_dict())\n\n    if args.save_model:",
        "                target_network.load_state_dict(q_network.state_dict())\n"
        "        if global_step + 1 in args.snapshot_steps:  # value-atari: after global_step + 1 agent steps\n"
        '            torch.save(q_network.state_dict(), os.path.join(args.snapshot_dir, f"step_{global_step + 1}.pt"))\n'
        "\n    if args.save_model:",
        "the snapshot: the online network after the updates of the first N agent steps",
    ),
]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def get_cleanrl(refvenv: Path, from_git: Path | None = None) -> Path:
    """CleanRL's files at ``CLEANRL_COMMIT`` into ``cleanrl_dir(refvenv)``, each checked against its SHA-256: from
    GitHub (the raw file at the commit) or, with ``from_git``, from a local clone of CleanRL (``git show``)."""
    dest = cleanrl_dir(refvenv)
    for path, digest in CLEANRL_FILES.items():
        if from_git is not None:
            data = subprocess.run(
                ["git", "-C", str(from_git), "show", f"{CLEANRL_COMMIT}:{path}"], check=True, capture_output=True
            ).stdout
        else:
            url = RAW_URL.format(repo=CLEANRL_REPO, commit=CLEANRL_COMMIT, path=path)
            with urllib.request.urlopen(url, timeout=60) as response:
                data = response.read()
        if sha256(data) != digest:
            raise SystemExit(f"error: {path} at {CLEANRL_COMMIT[:12]} has SHA-256 {sha256(data)}, expected {digest}")
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_bytes(data)
    apply_patches((dest / "cleanrl/c51_atari.py").read_text(), CLEANRL_C51_PATCHES, "c51_atari.py")  # they apply
    return dest


def patched_c51(refvenv: Path) -> str:
    """CleanRL's c51_atari.py as it runs here: the pinned file (checked) with ``CLEANRL_C51_PATCHES`` applied."""
    path = cleanrl_dir(refvenv) / "cleanrl/c51_atari.py"
    if not path.exists():
        raise SystemExit(f"error: {path} is missing; obtain CleanRL first: python {rel(__file__)} get-cleanrl")
    data = path.read_bytes()
    if sha256(data) != CLEANRL_FILES["cleanrl/c51_atari.py"]:
        raise SystemExit(f"error: {path} is not CleanRL's file at {CLEANRL_COMMIT[:12]}; run get-cleanrl again")
    return apply_patches(data.decode(), CLEANRL_C51_PATCHES, "c51_atari.py")


def rel(path: str | Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# --- the schedule -------------------------------------------------------------------------------------------------


@dataclass
class Schedule:
    """What both sides share (docs/side_by_side.md); every other setting is each implementation's own default."""

    env_id: str = "BreakoutNoFrameskip-v4"
    """the game"""
    total_timesteps: int = 300_000
    """agent steps of training, one environment"""
    learning_starts: int = 10_000
    """agent steps before the first update"""
    exploration_fraction: float = 0.1
    """the fraction of the steps over which epsilon goes from 1 to 0.01 (0.1: the first 30k of 300k)"""
    buffer_size: int = 100_000
    """the replay memory's transitions"""
    eval_every: int = 50_000
    """agent steps between evaluations (and the reference's snapshots); the final one at the end"""
    eval_episodes: int = 30
    """whole games per evaluation before the final one"""
    final_eval_episodes: int = 100
    """whole games of the final evaluation"""
    eval_epsilon: float = 0.01
    """epsilon of the evaluation games"""

    def evaluations(self, seed: int) -> list[dict[str, Any]]:
        """Each evaluation: its agent step, whether it is the final one, its games and its seed, as our scripts
        seed them (``Run.evaluate``: seed + 10,000 + 100 x the evaluations before it). Every ``eval_every`` steps
        before the end, then the final one at ``total_timesteps``."""
        steps = list(range(self.eval_every, self.total_timesteps, self.eval_every)) if self.eval_every else []
        points = [{"step": s, "final": False, "episodes": self.eval_episodes} for s in steps]
        points.append({"step": self.total_timesteps, "final": True, "episodes": self.final_eval_episodes})
        return [{**p, "seed": seed + 10_000 + 100 * i} for i, p in enumerate(points)]


# --- the reference's snapshots as networks our evaluator plays ----------------------------------------------------


def nature_layers(n_out: int) -> list[nn.Module]:
    """The Nature CNN as both references write it: three convolutions, flatten, linear 3136 -> 512, then n_out."""
    return [
        nn.Conv2d(4, 32, 8, stride=4),
        nn.ReLU(),
        nn.Conv2d(32, 64, 4, stride=2),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3136, 512),
        nn.ReLU(),
        nn.Linear(512, n_out),
    ]


class CleanRLC51(nn.Module):
    """CleanRL's c51_atari.py ``QNetwork`` (its state_dict's names), forward as its ``get_action``: the logits of
    ``network(x / 255)``, a softmax over the atoms, the expected return per action."""

    def __init__(self, n_actions: int, atoms: torch.Tensor):
        super().__init__()
        self.n, self.n_atoms = n_actions, len(atoms)
        self.register_buffer("atoms", atoms.clone())
        self.network = nn.Sequential(*nature_layers(n_actions * self.n_atoms))

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> CleanRLC51:
        atoms = state["atoms"]
        network = cls(state["network.9.weight"].shape[0] // len(atoms), atoms)
        network.load_state_dict(state)
        return network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.network(x.float() / 255.0)
        pmfs = torch.softmax(logits.view(len(x), self.n, self.n_atoms), dim=2)
        return (pmfs * self.atoms).sum(2)


class SB3QRDQN(nn.Module):
    """sb3-contrib's QR-DQN ``QuantileNetwork`` for ``CnnPolicy`` (its state_dict's names): ``NatureCNN`` on
    ``x / 255`` (sb3's ``preprocess_obs``; our channel-first stacks are what its ``VecTransposeImage`` gives), then
    one linear layer viewed as (batch, n_quantiles, n_actions); the Q-values are the mean over the quantiles."""

    def __init__(self, n_actions: int, n_quantiles: int):
        super().__init__()
        self.n_actions, self.n_quantiles = n_actions, n_quantiles
        layers = nature_layers(n_actions * n_quantiles)
        self.features_extractor = nn.Module()
        self.features_extractor.cnn = nn.Sequential(*layers[:7])
        self.features_extractor.linear = nn.Sequential(*layers[7:9])
        self.quantile_net = nn.Sequential(layers[9])

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any]) -> SB3QRDQN:
        network = cls(snapshot["n_actions"], snapshot["n_quantiles"])
        network.load_state_dict(snapshot["state_dict"])
        return network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.features_extractor.linear(self.features_extractor.cnn(x.float() / 255.0))
        quantiles = self.quantile_net(features).view(-1, self.n_quantiles, self.n_actions)
        return quantiles.mean(dim=1)


def load_snapshot(algo: str, path: Path) -> nn.Module:
    """A reference's snapshot as a network our evaluator plays (CPU)."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    network = CleanRLC51.from_state_dict(saved) if algo == "c51" else SB3QRDQN.from_snapshot(saved)
    return network.eval()


# --- the algorithms ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    name: str  # what the docs and tables call it
    kind: Literal["cleanrl", "sb3"]


REFERENCES = {
    "c51": Reference(f"CleanRL c51_atari.py @ {CLEANRL_COMMIT[:12]}", "cleanrl"),
    "qrdqn": Reference(f"sb3-contrib {REFERENCE_VERSIONS['sb3-contrib']} QRDQN, rl-zoo3 Atari settings", "sb3"),
}
OURS_ONLY = ("dqn", "double_dqn", "mdqn", "nc_qrdqn", "iqn", "rainbow")  # a real-game curve, no reference here
ALGOS = tuple(REFERENCES) + OURS_ONLY


def ours_command(
    algo: str, seed: int, schedule: Schedule, run_dir: Path, threads: int, device: str, checkpoint_every: int
) -> list[str]:
    s = schedule
    return [
        sys.executable, str(ROOT / "algos" / f"{algo}.py"), "--env-id", s.env_id, "--seed", str(seed),
        "--total-timesteps", str(s.total_timesteps), "--learning-starts", str(s.learning_starts),
        "--exploration-fraction", repr(s.exploration_fraction), "--buffer-size", str(s.buffer_size),
        "--num-envs", "1", "--eval-every", str(s.eval_every), "--eval-episodes", str(s.eval_episodes),
        "--eval-epsilon", repr(s.eval_epsilon), "--save-model", "--device", device,
        "--torch-threads", str(threads), "--checkpoint-every", str(checkpoint_every), "--run-dir", str(run_dir),
    ]  # fmt: skip


def reference_command(
    algo: str, seed: int, schedule: Schedule, refvenv: Path, script: Path, snapshots: Path, threads: int, device: str
) -> list[str]:
    s = schedule
    python = str(refvenv / "bin" / "python")
    steps = [str(e["step"]) for e in s.evaluations(seed)]
    common = [
        "--env-id", s.env_id, "--seed", str(seed), "--total-timesteps", str(s.total_timesteps),
        "--learning-starts", str(s.learning_starts), "--exploration-fraction", repr(s.exploration_fraction),
        "--buffer-size", str(s.buffer_size),
    ]  # fmt: skip
    if REFERENCES[algo].kind == "cleanrl":
        device_flag = "--no-cuda" if device == "cpu" else "--cuda"
        return [python, str(script), *common, "--num-envs", "1", device_flag, "--snapshot-dir", str(snapshots),
                "--snapshot-steps", *steps]  # fmt: skip
    return [python, str(SB3_DRIVER), *common, "--device", device, "--threads", str(threads),
            "--snapshot-dir", str(snapshots), "--snapshot-steps", *steps]  # fmt: skip


def reference_env(refvenv: Path, threads: int) -> dict[str, str]:
    """The reference's environment: only its own code on the path (CleanRL's ``cleanrl_utils`` is not ours), and
    ``threads`` torch threads (CleanRL's script sets none: torch reads OMP_NUM_THREADS)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = str(cleanrl_dir(refvenv))
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["VIRTUAL_ENV"] = str(refvenv)
    return env


def reference_versions(refvenv: Path) -> dict[str, str]:
    """The reference environment's installed versions of the pinned packages (pip's own record)."""
    out = subprocess.run(
        [str(refvenv / "bin" / "python"), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return {}
    names = {k.lower().replace("_", "-") for k in REFERENCE_VERSIONS}
    return {p["name"]: p["version"] for p in json.loads(out.stdout) if p["name"].lower().replace("_", "-") in names}


def check_reference_versions(found: dict[str, str]) -> list[str]:
    """What differs from ``REFERENCE_VERSIONS`` (torch's local part, +cpu, aside)."""
    have = {k.lower().replace("_", "-"): v.split("+")[0] for k, v in found.items()}
    return [f"{name} {have.get(name, 'missing')} (pinned {want})" for name, want in REFERENCE_VERSIONS.items()
            if have.get(name) != want]  # fmt: skip


# --- running a side ------------------------------------------------------------------------------------------------


def children_peak_rss_bytes() -> int:
    """The largest resident memory of a finished child of this process (the training: one child per session)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def run_child(command: list[str], cwd: Path, env: dict[str, str] | None, log: Path) -> tuple[int, float]:
    """Run ``command`` in its own process group, its output to the console and appended to ``log``. SIGINT and
    SIGTERM reach it once, forwarded (our scripts then write a checkpoint; a second signal would end them at once).
    Returns the exit status and the wall seconds."""
    cwd.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log, "a") as out:
        out.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} in {cwd}: {shlex.join(command)}\n")
        out.flush()
        child = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, bufsize=1,
        )  # fmt: skip
        forwarded = []

        def forward(signum: int, frame: Any) -> None:
            if not forwarded:
                forwarded.append(signum)
                print(f"\nside_by_side: {signal.Signals(signum).name} passed on to the training", flush=True)
                child.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            assert child.stdout is not None
            for line in child.stdout:
                out.write(line)
                sys.stdout.write(line)
            code = child.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    return code, time.time() - start


@dataclass
class Side:
    """A side's folder: ``OUT/ALGO/SIDE/seedN``, its record ``side.json`` and ``evaluations.json``."""

    out: Path
    algo: str
    side: str
    seed: int

    @property
    def dir(self) -> Path:
        return self.out / self.algo / self.side / f"seed{self.seed}"

    def read(self) -> dict[str, Any]:
        path = self.dir / "side.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def write(self, record: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.dir / "side.json", record)


def ours_run_folder(run_dir: Path) -> Path | None:
    """Our script's run folder under ``run_dir`` (the newest, if an abandoned one sits beside it)."""
    folders = sorted(
        (p for p in run_dir.glob("*__*") if (p / "receipt.json").exists()), key=lambda p: p.stat().st_mtime
    )
    return folders[-1] if folders else None


def train_ours(side: Side, schedule: Schedule, args: RunArgs, record: dict[str, Any]) -> bool:
    """Our script trains (or resumes from its newest checkpoint). True: training finished."""
    run_dir = side.dir / "run"
    folder = ours_run_folder(run_dir)
    receipt = json.loads((folder / "receipt.json").read_text()) if folder else {}
    if receipt.get("status") == "finished":
        return True
    if folder is not None and any((folder / "checkpoints").glob("*")):
        command = [sys.executable, str(ROOT / "algos" / f"{side.algo}.py"), "--resume", str(folder)]
    else:
        if folder is not None:  # stopped before its first checkpoint: nothing to resume from
            folder.rename(folder.with_name(folder.name + ".abandoned"))
        command = ours_command(
            side.algo,
            side.seed,
            schedule,
            run_dir,
            args.threads,
            args.device,
            args.checkpoint_every or schedule.eval_every,
        )
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    code, wall = run_child(command, ROOT, env, side.dir / "train.log")
    folder = ours_run_folder(run_dir)
    receipt = json.loads((folder / "receipt.json").read_text()) if folder else {}
    record["sessions"].append(
        {"command": shlex.join(command), "exit_code": code, "wall_seconds": round(wall, 1),
         "peak_rss_bytes": children_peak_rss_bytes(), "ended": time.strftime("%Y-%m-%dT%H:%M:%S")}
    )  # fmt: skip
    if folder is not None:
        record["run_folder"] = str(folder.relative_to(side.dir))
        record["receipt"] = {k: receipt.get(k) for k in ("status", "wall_seconds", "peak_process_memory_bytes",
                                                         "timings_seconds", "counts", "git", "versions", "resumes")}  # fmt: skip
    return receipt.get("status") == "finished"


def train_reference(side: Side, schedule: Schedule, args: RunArgs, record: dict[str, Any]) -> bool:
    """The reference trains, saving its snapshots. True: training finished. It cannot resume: an interrupted
    training keeps its snapshots (scored), and only ``--restart`` trains it again, from scratch."""
    train = side.dir / "train"
    snapshots = side.dir / "snapshots"
    final = snapshots / f"step_{schedule.total_timesteps}.pt"
    if final.exists():
        return True
    if record["sessions"] and not args.restart:
        print(
            f"side_by_side: {side.dir}'s reference training was interrupted (it cannot resume); its snapshots are "
            "scored; --restart trains it again from scratch (the interrupted attempt is kept aside)",
            flush=True,
        )
        return False
    if record["sessions"]:  # --restart: the interrupted attempt's files aside
        attempt = side.dir / f"interrupted-{len(record['sessions'])}"
        for part in (train, snapshots, side.dir / "evaluations.json", side.dir / "scores"):
            if part.exists():
                attempt.mkdir(exist_ok=True)
                shutil.move(str(part), attempt / part.name)
    snapshots.mkdir(parents=True, exist_ok=True)
    refvenv = args.refvenv
    if not (refvenv / "bin" / "python").exists():
        raise SystemExit(f"error: no reference virtual environment at {refvenv} (docs/side_by_side.md: its set-up)")
    found = reference_versions(refvenv)
    record["reference"] = {"implementation": REFERENCES[side.algo].name, "versions": found,
                           "differs_from_pins": check_reference_versions(found)}  # fmt: skip
    if REFERENCES[side.algo].kind == "cleanrl":
        script = side.dir / "c51_atari_patched.py"  # what ran, kept beside its results
        script.write_text(patched_c51(refvenv))
        record["reference"].update(commit=CLEANRL_COMMIT, files_sha256=CLEANRL_FILES)
    else:
        script = SB3_DRIVER
    command = reference_command(side.algo, side.seed, schedule, refvenv, script, snapshots, args.threads, args.device)
    code, wall = run_child(command, train, reference_env(refvenv, args.threads), side.dir / "train.log")
    record["sessions"].append(
        {"command": shlex.join(command), "cwd": str(train), "exit_code": code, "wall_seconds": round(wall, 1),
         "peak_rss_bytes": children_peak_rss_bytes(), "ended": time.strftime("%Y-%m-%dT%H:%M:%S")}
    )  # fmt: skip
    return code == 0 and final.exists()


def play(network: nn.Module, schedule: Schedule, point: dict[str, Any], threads: int) -> dict[str, Any]:
    """One evaluation by our evaluator, as our scripts' (their protocol: ``TrainEnvs``' defaults)."""
    from cleanrl_utils.envs import TrainEnvs
    from cleanrl_utils.evaluation import evaluate

    torch.set_num_threads(threads)
    envs = TrainEnvs(schedule.env_id, 1, seed=0)
    n_actions, protocol = envs.n_actions, envs.protocol
    envs.close()
    result = evaluate(
        network, schedule.env_id, n_actions, torch.device("cpu"), point["episodes"], schedule.eval_epsilon,
        seed=point["seed"], protocol=protocol,
    )  # fmt: skip
    return {"step": point["step"], "final": point["final"], **result}


def ours_final_network(side: Side) -> nn.Module:
    """Our run's saved model (--save-model), as ``python -m cleanrl_utils.tools.evaluate`` loads it."""
    from cleanrl_utils.tools.evaluate import load_algorithm

    folder = side.dir / side.read()["run_folder"]
    saved = torch.load(folder / f"{side.algo}.cleanrl_model", map_location="cpu", weights_only=True)
    module = load_algorithm(ROOT / "algos" / f"{side.algo}.py")
    network = module.QNetwork(saved["n_actions"], **saved["network_kwargs"])
    network.load_state_dict(saved["state_dict"])
    return network.eval()


def score(side: Side, schedule: Schedule, args: RunArgs, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Each due evaluation not yet scored, kept as it ends (``scores/step_N.json``); then ``evaluations.json``.
    Ours: the evaluations its run made (their seeds checked), and the final one played here with the final number
    of games. The reference: each snapshot played here."""
    scores = side.dir / "scores"
    scores.mkdir(parents=True, exist_ok=True)
    done = []
    start = time.time()
    ours_run = None
    if side.side == "ours" and record.get("run_folder"):
        ours_run = json.loads((side.dir / record["run_folder"] / "evaluations.json").read_text())
    for point in schedule.evaluations(side.seed):
        path = scores / f"step_{point['step']}.json"
        if path.exists():
            done.append(json.loads(path.read_text()))
            continue
        if side.side == "ours" and not point["final"]:
            made = [e for e in ours_run or [] if e["step"] == point["step"] and not e["final"]]
            if not made:
                continue
            if made[0]["seed"] != point["seed"] or len(made[0]["episodic_returns"]) != point["episodes"]:
                raise SystemExit(f"error: {side.dir}'s run evaluated step {point['step']} with seed "
                                 f"{made[0]['seed']} ({len(made[0]['episodic_returns'])} games); the reference's "
                                 f"evaluation uses seed {point['seed']} ({point['episodes']} games)")  # fmt: skip
            result = made[0]
        elif side.side == "ours":
            if record.get("receipt", {}).get("status") != "finished":
                continue
            print(f"side_by_side: {side.dir}: final evaluation, {point['episodes']} games", flush=True)
            result = play(ours_final_network(side), schedule, point, args.threads)
        else:
            snapshot = side.dir / "snapshots" / f"step_{point['step']}.pt"
            if not snapshot.exists():
                continue
            try:
                network = load_snapshot(side.algo, snapshot)
            except Exception as error:  # a snapshot cut short by a stop: left out, said
                print(f"side_by_side: {snapshot} cannot be read ({error}); left out", flush=True)
                continue
            print(f"side_by_side: {side.dir}: step {point['step']}, {point['episodes']} games", flush=True)
            result = play(network, schedule, point, args.threads)
        write_json_atomic(path, result)
        print(f"side_by_side: step {point['step']}: {result['mean']:.2f} +- {result['std']:.2f}", flush=True)
        done.append(result)
    record["scoring_wall_seconds"] = round(record.get("scoring_wall_seconds", 0.0) + time.time() - start, 1)
    done.sort(key=lambda e: e["step"])
    write_json_atomic(side.dir / "evaluations.json", done)
    return done


@dataclass
class RunArgs:
    """Train one side (ours or the reference) of one algorithm and seed, then score it with our evaluator; run it
    again to go on: our side resumes from its newest checkpoint, a finished side is only scored (what is left)."""

    algo: Literal["c51", "qrdqn", "dqn", "double_dqn", "mdqn", "nc_qrdqn", "iqn", "rainbow"] = "c51"
    """our script (algos/ALGO.py); c51 and qrdqn have a reference"""
    side: Literal["ours", "reference"] = "ours"
    """which implementation trains"""
    seed: int = 1
    """the training seed (evaluation games: seed + 10,000 + 100 x the evaluations before, as our scripts)"""
    out: Path = Path("runs/side_by_side")
    """the folder of all side-by-side runs: OUT/ALGO/SIDE/seedN"""
    refvenv: Path = field(default_factory=refvenv_default)
    """the reference's virtual environment ($VALUE_ATARI_REFVENV, else refvenv beside the repository)"""
    threads: int = 1
    """torch threads of the training and of the scoring"""
    device: Literal["cpu", "cuda"] = "cpu"
    """the training device of both sides (the scoring plays on CPU)"""
    checkpoint_every: int = 0
    """our side's checkpoints, agent steps apart (0: the schedule's eval-every)"""
    restart: bool = False
    """train an interrupted reference side again from scratch (it cannot resume)"""
    schedule: Annotated[Schedule, tyro.conf.OmitArgPrefixes] = field(default_factory=Schedule)
    """the schedule both sides share"""


def run(args: RunArgs) -> int:
    if args.side == "reference" and args.algo not in REFERENCES:
        raise SystemExit(f"error: --algo {args.algo} has no reference here; the references: {', '.join(REFERENCES)}")
    schedule = args.schedule
    side = Side(args.out, args.algo, args.side, args.seed)
    record = side.read() or {"algo": args.algo, "side": args.side, "seed": args.seed, "sessions": []}
    if record.get("schedule") and record["schedule"] != asdict(schedule):
        raise SystemExit(f"error: {side.dir} ran with another schedule: {record['schedule']}; use another --out")
    record["schedule"] = asdict(schedule)
    record["runner_command"] = shlex.join([sys.executable, *sys.argv])
    side.write(record)
    trained = record.get("trained", False)
    if not trained:
        trained = (train_ours if args.side == "ours" else train_reference)(side, schedule, args, record)
        record["trained"] = trained
        record["training_wall_seconds"] = round(sum(s["wall_seconds"] for s in record["sessions"]), 1)
        record["peak_memory_bytes"] = max((s["peak_rss_bytes"] for s in record["sessions"]), default=0)
        side.write(record)
    evaluations = score(side, schedule, args, record)
    record["status"] = "finished" if trained and evaluations and evaluations[-1]["final"] else "partial"
    side.write(record)
    steps = ", ".join(f"{e['step']}: {e['mean']:.2f}" for e in evaluations)
    print(f"side_by_side: {side.dir}: {record['status']}; evaluations {steps or 'none yet'}", flush=True)
    return 0 if record["status"] == "finished" else 1


# --- results: plot and table ---------------------------------------------------------------------------------------


def read_sides(algo_dir: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """{side: {seed: {"evaluations": [...], "record": side.json}}} under OUT/ALGO."""
    sides: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(algo_dir.glob("*/seed*/evaluations.json")):
        evaluations = json.loads(path.read_text())
        if evaluations:
            record = json.loads((path.parent / "side.json").read_text())
            sides.setdefault(path.parent.parent.name, {})[int(path.parent.name[4:])] = {
                "evaluations": evaluations, "record": record}  # fmt: skip
    return sides


@dataclass
class PlotArgs:
    """Evaluation return against agent steps: each seed (thin) and the mean over seeds (thick), ours and the
    reference's; the random agent's score dotted. Writes the PNG and an SVG beside it."""

    algo_dir: Annotated[tyro.conf.Positional[Path], tyro.conf.arg(metavar="OUT/ALGO")]
    out: Path = Path("side_by_side.png")


def plot(args: PlotArgs) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from cleanrl_utils.scores import REFERENCE_SCORES, game_name
    from cleanrl_utils.tools.plot import steps_label

    sides = read_sides(args.algo_dir)
    if not sides:
        raise SystemExit(f"error: no evaluations under {args.algo_dir}/*/seed*/")
    algo = args.algo_dir.name
    fig, ax = plt.subplots(figsize=(7, 4.5))
    env_id = None
    for (name, seeds), color in zip(sorted(sides.items(), key=lambda kv: kv[0] != "ours"), ("C0", "C1"), strict=False):
        label = f"ours (algos/{algo}.py)" if name == "ours" else REFERENCES[algo].name
        curves = {}
        for seed, data in sorted(seeds.items()):
            env_id = data["record"]["schedule"]["env_id"]
            steps = [e["step"] for e in data["evaluations"]]
            means = [e["mean"] for e in data["evaluations"]]
            curves[seed] = dict(zip(steps, means, strict=True))
            ax.plot(steps, means, color=color, alpha=0.35, linewidth=1, marker=".")
        common = sorted(set.intersection(*(set(c) for c in curves.values())))
        mean = [np.mean([c[s] for c in curves.values()]) for s in common]
        ax.plot(
            common,
            mean,
            color=color,
            linewidth=2.5,
            label=f"{label}: mean of {len(curves)} seed{'s' if len(curves) > 1 else ''}",
        )
    game = game_name(env_id) if env_id else None
    if game in REFERENCE_SCORES:
        ax.axhline(REFERENCE_SCORES[game][0], color="gray", linestyle=":", label="random agent")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(steps_label))
    ax.set_xlabel("agent steps")
    ax.set_ylabel("evaluation return (whole games, epsilon 0.01)")
    ax.set_title(f"{algo} on {env_id}: our evaluator, both sides")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for path in (args.out, args.out.with_suffix(".svg")):
        fig.savefig(path, dpi=120)
        print(path)
    return 0


@dataclass
class TableArgs:
    """A Markdown table of every side under OUT: final evaluation per seed, training wall time, peak memory."""

    out: Annotated[tyro.conf.Positional[Path], tyro.conf.arg(metavar="OUT")] = Path("runs/side_by_side")


def table(args: TableArgs) -> int:
    import numpy as np

    rows = ["| algorithm | side | seed | final evaluation (games) | training wall time | peak memory | status |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for algo_dir in sorted(p for p in args.out.iterdir() if p.is_dir()):
        for name, seeds in sorted(read_sides(algo_dir).items(), key=lambda kv: kv[0] != "ours"):
            finals = []
            for seed, data in sorted(seeds.items()):
                last, record = data["evaluations"][-1], data["record"]
                final = f"{last['mean']:.2f} +- {last['std']:.2f} ({len(last['episodic_returns'])})"
                if not last["final"]:
                    final = f"step {last['step']}: {final}"
                else:
                    finals.append(last["mean"])
                wall = record.get("training_wall_seconds", 0)
                memory = record.get("peak_memory_bytes", 0) / 2**30
                side = "ours" if name == "ours" else REFERENCES[algo_dir.name].name
                rows.append(f"| {algo_dir.name} | {side} | {seed} | {final} | {wall:,.0f} s | {memory:.2f} GiB | "
                            f"{record.get('status', '?')} |")  # fmt: skip
            if len(finals) > 1:
                rows.append(f"| {algo_dir.name} | {name}: mean | | {np.mean(finals):.2f} (seeds' std "
                            f"{np.std(finals):.2f}) | | | |")  # fmt: skip
    print("\n".join(rows))
    return 0


@dataclass
class GetCleanRLArgs:
    """Obtain CleanRL's c51_atari.py and the cleanrl_utils files it imports at the pinned commit, into the
    reference virtual environment's folder (REFVENV/cleanrl-COMMIT), each checked against its SHA-256."""

    refvenv: Path = field(default_factory=refvenv_default)
    """the reference's virtual environment ($VALUE_ATARI_REFVENV, else refvenv beside the repository)"""
    from_git: Path | None = None
    """a local clone of CleanRL to read the commit from (git show) instead of downloading the raw files"""


def main(argv: list[str] | None = None) -> int:
    command = tyro.extras.subcommand_cli_from_dict(
        {"run": RunArgs, "plot": PlotArgs, "table": TableArgs, "get-cleanrl": GetCleanRLArgs}, args=argv
    )
    if isinstance(command, RunArgs):
        return run(command)
    if isinstance(command, PlotArgs):
        return plot(command)
    if isinstance(command, TableArgs):
        return table(command)
    print(get_cleanrl(command.refvenv, command.from_git))
    return 0


if __name__ == "__main__":
    sys.exit(main())
