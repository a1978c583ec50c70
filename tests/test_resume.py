"""A stopped run resumes learning where it was, by default (issue 40): checkpoints hold the replay memory,
written incrementally (each checkpoint appends only the frames stored since the one before; the disk holds about
one memory), a kill -9 during a write leaves the newest complete checkpoint whole, a finished run refuses a plain
--resume and accepts an extension, and --no-checkpoint-buffer says at once when a resume cannot learn again.
Real replay memories, real files, real runs of the scripts (subprocesses); no mocks."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from conftest import REPO, run_python

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.checkpoint import FRAMES, list_checkpoints, load_checkpoint, save_checkpoint

SHAPE = (4, 12, 12)  # small frames: the same code as 84x84, a thousandth of the bytes


def filled(buffer: ReplayBuffer, steps: int, seed: int) -> None:
    """``steps`` vector steps of a stream of frame stacks with episode ends, from ``seed``"""
    rng = np.random.default_rng(seed)
    n = buffer.num_envs
    obs = rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8)
    for _ in range(steps):
        frame = rng.integers(0, 256, (n, 1, *SHAPE[1:]), dtype=np.uint8)
        next_obs = np.concatenate([obs[:, 1:], frame], axis=1)
        ends = rng.random(n) < 0.05
        buffer.add(obs, next_obs, rng.integers(0, 4, n), rng.normal(size=n), ends & (rng.random(n) < 0.5), ends)
        obs = np.where(ends[:, None, None, None], rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8), next_obs)


def same_memory(a: ReplayBuffer, b: ReplayBuffer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(np.array_equal(np.asarray(sa[k]), np.asarray(sb[k])) for k in sa)


def frames_of(segment: Path) -> np.ndarray:
    """a segment's frames, unpacked here on their own (raw uint8 frames, zstandard); its name says their count"""
    with open(segment, "rb") as f:
        data = zstandard.ZstdDecompressor().stream_reader(f).read()
    _, start, stop, _ = segment.stem.split("_")
    return np.frombuffer(data, dtype=np.uint8).reshape(int(stop) - int(start), -1)


def segment_frames(folder: Path) -> int:
    return sum(len(frames_of(f)) for f in (folder / FRAMES).glob("*.zst"))


