"""What the replay memory takes, compressed (the default) and raw, on real games' frames.

    python benchmarks/replay_memory.py --games Breakout Pong Seaquest MsPacman --steps 20000 --fill 1000000

Two measures, each printed and written as JSON (``--json``); nothing is asserted:
- per game: ``--steps`` agent steps of uniform random play (one game after another, the training protocol) stored
  in a memory as the scripts store them; the bytes per transition it reports (``ReplayBuffer.memory``: each
  frame's compressed bytes as the allocators round them, its reference, the transition's metadata), the frames'
  compressed sizes, and the start-up check's estimate for the game (``CompressedFrames.estimate``);
- ``--fill N`` on the first game: in a fresh process per form (compressed, then raw with ``--raw-fill``), a memory
  of N transitions filled from that game's real frames (the random play's stream, replayed in a loop when N is
  longer), with the process's resident memory before and after and its peak (``ru_maxrss``).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import zstandard  # noqa: E402

from cleanrl_utils.buffer import CompressedFrames, ReplayBuffer, blob_bytes  # noqa: E402
from cleanrl_utils.envs import TrainEnvs, random_play_frames  # noqa: E402


def play(env_id: str, steps: int, seed: int) -> tuple[ReplayBuffer, np.ndarray]:
    """``steps`` agent steps of random play stored in a compressed memory that holds them all, and the newest
    frame of each step's observation (the stream the fill replays)."""
    envs = TrainEnvs(env_id, 1, seed=seed)
    memory = ReplayBuffer(steps + 10_000, 1, seed=seed, compress=True)
    rng = np.random.default_rng(seed)
    obs = envs.reset()
    frames = [*obs[0]]
    for _ in range(steps):
        actions = rng.integers(0, envs.n_actions, 1)
        step = envs.step(actions)
        memory.add(obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        frames.append(step.next_obs[0, -1])
        obs = step.next_obs
    envs.close()
    return memory, np.stack(frames)


def per_game(game: str, steps: int, seed: int) -> dict[str, Any]:
    env_id = f"{game}NoFrameskip-v4"
    start = time.perf_counter()
    memory, frames = play(env_id, steps, seed)
    compressor = zstandard.ZstdCompressor(level=1)
    sizes = np.array([len(compressor.compress(f.data)) for f in frames])
    return {
        "game": game,
        "agent_steps": steps,
        "agent": "uniform random",
        "memory": memory.memory(),
        "frame_bytes_mean": float(sizes.mean()),
        "frame_bytes_max": int(sizes.max()),
        "frame_bytes_allocated_mean": float(np.mean([blob_bytes(compressor.compress(f.data)) for f in frames])),
        "startup_estimate_bytes_per_transition": CompressedFrames.estimate(random_play_frames(env_id, seed=seed)),
        "seconds": round(time.perf_counter() - start, 1),
    }


def fill_child(game: str, transitions: int, steps: int, seed: int, compress: bool) -> dict[str, Any]:
    process = psutil.Process()
    _, frames = play(f"{game}NoFrameskip-v4", steps, seed)
    stack = 4
    before = process.memory_info().rss
    memory = ReplayBuffer(transitions, 1, seed=seed, compress=compress)
    no = np.zeros(1, dtype=bool)
    action, reward = np.zeros(1, np.int64), np.zeros(1, np.float32)
    start = time.perf_counter()
    for t in range(transitions):
        i = stack + t % (len(frames) - stack)  # the stream's frames, replayed in a loop
        window = frames[i - stack : i + 1]
        memory.add(window[None, :stack], window[None, 1:], action, reward, no, no)
    seconds = time.perf_counter() - start
    after = process.memory_info().rss
    t0 = time.perf_counter()
    for _ in range(200):
        memory.sample(32)
    return {
        "game": game,
        "frames": "compressed" if compress else "raw",
        "transitions": transitions,
        "real_frames_replayed": len(frames),
        "rss_before_bytes": before,
        "rss_after_fill_bytes": after,
        "resident_growth_bytes": after - before,
        "resident_growth_bytes_per_transition": (after - before) / transitions,
        "peak_process_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "memory_report": memory.memory(),
        "fill_seconds": round(seconds, 1),
        "sample_32_ms": round((time.perf_counter() - t0) / 200 * 1e3, 3),
    }


def fill(game: str, transitions: int, steps: int, seed: int, compress: bool) -> dict[str, Any]:
    command = [sys.executable, __file__, "--fill-child", "--games", game, "--fill", str(transitions),
               "--steps", str(steps), "--seed", str(seed)] + ([] if compress else ["--raw-fill"])  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", nargs="+", default=["Breakout", "Pong", "Seaquest", "MsPacman"])
    parser.add_argument("--steps", type=int, default=20_000, help="agent steps of random play per game")
    parser.add_argument("--fill", type=int, default=0, help="transitions of the fill measure (0: none)")
    parser.add_argument("--raw-fill", action="store_true", help="also fill a raw memory (7.1 GB per 1M)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--fill-child", action="store_true", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.fill_child:
        print(json.dumps(fill_child(cli.games[0], cli.fill, cli.steps, cli.seed, compress=not cli.raw_fill)))
        return
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpu": platform.processor(),
            "python": platform.python_version(),
            "zstandard": zstandard.__version__,
        },
        "games": [],
        "fills": [],
    }
    try:
        report["machine"]["cpu"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    print(f"{'game':<10} {'bytes/transition':>16} {'frame mean':>10} {'frame max':>9} {'estimate':>8}")
    for game in cli.games:
        figures = per_game(game, cli.steps, cli.seed)
        report["games"].append(figures)
        print(
            f"{game:<10} {figures['memory']['bytes_per_transition']:>16,.1f} {figures['frame_bytes_mean']:>10,.0f} "
            f"{figures['frame_bytes_max']:>9,} {figures['startup_estimate_bytes_per_transition']:>8,}",
            flush=True,
        )
    if cli.fill:
        for compress in [True] + ([False] if cli.raw_fill else []):
            figures = fill(cli.games[0], cli.fill, cli.steps, cli.seed, compress)
            report["fills"].append(figures)
            if "error" in figures:
                print(figures["error"])
                continue
            print(
                f"{cli.games[0]}, {figures['transitions']:,} transitions, {figures['frames']}: resident growth "
                f"{figures['resident_growth_bytes'] / 1e9:.3f} GB ({figures['resident_growth_bytes_per_transition']:,.0f} "
                f"bytes a transition; the memory's own count {figures['memory_report']['bytes_per_transition']:,.0f}), "
                f"process peak {figures['peak_process_rss_bytes'] / 1e9:.3f} GB, filled in {figures['fill_seconds']} s, "
                f"a batch of 32 sampled in {figures['sample_32_ms']} ms",
                flush=True,
            )
    if cli.json:
        Path(cli.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
