"""Checkpoints under the faults users meet (issue 57): a second process on one run folder, a flipped byte in a
replay segment, a resume that fails, a full disk, a resume from an older checkpoint. Real runs of the scripts on
a toy game (subprocesses), real files; the full disk is a write that raises ENOSPC (tests/full_disk.py), nothing
else is simulated."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, mark_interrupted, run_python
from test_checkpoint import wait_for_checkpoint
from test_resume import SHAPE, filled, same_memory

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.checkpoint import (
    FRAMES,
    MANIFEST,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

# checkpoints at steps 200, 400 and 600 (the end), each with its replay segment; one torch thread
TOY = [
    "--env-id", "tests.toy_envs:DelayedImage-v0", "--total-timesteps", "600", "--learning-starts", "200",
    "--buffer-size", "1000", "--train-frequency", "2", "--target-network-frequency", "50", "--eval-every", "0",
    "--eval-episodes", "2", "--device", "cpu", "--checkpoint-every", "200", "--torch-threads", "1",
]  # fmt: skip
ENV = {**os.environ, "PYTHONPATH": str(REPO), "CI": "true"}


def popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finished_run(tmp_path: Path, *flags: str) -> Path:
    done = run_python("algos/dqn.py", *TOY, *flags, "--run-dir", str(tmp_path / "runs"), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    return run_dir


def wait_for_line(process: subprocess.Popen, start: str) -> str:
    for line in process.stdout:
        if line.startswith(start):
            return line
    raise AssertionError(f"no line starting {start!r}: {process.communicate()}")


def own_segment(checkpoint: Path) -> Path:
    """the segment that only ``checkpoint`` lists (its interval's frames), not the checkpoint before it"""
    older = [p for p in list_checkpoints(checkpoint.parent.parent) if p.name < checkpoint.name][0]
    [name] = set(json.loads((checkpoint / MANIFEST).read_text())) - set(json.loads((older / MANIFEST).read_text()))
    return checkpoint.parent / FRAMES / name


def test_a_second_process_on_a_run_folder_is_refused_and_a_killed_ones_lock_does_not_block(tmp_path):
    first = popen("algos/dqn.py", *TOY, "--total-timesteps", "100000", "--run-dir", str(tmp_path / "runs"))
    try:
        run_dir = wait_for_checkpoint(tmp_path / "runs", first)
        second = popen("algos/dqn.py", "--resume", str(run_dir))
        try:
            out, err = second.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            second.kill()
            raise AssertionError("a second process went on writing the run folder") from None
        assert second.returncode == 2 and "Traceback" not in err, err
        [line] = err.strip().splitlines()
        assert f"error: {run_dir} is being written by process {first.pid} (" in line and "algos/dqn.py" in line, line
        assert f"kill {first.pid}" in line
        assert first.poll() is None  # the first goes on
    finally:
        first.kill()
        first.communicate()
    assert (run_dir / "writer.lock").exists()  # left by the killed process: it does not block
    third = popen("algos/dqn.py", "--resume", str(run_dir))
    wait_for_line(third, "resumed from")
    third.send_signal(signal.SIGTERM)
    _, err = third.communicate(timeout=300)
    assert third.returncode == 0, err[-2000:]


def test_every_flipped_byte_in_a_segment_is_refused_naming_the_file(tmp_path):
    """60 positions across a segment: each one refused on restore with a CheckpointError that names the file
    (zstandard's frame checksum, the recorded size and sha256), never restored silently; a truncated segment is
    refused before anything is read; the intact segment restores the memory exactly"""
    buffer = ReplayBuffer(4000, 1, observation_shape=SHAPE, seed=0)
    filled(buffer, 500, seed=1)
    path, _ = save_checkpoint(tmp_path, 500, {"algo": "dqn"}, buffer, 3, None)
    [segment] = (tmp_path / FRAMES).iterdir()
    intact = segment.read_bytes()
    for position in np.linspace(0, len(intact) - 1, 60).astype(int):
        flipped = bytearray(intact)
        flipped[position] ^= 0x10
        segment.write_bytes(flipped)
        with pytest.raises(CheckpointError, match=re.escape(str(segment))) as refused:
            load_checkpoint(path, "dqn").restore_replay(ReplayBuffer(4000, 1, observation_shape=SHAPE))
        assert refused.value.segment == segment.name, position
    segment.write_bytes(intact[:-100])
    with pytest.raises(CheckpointError, match=f"{re.escape(str(segment))}.*truncated"):
        load_checkpoint(path, "dqn")
    segment.write_bytes(intact)
    restored = ReplayBuffer(4000, 1, observation_shape=SHAPE)
    assert load_checkpoint(path, "dqn").restore_replay(restored) and same_memory(buffer, restored)


def test_a_checkpoint_without_the_segment_checks_still_restores(tmp_path):
    """a checkpoint written before issue 57: its segments without zstandard's checksum, its list without frame
    counts, sizes or hashes"""
    import torch
    import zstandard

    buffer = ReplayBuffer(4000, 1, observation_shape=SHAPE, seed=0)
    filled(buffer, 300, seed=2)
    path, _ = save_checkpoint(tmp_path, 300, {"algo": "dqn"}, buffer, 3, None)
    [segment] = (tmp_path / FRAMES).iterdir()
    raw = zstandard.ZstdDecompressor().stream_reader(segment.read_bytes()).read()
    segment.write_bytes(zstandard.ZstdCompressor(level=1).compress(raw))  # as written before: no checksum
    state = torch.load(path / "state.pt", weights_only=True)
    for entry in state["replay"]["segments"]:
        del entry["frames"], entry["bytes"], entry["sha256"]
    torch.save(state, path / "state.pt")
    restored = ReplayBuffer(4000, 1, observation_shape=SHAPE)
    assert load_checkpoint(path, "dqn").restore_replay(restored) and same_memory(buffer, restored)


def test_a_checkpoint_folder_without_its_segment_list_keeps_its_segments(tmp_path):
    """a folder left without its list (a kill while it was deleted, an incomplete copy) does not count as listing
    nothing: the next checkpoint keeps the segments it needs"""
    buffer = ReplayBuffer(4000, 1, observation_shape=SHAPE, seed=0)
    filled(buffer, 100, seed=3)
    first, segments = save_checkpoint(tmp_path, 100, {"algo": "dqn"}, buffer, 3, None)
    (first / MANIFEST).unlink()
    restored = ReplayBuffer(4000, 1, observation_shape=SHAPE)
    filled(restored, 50, seed=4)  # another process's memory: none of the first checkpoint's frames
    save_checkpoint(tmp_path, 200, {"algo": "dqn"}, restored, 3, None)
    assert load_checkpoint(first, "dqn").restore_replay(ReplayBuffer(4000, 1, observation_shape=SHAPE))


def test_a_failed_resume_leaves_the_record_and_a_finished_runs_protection(tmp_path):
    """a finished run, its final checkpoint's newest segment damaged: the extension is refused with one line that
    names the file and offers the older checkpoint; receipt.json is untouched, so the older checkpoint is then
    refused as a finished run's"""
    run_dir = finished_run(tmp_path)
    final, older = list_checkpoints(run_dir)[:2]
    segment = own_segment(final)
    intact = segment.read_bytes()
    record = {name: (run_dir / name).read_bytes() for name in ("receipt.json", "evaluations.json")}
    flipped = bytearray(intact)
    flipped[len(intact) // 2] ^= 0x01
    for damaged in (bytes(flipped), intact[: len(intact) // 2]):  # a flipped byte, a truncated file
        segment.write_bytes(damaged)
        done = run_python("algos/dqn.py", "--resume", str(run_dir), "--total-timesteps", "1200", timeout=300)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        [line] = [x for x in done.stderr.splitlines() if x.startswith("error:")]
        assert f"refusing checkpoint {final}" in line and str(segment) in line, line
        assert f"resume with --resume {older}" in line, line
        assert {name: (run_dir / name).read_bytes() for name in record} == record
    again = run_python("algos/dqn.py", "--resume", str(older), "--total-timesteps", "1200", timeout=300)
    assert again.returncode == 2 and "this run finished at step 600" in again.stderr, again.stderr[-3000:]


@pytest.mark.parametrize("full_at", ["replay_frames:2", "state.pt:2"])
def test_a_full_disk_stops_the_run_with_one_line_and_keeps_the_previous_checkpoint(tmp_path, full_at):
    """the disk fills while the second checkpoint (step 400) is written: in its replay segment, or in its state
    after the segment is complete. The run stops with one line (what failed, what is kept, the resume command),
    what it had written is removed, the receipt says failed, and the resume command finishes the run."""
    runs = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, "tests/full_disk.py", full_at, "algos/dqn.py", *TOY, "--run-dir", str(runs)],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    [run_dir] = runs.iterdir()
    kept = run_dir / "checkpoints" / "step_000000000200"
    [line] = [x for x in done.stderr.splitlines() if x.strip()]
    assert line.startswith("error: the checkpoint of step 400 could not be written") and "No space left" in line
    assert f"the last good checkpoint is {kept}; resume with: python algos/dqn.py --resume {run_dir}" in line
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["status"].startswith("failed: the checkpoint of step 400") and "No space left" in receipt["status"]
    assert list_checkpoints(run_dir) == [kept]
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")] == []
    assert sorted(p.name for p in (run_dir / "checkpoints" / FRAMES).iterdir()) == sorted(
        json.loads((kept / MANIFEST).read_text())
    )  # no stray segment
    command = line.split("resume with: python ")[1].split()
    resumed = run_python(*command, timeout=300)
    assert resumed.returncode == 0 and "replay memory restored" in resumed.stdout, resumed.stderr[-2000:]
    assert json.loads((run_dir / "receipt.json").read_text())["status"] == "finished"


def test_a_resume_from_an_older_checkpoint_retires_the_newer_ones(tmp_path):
    """resumed from step 200 of a run that went on to 600, then stopped at once: --resume RUN continues the new
    timeline, not the abandoned one, which is set aside whole"""
    run_dir = finished_run(tmp_path)
    mark_interrupted(run_dir)
    older = run_dir / "checkpoints" / "step_000000000200"
    process = popen("algos/dqn.py", "--resume", str(older))
    said = wait_for_line(process, "resuming from step 200")
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-2000:]
    [retired] = (run_dir / "checkpoints").glob("retired-*")
    assert f"(step_000000000400, step_000000000600) are moved to {retired}" in said, said
    assert sorted(p.name for p in retired.glob("step_*")) == ["step_000000000400", "step_000000000600"]
    load_checkpoint(retired / "step_000000000600", "dqn")  # whole: its segments are there too
    [newest, *_] = list_checkpoints(run_dir)
    assert 200 < int(newest.name.split("_")[1]) < 600, newest  # the new timeline's, at the signal
    again = run_python("algos/dqn.py", "--resume", str(run_dir), timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from {newest} " in again.stdout
    assert [r["step"] for r in json.loads((run_dir / "receipt.json").read_text())["resumes"]] == [
        200,
        int(newest.name.split("_")[1]),
    ]
