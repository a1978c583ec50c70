"""Plots and tables that do not mislead (issue 15): a runs/ folder as a new user has it, with two whole runs
of one seed and a third interrupted early. Real run folders: receipts, evaluations and TensorBoard event
files written with SummaryWriter; the commands run as subprocesses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import run_python
from torch.utils.tensorboard import SummaryWriter

from cleanrl_utils.tools.plot import collect, lines, steps_label
from cleanrl_utils.tools.results import choose_runs, final_evaluations, run_records

ENV_ID = "BreakoutNoFrameskip-v4"


def write_run(root: Path, algo: str, seed: int, started: int, steps: int, level: float, status: str) -> Path:
    """A run folder as a run leaves it: episodic returns every 500 steps around ``level``, up to ``steps``."""
    folder = root / f"{ENV_ID}__{algo}__{seed}__{started}"
    writer = SummaryWriter(str(folder))
    for step in range(500, steps + 1, 500):
        writer.add_scalar("charts/episodic_return", level + (step % 1000) / 1000, step)
    writer.add_scalar("charts/episodic_return", level, steps)  # the last game ends at the last step
    writer.close()
    receipt = {
        "status": status,
        "algo": algo,
        "args": {"env_id": ENV_ID, "exp_name": algo, "total_timesteps": 100_000, "seed": seed},
        "seed": seed,
        "counts": {"env_steps": steps},
    }
    (folder / "receipt.json").write_text(json.dumps(receipt))
    final = status == "finished"  # an interrupted run stopped before its first evaluation
    evaluations = [{"step": steps, "final": True, "mean": level, "episodic_returns": [level]}] if final else []
    (folder / "evaluations.json").write_text(json.dumps(evaluations))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two 100k-step DQN runs of seed 1 (the older scores 5, the newer 20), a third interrupted at step 1,277;
    Double DQN with seeds 1 and 2, and a seed-3 run of it that finished after only 10,000 steps."""
    root = tmp_path_factory.mktemp("runs")
    return {
        "root": root,
        "old": write_run(root, "dqn", 1, 1_700_000_000, 100_000, 5.0, "finished"),
        "new": write_run(root, "dqn", 1, 1_700_100_000, 100_000, 20.0, "finished"),
        "interrupted": write_run(root, "dqn", 1, 1_700_200_000, 1_277, 1.0, "interrupted"),
        "double1": write_run(root, "double_dqn", 1, 1_700_000_001, 100_000, 10.0, "finished"),
        "double2": write_run(root, "double_dqn", 2, 1_700_000_002, 100_000, 14.0, "finished"),
        "short": write_run(root, "double_dqn", 3, 1_700_000_003, 10_000, 2.0, "finished"),
    }


def test_one_run_per_seed_whole_runs_only_and_the_others_listed(runs):
    kept, left_out = choose_runs(run_records(runs["root"]))
    assert sorted(Path(r["folder"]).name for r in kept) == sorted(runs[k].name for k in ("new", "double1", "double2"))
    assert len(left_out) == 3
    text = "\n".join(left_out)
    assert f"{runs['old']}: older run of seed 1 ({runs['new'].name} is used)" in text
    assert f"{runs['interrupted']}: unfinished at step 1,277 (status: interrupted)" in text
    assert f"{runs['short']}: only 10,000 of 100,000 steps" in text


def test_plot_lines_are_not_cut_at_the_shortest_run_and_count_seeds_by_seed(runs):
    drawn, left_out = collect(runs["root"], "charts/episodic_return")
    by_label = {line.label: line for line in lines(drawn, window=1)}
    assert set(by_label) == {"dqn (1 seed)", "double_dqn (2 seeds)"}
    for line in by_label.values():
        assert line.steps[0] == 500 and line.steps[-1] == 100_000  # not cut at step 1,277 nor 10,000
    dqn = by_label["dqn (1 seed)"]
    assert np.all(dqn.mean >= 20.0) and np.all(dqn.std == 0)  # the newest finished run alone, not averaged
    assert np.allclose(by_label["double_dqn (2 seeds)"].std, 2.0)  # seeds 1 and 2: returns 10 and 14 (+ the same)
    assert len(left_out) == 3


