"""Argument validation and device choice: clear, early errors before anything large exists."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import psutil
import torch

from cleanrl_utils.buffer import ReplayBuffer


def fail(message: str) -> NoReturn:
    """Stop with a one-line message and exit status 2, without a traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def validate_args(args: Any, replay: bool = True) -> None:
    """Check the flags every script shares; each message names the flag, the value and the fix. ``replay=False``:
    a script without replay memory or target network (PQN), whose Args lack those flags."""
    positive = ["total_timesteps", "num_envs", "eval_episodes"]
    positive += ["buffer_size", "batch_size", "train_frequency", "target_network_frequency"] if replay else []
    for name in positive:
        value = getattr(args, name)
        if value <= 0:
            fail(f"--{name.replace('_', '-')} {value} must be a positive integer")
    if args.eval_every < 0:
        fail(f"--eval-every {args.eval_every} must be >= 0 (0 turns periodic evaluation off)")
    if replay:
        validate_replay_args(args)
    if not 0.0 < args.gamma <= 1.0:
        fail(f"--gamma {args.gamma} must be in (0, 1]")
    if not args.learning_rate > 0.0:
        fail(f"--learning-rate {args.learning_rate} must be > 0")
    for name in ("start_e", "end_e", "eval_epsilon"):
        value = getattr(args, name)
        if not 0.0 <= value <= 1.0:
            fail(f"--{name.replace('_', '-')} {value} must be in [0, 1]")
    if args.start_e < args.end_e:
        fail(f"--start-e {args.start_e} is below --end-e {args.end_e}; epsilon decays from start to end")
    if getattr(args, "checkpoint_every", 0) < 0:
        fail(f"--checkpoint-every {args.checkpoint_every} must be >= 0 (0: checkpoint only on SIGINT/SIGTERM)")
    if getattr(args, "checkpoint_keep", 1) < 1:
        fail(f"--checkpoint-keep {args.checkpoint_keep} must be >= 1 (the newest checkpoints kept)")
    adam_eps = getattr(args, "adam_eps", 1.0)
    if not (math.isfinite(adam_eps) and adam_eps > 0):
        fail(f"--adam-eps {adam_eps} must be > 0 and finite (this script's default: {type(args).adam_eps})")
    if not 0.0 < args.exploration_fraction <= 1.0:
        fail(f"--exploration-fraction {args.exploration_fraction} must be in (0, 1]")
    if getattr(args, "track", False) and importlib.util.find_spec("wandb") is None:
        fail("--track needs Weights & Biases: pip install 'value-atari[track]' (or pip install wandb)")


