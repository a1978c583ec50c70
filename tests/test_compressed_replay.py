"""The replay memory held compressed (--compress-replay) and raw (the default), as a user runs them: the same
learning bit for bit, what each takes in the receipt, and the start-up's estimate; resumed either way."""

from __future__ import annotations

import json

import torch

from tests.conftest import BREAKOUT_RUN, run_script, weights

# one torch thread, fixed: the two runs must sum alike to be compared bit for bit
RUN = [*BREAKOUT_RUN, "--env-id", "BreakoutNoFrameskip-v4", "--torch-threads", "1", "--seed", "3"]


def receipt(run_dir):
    return json.loads((run_dir / "receipt.json").read_text())


def test_compressed_and_raw_replay_learn_the_same_network_and_report_their_memory(tmp_path):
    runs = {}
    for name, flags in {"compressed": ["--compress-replay"], "raw": []}.items():
        done = run_script("dqn", *RUN, *flags, timeout=600, tmp_path=tmp_path / name)
        assert done.returncode == 0, done.stderr[-3000:]
        [runs[name]] = (tmp_path / name / "runs").iterdir()
        runs[name + "_stdout"] = done.stdout
    a, b = weights(runs["compressed"]), weights(runs["raw"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # 50 updates on the same batches
    compressed, raw = receipt(runs["compressed"])["replay_memory"], receipt(runs["raw"])["replay_memory"]
    assert compressed["frames"] == "host, compressed" and raw["frames"] == "host, raw"
    assert raw["bytes_per_transition"] == 84 * 84 + 11 == raw["estimated_bytes_per_transition"]
    # Breakout's frames take about 300 bytes each compressed; the estimate, made before, is above what they take
    assert 200 < compressed["bytes_per_transition"] < compressed["estimated_bytes_per_transition"] < 1_000
    assert compressed["slots_filled"] == raw["slots_filled"] > 1_000
    estimate = compressed["estimated_bytes_per_transition"]
    assert f"replay memory: about {estimate:,} bytes a transition" in runs["compressed_stdout"]
    assert "replay memory: about" not in runs["raw_stdout"]


def test_a_resume_may_change_the_replay_memorys_form_and_the_threads(tmp_path):
    """How a run is carried out is not what it learns: --no-compress-replay and --torch-threads given beside
    --resume apply, without the warning that other flags get; the checkpoint's frames come back either way."""
    flags = [*RUN, "--total-timesteps", "1000", "--checkpoint-every", "950", "--eval-every", "0"]
    first = run_script("dqn", *flags, "--compress-replay", timeout=600, tmp_path=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    assert receipt(run_dir)["replay_memory"]["frames"] == "host, compressed"
    again = run_script(
        "dqn", "--resume", str(run_dir), "--total-timesteps", "1100", "--no-compress-replay", "--torch-threads", "2",
        timeout=600, tmp_path=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "ignoring" not in again.stdout + again.stderr
    record = receipt(run_dir)
    assert record["args"]["compress_replay"] is False and record["args"]["torch_threads"] == 2
    assert record["replay_memory"]["frames"] == "host, raw"
    assert "replay memory restored" in again.stdout