def test_with_all_runs_partial_runs_are_drawn_alone_to_their_own_end(runs):
    drawn, left_out = collect(runs["root"], "charts/episodic_return", all_runs=True)
    by_label = {line.label: line for line in lines(drawn, window=1)}
    interrupted = by_label["dqn seed 1: unfinished at step 1,277"]
    short = by_label["double_dqn seed 3: only 10,000 of 100,000 steps"]
    assert interrupted.std is None and interrupted.steps[-1] == 1_277
    assert short.std is None and short.steps[-1] == 10_000
    assert by_label["dqn (1 seed)"].steps[-1] == by_label["double_dqn (2 seeds)"].steps[-1] == 100_000
    older = by_label["dqn seed 1: older run"]
    assert older.std is None and older.steps[-1] == 100_000 and np.all(older.mean < 6)
    assert left_out == []


def test_plot_command_lists_what_it_left_out_and_the_picture_says_so(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    done = run_python("-m", "cleanrl_utils.tools.plot", str(runs["root"]), "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("left out: ") == 3 and f"left out: {runs['interrupted']}: unfinished at" in done.stdout
    svg = out.with_suffix(".svg").read_text()
    assert "dqn (1 seed)" in svg and "double_dqn (2 seeds)" in svg and "3 seeds" not in svg
    assert "random play" in svg  # Breakout's random score, where a return curve starts from
    assert "Not drawn: 3 run(s), unfinished, much shorter, or an older run of a seed" in " ".join(svg.split())
    again = run_python(
        "-m", "cleanrl_utils.tools.plot", str(runs["root"]), "--out", str(out), "--all-runs", timeout=120
    )
    assert again.returncode == 0, again.stdout + again.stderr
    svg = out.with_suffix(".svg").read_text()
    assert "dqn seed 1: unfinished at step 1,277" in svg and "Not drawn" not in svg and "Dashed: a single run" in svg


def test_results_count_seeds_by_seed_and_list_what_they_left_out(runs):
    done = run_python("-m", "cleanrl_utils.tools.results", str(runs["root"]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^\| dqn \| 1 \| 100000 \| 20\.00 \+- 0\.00 \| 0\.635 \|$", done.stdout, re.M), done.stdout
    assert re.search(r"^\| double_dqn \| 2 \| 100000 \| 12\.00 \+- 2\.00 \|", done.stdout, re.M), done.stdout
    left_out = done.stdout.split("### Left out")[1]
    assert f"- {runs['old']}: older run of seed 1 ({runs['new'].name} is used)" in left_out
    assert f"- {runs['interrupted']}: unfinished at step 1,277 (status: interrupted)" in left_out
    assert f"- {runs['short']}: only 10,000 of 100,000 steps" in left_out
    everything = run_python("-m", "cleanrl_utils.tools.results", str(runs["root"]), "--all-runs")
    assert "| double_dqn seed 3: only 10,000 of 100,000 steps | 1 | 10000 | 2.00 +- 0.00 |" in (everything.stdout)
    assert re.search(r"^\| double_dqn \| 2 \| 100000 \| 12\.00 \+- 2\.00 \|", everything.stdout, re.M)
    assert f"{runs['interrupted']}: no evaluation yet" in everything.stdout  # it stopped before its first
    assert "| dqn seed 1: older run | 1 | 100000 | 5.00 +- 0.00 |" in (everything.stdout)


def test_final_evaluations_take_the_final_one(runs):
    [record] = [r for r in run_records(runs["root"]) if r["folder"] == str(runs["new"])]
    [evaluated], none = final_evaluations([record])
    assert evaluated["mean"] == 20.0 and evaluated["step"] == 100_000 and none == []


def test_step_axis_labels_stay_short():
    labels = [steps_label(v) for v in (0, 500, 50_000, 150_000, 1_500_000, 10_000_000)]
    assert labels == ["0", "500", "50k", "150k", "1.5M", "10M"]