def validate_replay_args(args: Any) -> None:
    """The replay memory's and target network's flags (validate_args calls it)."""
    if args.learning_starts < 0:
        fail(f"--learning-starts {args.learning_starts} must be >= 0")
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} is smaller than --batch-size {args.batch_size}; raise --buffer-size")
    slots = -(-args.buffer_size // args.num_envs)
    n_step = getattr(args, "n_step", 1)  # multi-step scripts: a stack, the n steps and the next observation's slot
    need = ReplayBuffer.slots_needed(n_step)
    if slots < need:
        fail(
            f"--buffer-size {args.buffer_size} gives {slots} replay slots per environment with --num-envs "
            f"{args.num_envs}; each needs at least {need} (a frame stack and an --n-step {n_step} transition): "
            f"raise --buffer-size to at least {need * args.num_envs}" + (" or lower --n-step" if n_step > 1 else "")
        )
    if args.learning_starts < args.batch_size:
        fail(
            f"--learning-starts {args.learning_starts} is smaller than --batch-size {args.batch_size}; "
            "learning needs at least one batch of stored transitions: raise --learning-starts"
        )
    if not 0.0 < args.tau <= 1.0:
        fail(f"--tau {args.tau} must be in (0, 1] (1 copies the online network into the target)")
    if getattr(args, "checkpoint_buffer", False):  # a warning: the disk may be freed before the first checkpoint
        need = args.buffer_size * 84 * 84 * min(args.checkpoint_keep + 1, 2)  # the frames, one per transition
        folder = next(p for p in [Path(args.run_dir).absolute(), *Path(args.run_dir).absolute().parents] if p.exists())
        free = shutil.disk_usage(folder).free
        if need > free:
            print(
                f"warning: --checkpoint-buffer needs about {need / 2**30:.1f} GiB on disk for the replay memory's "
                f"checkpoints, {free / 2**30:.1f} GiB are free under {folder}: checkpoints may fail",
                file=sys.stderr,
                flush=True,
            )
    # the updates the loop makes: one for each multiple of --train-frequency that the vector steps after
    # --learning-starts cross (the loop's last vector step may pass --total-timesteps)
    first = (args.learning_starts // args.num_envs + 1) * args.num_envs  # the first vector step that learns
    last = -(-args.total_timesteps // args.num_envs) * args.num_envs
    if first > last or last // args.train_frequency == (first - args.num_envs) // args.train_frequency:
        reason = (
            f"is at or above --total-timesteps {args.total_timesteps}"
            if args.learning_starts >= args.total_timesteps
            else f"leaves no update before --total-timesteps {args.total_timesteps} (one every --train-frequency "
            f"{args.train_frequency} agent steps)"
        )
        print(
            f"warning: --learning-starts {args.learning_starts} {reason}: the network is never updated, so this run "
            "measures an untrained agent (a random-agent baseline); to learn, lower --learning-starts or raise "
            "--total-timesteps",
            file=sys.stderr,
            flush=True,
        )


def pick_device(name: str) -> torch.device:
    """``auto``: CUDA, then Apple MPS, then CPU. An explicit device that is absent is an error."""
    cuda = torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if cuda else "mps" if mps else "cpu")
    if name == "cuda" and not cuda:
        fail("--device cuda: no CUDA device is available here; use --device auto or --device cpu")
    if name == "mps" and not mps:
        fail("--device mps: Apple MPS is not available here; use --device auto or --device cpu")
    if name not in ("cuda", "mps", "cpu"):
        fail(f"--device {name} is not one of auto, cuda, mps, cpu")
    return torch.device(name)


class CpuThreads:
    """How many CPU threads torch should use now (the script sets them: ``torch.set_num_threads``).

    ``--torch-threads N``: always N. ``0`` (automatic): as many as the cores that other processes leave
    free, at least 1 and at most torch's default, re-read every ``interval_s`` seconds from the machine's
    and this process's CPU times. torch's OpenMP threads wait for each other by spinning, so with one of
    2 cores held by another process, 2 threads ran DQN's learning phase 3x slower than 1 thread did
    (benchmarks/RESULTS.md, "Under load"); on a quiet machine all of torch's threads are kept."""

    def __init__(self, requested: int, interval_s: float = 5.0) -> None:
        if requested < 0:
            fail(f"--torch-threads {requested} must be >= 0 (0: automatic; 1 is safest on a shared machine)")
        self.automatic = requested == 0
        self.most = requested or torch.get_num_threads()
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.interval_s = interval_s
        self.threads = self.most
        self.others = 0.0  # cores used by other processes over the latest interval
        self._process = psutil.Process()
        self._mark = self._times()
        if self.automatic:
            print(
                f"torch threads: {self.threads} (automatic: fewer while other processes use some of the "
                f"{self.cores} cores; --torch-threads N fixes it)",
                flush=True,
            )
        else:
            print(f"torch threads: {self.threads} (--torch-threads)", flush=True)

    def _times(self) -> tuple[float, float, float]:
        """(wall clock, the machine's busy CPU seconds, this process's CPU seconds)."""
        machine = psutil.cpu_times()
        busy = sum(getattr(machine, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
        own = self._process.cpu_times()
        return time.monotonic(), busy, own.user + own.system

    def choose(self) -> int:
        """The number of threads for the next interval; the same number until ``interval_s`` has passed."""
        if not self.automatic:
            return self.threads
        now = self._times()
        elapsed = now[0] - self._mark[0]
        if elapsed < self.interval_s:
            return self.threads
        self.others = max(0.0, (now[1] - self._mark[1]) - (now[2] - self._mark[2])) / elapsed
        self._mark = now
        # any other process using more than a fifth of a core takes a whole core from us: our spinning
        # threads are the first to starve, and a thread too many costs far more than a thread too few
        threads = max(1, min(self.most, self.cores - math.ceil(self.others - 0.2)))
        if threads != self.threads:
            print(
                f"torch threads: {threads} (other processes used {self.others:.1f} of {self.cores} cores)", flush=True
            )
        self.threads = threads
        return threads


def pick_buffer_device(name: str, device: torch.device) -> torch.device | None:
    """``--buffer-device``: ``host`` keeps the replay frames in host memory (None); ``cuda`` puts them on
    the training GPU, where the batches are then sampled, so it needs ``--device`` to be CUDA."""
    if name == "host":
        return None
    if name != "cuda":
        fail(f"--buffer-device {name} is not one of host, cuda")
    if device.type != "cuda":
        fail(
            f"--buffer-device cuda keeps the replay on the GPU that trains, but the device is {device.type}; "
            "use --device cuda (or auto on a CUDA machine) or --buffer-device host"
        )
    return device


def check_memory(buffer_size: int, bytes_per_transition: int, buffer_device: torch.device | str | None = None) -> None:
    """Preflight, before allocating: refuse a replay buffer that cannot fit (with the figures), warn
    where only swap or overcommit could carry it. A buffer on a CUDA GPU is compared with its memory."""
    need = buffer_size * bytes_per_transition
    figures = (
        f"--buffer-size {buffer_size:,} needs {need / 2**30:.1f} GiB ({bytes_per_transition:,} bytes per transition)"
    )
    if buffer_device is not None and torch.device(buffer_device).type == "cuda":
        free, total = torch.cuda.mem_get_info(torch.device(buffer_device))
        if need > free:
            fail(
                f"{figures} on {buffer_device}, which has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free; "
                f"lower --buffer-size to at most {int(free * 0.8) // bytes_per_transition:,} or keep the buffer in RAM"
            )
        return
    memory = psutil.virtual_memory()
    swap = psutil.swap_memory()
    if need > memory.total + swap.free:
        fail(
            f"{figures} but this machine has {memory.total / 2**30:.1f} GiB of memory and "
            f"{swap.free / 2**30:.1f} GiB of free swap; lower --buffer-size to at most "
            f"{int(memory.available * 0.8) // bytes_per_transition:,}"
        )
    if need > memory.available:
        print(
            f"warning: {figures}, more than the {memory.available / 2**30:.1f} GiB available now; "
            "the run may swap or be killed when the buffer fills",
            file=sys.stderr,
        )