def test_checkpoints_append_only_new_frames_and_restore_the_memory_exactly(tmp_path):
    capacity, interval, keep = 400, 40, 3  # 2 rings of 200 slots; a checkpoint every 20 vector steps
    buffer = ReplayBuffer(capacity, 2, observation_shape=SHAPE, seed=0)
    segments, written_before = None, 0
    for k in range(1, 16):  # past the rings' capacity: old frames are overwritten and their segments dropped
        filled(buffer, interval // 2, seed=k)
        before = {f.name for f in (tmp_path / FRAMES).glob("*.zst")}
        path, segments = save_checkpoint(tmp_path, k * interval, {"k": k, "algo": "dqn"}, buffer, keep, segments)
        new = [f for f in (tmp_path / FRAMES).glob("*.zst") if f.name not in before]
        # only the frames stored since the checkpoint before (its interval, stacks' first frames included)
        assert sum(len(frames_of(f)) for f in new) == int(buffer.written.sum()) - written_before
        written_before = int(buffer.written.sum())
        restored = ReplayBuffer(capacity, 2, observation_shape=SHAPE, seed=123)
        assert load_checkpoint(path, "dqn").restore_replay(restored)
        assert same_memory(buffer, restored), k
        # the disk: one memory plus the intervals of the kept checkpoints, at most (no whole memory per checkpoint)
        assert segment_frames(tmp_path) <= capacity + keep * 1.2 * interval, k
    assert len(list(tmp_path.glob("step_*"))) == keep
    oldest_kept = load_checkpoint(sorted(tmp_path.glob("step_*"))[0], "dqn")
    assert oldest_kept.restore_replay(ReplayBuffer(capacity, 2, observation_shape=SHAPE))  # still whole


def test_a_planted_bug_in_the_segments_is_caught(tmp_path):
    """the restore test above fails when a segment skips a frame (the check can fail)"""
    buffer = ReplayBuffer(400, 2, observation_shape=SHAPE, seed=0)
    filled(buffer, 30, seed=1)
    path, segments = save_checkpoint(tmp_path, 1, {"algo": "dqn"}, buffer, 3, None)
    [first, *_] = sorted((tmp_path / FRAMES).glob("*.zst"))
    shifted = np.roll(frames_of(first), 1, axis=0)  # the frames one slot off
    first.write_bytes(zstandard.ZstdCompressor().compress(shifted.tobytes()))
    state = torch.load(path / "state.pt", weights_only=True)  # as a writer with that bug records them
    [entry] = [s for s in state["replay"]["segments"] if s["file"] == first.name]
    entry.update(bytes=first.stat().st_size, sha256=hashlib.sha256(first.read_bytes()).hexdigest())
    torch.save(state, path / "state.pt")
    restored = ReplayBuffer(400, 2, observation_shape=SHAPE)
    load_checkpoint(path, "dqn").restore_replay(restored)
    assert not same_memory(buffer, restored)


WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.path.insert(0, "tests")
    from test_resume import SHAPE, filled
    from cleanrl_utils.buffer import ReplayBuffer
    from cleanrl_utils.checkpoint import save_checkpoint
    folder = sys.argv[1]
    buffer = ReplayBuffer(200_000, 1, observation_shape=(4, 84, 84), seed=0)
    segments = None
    for k in range(1, 1000):
        rng = np.random.default_rng(k)
        obs = rng.integers(0, 256, (1, 4, 84, 84), dtype=np.uint8)
        for _ in range(3000):  # 21 MB of frames per checkpoint: a write long enough to be killed in
            nxt = np.concatenate([obs[:, 1:], rng.integers(0, 256, (1, 1, 84, 84), dtype=np.uint8)], axis=1)
            buffer.add(obs, nxt, [0], [1.0], [False], [False])
            obs = nxt
        _, segments = save_checkpoint(folder, k, {"k": k, "algo": "dqn"}, buffer, 2, segments)
        print(k, flush=True)
    """
)


def test_a_kill_9_during_checkpoint_writes_leaves_the_newest_complete_one_whole(tmp_path):
    """killed at random moments while it writes checkpoints (most of its time), the newest complete checkpoint
    restores exactly the memory that was written: rebuilt here from the same seeds"""
    for trial in range(3):
        folder = tmp_path / str(trial)
        process = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2):
            process.stdout.readline()  # two checkpoints complete, then a kill at a random moment
        time.sleep(random.Random().uniform(0.0, 1.0))
        process.send_signal(signal.SIGKILL)
        process.communicate()
        complete = sorted(p for p in folder.iterdir() if p.name.startswith("step_") and not p.name.endswith(".tmp"))
        newest = load_checkpoint(complete[-1], "dqn")
        k = newest.state["k"]
        expected = ReplayBuffer(200_000, 1, observation_shape=(4, 84, 84), seed=0)
        for j in range(1, k + 1):
            rng = np.random.default_rng(j)
            obs = rng.integers(0, 256, (1, 4, 84, 84), dtype=np.uint8)
            for _ in range(3000):
                nxt = np.concatenate([obs[:, 1:], rng.integers(0, 256, (1, 1, 84, 84), dtype=np.uint8)], axis=1)
                expected.add(obs, nxt, [0], [1.0], [False], [False])
                obs = nxt
        restored = ReplayBuffer(200_000, 1, observation_shape=(4, 84, 84), seed=5)
        assert newest.restore_replay(restored)
        assert same_memory(expected, restored), (trial, k)


# ---------------------------------------------------------------- the scripts

BANDIT = "tests.toy_envs:ImageBandit-v0"
RUN = ["--env-id", BANDIT, "--buffer-size", "2000", "--learning-starts", "100", "--eval-episodes", "2",
       "--eval-every", "0", "--device", "cpu", "--torch-threads", "1"]  # fmt: skip


def receipt(run_dir: Path) -> dict:
    return json.loads((run_dir / "receipt.json").read_text())


def test_a_finished_run_refuses_a_plain_resume_and_accepts_an_extension(tmp_path):
    done = run_python("algos/dqn.py", *RUN, "--total-timesteps", "600", "--checkpoint-every", "200",
                      "--save-model", "--run-dir", str(tmp_path), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    [run_dir] = tmp_path.iterdir()
    model = (run_dir / "dqn.cleanrl_model").read_bytes()
    evaluations = (run_dir / "evaluations.json").read_text()
    assert list_checkpoints(run_dir)[0].name == "step_000000000600"  # the end of training is kept
    again = run_python("algos/dqn.py", "--resume", str(run_dir), timeout=300)
    assert again.returncode == 2 and "this run finished at step 600" in again.stderr, again.stderr
    assert f"--resume {run_dir} --total-timesteps 1200" in again.stderr and "Traceback" not in again.stderr
    older = run_python("algos/dqn.py", "--resume", str(list_checkpoints(run_dir)[1]), "--total-timesteps", "900",
                       timeout=300)  # fmt: skip
    assert older.returncode == 2 and "from step 400, which would retrain it" in older.stderr, older.stderr
    assert (run_dir / "dqn.cleanrl_model").read_bytes() == model  # nothing replaced
    assert (run_dir / "evaluations.json").read_text() == evaluations
    updates = receipt(run_dir)["counts"]["gradient_updates"]
    extended = run_python("algos/dqn.py", "--resume", str(run_dir), "--total-timesteps", "900", timeout=300)
    assert extended.returncode == 0, extended.stderr[-2000:]
    assert "extended from 600 to 900 steps" in extended.stdout and "replay memory restored" in extended.stdout
    record = receipt(run_dir)
    assert record["status"] == "finished" and record["counts"]["env_steps"] == 900
    assert record["resumes"][-1]["extended"] == {"from": 600, "to": 900}
    assert record["counts"]["gradient_updates"] == updates + 300 // 4  # it learned at once, every 4 steps
    assert record["args"]["exploration_fraction"] * 900 == pytest.approx(0.1 * 600)  # epsilon's end kept
    shorter = run_python("algos/dqn.py", "--resume", str(run_dir), "--total-timesteps", "300", timeout=300)
    assert shorter.returncode == 2 and "never shortens it" in shorter.stderr


def test_stopped_with_ctrl_c_the_printed_resume_learns_at_once(tmp_path):
    """SIGINT mid-run (the default flags: the replay memory in the checkpoint): the printed command resumes, and the
    first thing the resumed run does is learn (no refill); its updates are the unbroken run's count"""
    # the defaults' proportions: a checkpoint every tenth of the replay memory (here in frames: the bandit's games
    # are one step long, so a transition brings its stack's four first frames too)
    flags = [*RUN, "--total-timesteps", "3000", "--buffer-size", "4000", "--checkpoint-every", "80"]
    flags += ["--run-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "true"}
    process = subprocess.Popen([sys.executable, "algos/dqn.py", *flags], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    for line in process.stdout:
        if line.startswith("TRAIN_METRICS step=1000"):
            break
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-2000:]
    assert "the checkpoint is kept with its replay memory" in out, out[-1000:]
    command = out.split("resume with: python ")[-1].split()
    resumed = run_python(*command, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "replay memory restored" in resumed.stdout and "learning waits" not in resumed.stdout
    [run_dir] = tmp_path.iterdir()
    record = receipt(run_dir)
    assert record["counts"]["gradient_updates"] == 3000 // 4 - 100 // 4  # each multiple of 4 past 100: none lost
    # the checkpoints folder: at most 1.5 replay memories of frames (here the whole memory is 4,000 frames)
    frames = segment_frames(run_dir / "checkpoints")
    assert 4000 <= frames <= 1.5 * 4000, frames


def test_no_checkpoint_buffer_says_at_once_when_a_resume_cannot_learn_again(tmp_path):
    flags = [*RUN, "--total-timesteps", "700", "--learning-starts", "300", "--checkpoint-every", "500"]
    first = run_python("algos/dqn.py", *flags, "--no-checkpoint-buffer", "--run-dir", str(tmp_path), timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    [run_dir] = tmp_path.iterdir()
    again = run_python("algos/dqn.py", "--resume", str(list_checkpoints(run_dir)[1]), timeout=300)
    assert again.returncode == 2 and "this run finished" in again.stderr  # a finished run: refused as above
    (run_dir / "receipt.json").write_text(json.dumps({**receipt(run_dir), "status": "interrupted"}))
    again = run_python("algos/dqn.py", "--resume", str(list_checkpoints(run_dir)[1]), timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "replay memory empty: learning waits until step 800" in again.stdout
    assert "warning: the run ends at step 700 before its replay memory refills" in again.stdout
    assert not (run_dir / "checkpoints" / FRAMES).exists()  # no frames written with --no-checkpoint-buffer
