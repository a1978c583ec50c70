"""What a checkpoint of the replay memory costs: time and bytes, whole (every checkpoint writing the memory again, as
before issue 40) against incremental (each checkpoint appending the frames stored since the one before), at a
memory of N transitions with a checkpoint every INTERVAL of them, and the disk the checkpoints folder holds.

    python benchmarks/checkpoint_cost.py --transitions 100000 --interval 100000 --checkpoints 4 --json out.json

The memory is filled with real (random) frames through ``ReplayBuffer.add``'s storage layout, one ring; the
checkpoints are written by ``cleanrl_utils.checkpoint.save_checkpoint`` into a temporary folder on the run disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.checkpoint import FRAMES, save_checkpoint
from cleanrl_utils.envs import TrainEnvs


def store(buffer: ReplayBuffer, count: int, rng: np.random.Generator, game: GameFrames | None = None) -> None:
    """``count`` transitions of one long episode, written as ``add`` writes them (one frame per transition):
    random bytes (incompressible, the worst case), or ``game``'s real frames"""
    obs = rng.integers(0, 256, (1, 4, 84, 84), dtype=np.uint8)
    for _ in range(count):
        frame = rng.integers(0, 256, (1, 1, 84, 84), dtype=np.uint8) if game is None else game.next()
        next_obs = np.concatenate([obs[:, 1:], frame], axis=1)
        buffer.add(obs, next_obs, [0], [0.0], [False], [False])
        obs = next_obs


class GameFrames:
    """The newest 84x84 frames of a real game played at random (the run's preprocessing), restarted at its end."""

    def __init__(self, env_id: str) -> None:
        self.envs = TrainEnvs(env_id, 1, seed=0)
        self.obs = self.envs.reset()

    def next(self) -> np.ndarray:
        self.obs = self.envs.step(np.random.randint(self.envs.n_actions, size=1)).next_obs
        return self.obs[:, -1:]


def compression(frames: np.ndarray) -> dict:
    """zstandard on one segment's frames: the ratio and the time, per level (one thread, as a checkpoint would)"""
    import zstandard

    raw = frames.tobytes()
    found = {}
    for level in (1, 3):
        t0 = time.perf_counter()
        packed = zstandard.ZstdCompressor(level=level).compress(raw)
        seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        zstandard.ZstdDecompressor().decompress(packed)
        found[f"level_{level}"] = {
            "ratio": round(len(raw) / len(packed), 2),
            "compress_MB_per_s": round(len(raw) / 1e6 / seconds, 1),
            "decompress_MB_per_s": round(len(raw) / 1e6 / (time.perf_counter() - t0), 1),
        }
    return found


def frames_named(segment: Path) -> int:
    """a segment's frame count, from its name: env<E>_<first>_<end>_<token>.zst"""
    _, start, stop, _ = segment.stem.split("_")
    return int(stop) - int(start)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def whole(buffer: ReplayBuffer, folder: Path) -> float:
    """the earlier checkpoint's replay part: every array of the memory written again, fsynced"""
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for name, value in buffer.state_dict().items():
        if isinstance(value, np.ndarray):
            with open(folder / f"{name}.npy", "wb") as f:
                np.save(f, value)
                f.flush()
                os.fsync(f.fileno())
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transitions", type=int, default=100_000, help="the replay memory's size")
    parser.add_argument("--interval", type=int, default=100_000, help="transitions stored between checkpoints")
    parser.add_argument("--checkpoints", type=int, default=4, help="checkpoints written after the memory is full")
    parser.add_argument("--keep", type=int, default=3, help="--checkpoint-keep")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    parser.add_argument("--game", default=None, help="real frames of this game at random play (default: random bytes)")
    parser.add_argument(
        "--raw", action="store_true", help="the memory's frames raw (the scripts' --no-compress-replay)"
    )
    parser.add_argument("--json", default=None)
    cli = parser.parse_args()
    rng = np.random.default_rng(0)
    root = Path(tempfile.mkdtemp(dir=cli.dir))
    buffer = ReplayBuffer(cli.transitions, 1, seed=0, compress=not cli.raw)
    game = GameFrames(cli.game) if cli.game else None
    store(buffer, cli.transitions, rng, game)  # a full memory
    state = {"algo": "dqn", "weights": torch.zeros(1_700_000)}  # about a network's size beside it
    report: dict = {
        "transitions": cli.transitions,
        "interval": cli.interval,
        "keep": cli.keep,
        "frames": cli.game or "random bytes",
        "memory": "raw" if cli.raw else "compressed",
        "rounds": [],
    }
    segments = None
    try:
        t0 = time.perf_counter()
        _, segments = save_checkpoint(root / "new", 0, state, buffer, cli.keep, segments)
        first = time.perf_counter() - t0
        for k in range(1, cli.checkpoints + 1):
            store(buffer, cli.interval, rng, game)
            before = folder_bytes(root / "new")
            t0 = time.perf_counter()
            _, segments = save_checkpoint(root / "new", k, state, buffer, cli.keep, segments)
            incremental = time.perf_counter() - t0
            written = folder_bytes(root / "new") - before
            shutil.rmtree(root / "old", ignore_errors=True)
            old_seconds = whole(buffer, root / "old")
            report["rounds"].append(
                {
                    "incremental_seconds": round(incremental, 3),
                    "incremental_bytes_added": written,
                    "whole_seconds": round(old_seconds, 3),
                    "whole_bytes": folder_bytes(root / "old"),
                    "checkpoints_folder_bytes": folder_bytes(root / "new"),
                    "frames_on_disk": sum(frames_named(f) for f in (root / "new" / FRAMES).iterdir()),
                }
            )
            print(json.dumps(report["rounds"][-1]), flush=True)
        memory_bytes = buffer.nbytes()
        segment = buffer.frames_written(0, int(buffer.written[0]) - cli.interval, int(buffer.written[0]))
        report["zstandard_on_a_segment"] = compression(np.ascontiguousarray(segment))
        print(json.dumps(report["zstandard_on_a_segment"]), flush=True)
        report.update(
            first_checkpoint_seconds=round(first, 3),
            memory_bytes=memory_bytes,
            machine={"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        )
        last = report["rounds"][-1]
        print(
            f"memory {cli.transitions:,} transitions ({memory_bytes / 2**30:.2f} GiB), a checkpoint every "
            f"{cli.interval:,}: incremental {last['incremental_seconds']:.2f} s and "
            f"{last['incremental_bytes_added'] / 2**30:.2f} GiB added; whole {last['whole_seconds']:.2f} s and "
            f"{last['whole_bytes'] / 2**30:.2f} GiB; the checkpoints folder holds "
            f"{last['checkpoints_folder_bytes'] / memory_bytes:.2f} memories ({cli.keep} kept)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if cli.json:
        Path(cli.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
