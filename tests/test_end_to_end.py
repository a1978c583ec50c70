"""Short real runs on ALE games: standard output, TensorBoard, receipt, evaluations and the saved
model, read back the way a user would. No mocks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_python, run_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TIMEOUT = 600
TAGS = [
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/epsilon",
    "charts/SPS",
    "losses/td_loss",
    "losses/q_values",
    "eval/episodic_return",
    "eval/human_normalized_score",
]


def train(script: str, *flags: str, tmp_path: Path) -> tuple[str, Path]:
    """Run a script to the end; its standard output and its one run folder."""
    done = run_script(script, *flags, timeout=TIMEOUT, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs
    return done.stdout, runs[0]


def read_json(path: Path):
    return json.loads(path.read_text())


def scalars(run: Path) -> dict[str, list]:
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def check_evaluation(entry: dict, episodes: int, n_actions: int, forced_per_game: int = 2 + 3 * 4) -> None:
    """``forced_per_game``: steps the protocol plays for the agent in a whole game, not in the histogram;
    Breakout: FIRE and 2 at the start, NOOP, FIRE and 2 after each of 4 life losses; Pong: FIRE and 2."""
    returns = entry["episodic_returns"]
    assert len(returns) == len(entry["episodic_lengths"]) == episodes
    assert entry["mean"] == pytest.approx(np.mean(returns))
    assert entry["std"] == pytest.approx(np.std(returns))
    assert len(entry["action_histogram"]) == n_actions
    assert sum(entry["action_histogram"]) == sum(entry["episodic_lengths"]) - episodes * forced_per_game


@pytest.fixture(scope="module")
def breakout(tmp_path_factory) -> tuple[str, Path]:
    flags = "--total-timesteps 2500 --learning-starts 1000 --buffer-size 5000 --eval-every 2000"
    flags += " --eval-episodes 2 --eval-epsilon 0.05 --save-model --device cpu"
    return train("dqn", *flags.split(), tmp_path=tmp_path_factory.mktemp("breakout"))


@pytest.fixture(scope="module")
def pong(tmp_path_factory) -> tuple[str, Path]:
    flags = "--env-id PongNoFrameskip-v4 --seed 3 --num-envs 4 --total-timesteps 2000 --learning-starts 800"
    flags += " --buffer-size 4000 --eval-every 0 --eval-episodes 2 --device cpu"
    return train("double_dqn", *flags.split(), tmp_path=tmp_path_factory.mktemp("pong"))


def test_dqn_prints_the_standard_lines(breakout):
    stdout, run = breakout
    assert re.fullmatch(r"BreakoutNoFrameskip-v4__dqn__1__\d+", run.name)
    assert re.search(r"^global_step=\d+, episodic_return=", stdout, re.MULTILINE)
    assert re.search(r"^TRAIN_METRICS step=2000 td_loss=\S+ q_values=\S+$", stdout, re.MULTILINE)
    assert stdout.count("Eval episodic_return: ") == 2
    assert "Final eval return: " in stdout


def test_dqn_writes_tensorboard_scalars(breakout):
    logged = scalars(breakout[1])
    assert set(TAGS) <= set(logged)
    epsilon = [e.value for e in sorted(logged["charts/epsilon"], key=lambda e: e.step)]
    assert all(0.01 - 1e-6 <= value <= 1 + 1e-6 for value in epsilon)
    assert np.all(np.diff(epsilon) <= 0)


def test_dqn_receipt_counts_the_run(breakout):
    receipt = read_json(breakout[1] / "receipt.json")
    assert receipt["status"] == "finished"
    counts = receipt["counts"]
    assert counts["env_steps"] == 2500
    # one update per 4 agent steps once global_step > learning_starts
    assert counts["gradient_updates"] == (2500 - 1000) // 4
    assert counts["eval_episodes"] == 4
    assert {"torch", "gymnasium", "ale_py", "numpy", "python"} <= set(receipt["versions"])
    assert {"setup", "acting", "environment", "learning", "evaluation"} <= set(receipt["timings_seconds"])
    assert "git" in receipt
    assert receipt["peak_process_memory_bytes"] > 0
    assert any(part.endswith("algos/dqn.py") for part in receipt["command"])


def test_dqn_records_periodic_and_final_evaluations(breakout):
    evaluations = read_json(breakout[1] / "evaluations.json")
    assert [e["step"] for e in evaluations] == [2000, 2500]
    assert [e["final"] for e in evaluations] == [False, True]
    for entry in evaluations:
        check_evaluation(entry, episodes=2, n_actions=4)


def test_dqn_saved_model_loads_and_evaluates(breakout):
    model = breakout[1] / "dqn.cleanrl_model"
    saved = torch.load(model, map_location="cpu", weights_only=True)
    assert saved["n_actions"] == 4 and saved["env_id"] == "BreakoutNoFrameskip-v4"
    done = run_python("-m", "cleanrl_utils.evaluation", str(model), "--episodes", "2", "--epsilon", "0.05")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Eval episodic_return:" in done.stdout


def test_double_dqn_on_pong_with_four_envs(pong):
    stdout, run = pong
    assert re.fullmatch(r"PongNoFrameskip-v4__double_dqn__3__\d+", run.name)
    assert "Final eval return: " in stdout
    counts = read_json(run / "receipt.json")["counts"]
    assert counts["env_steps"] == 2000
    # with 4 envs, one update per vector step once global_step > learning_starts
    assert counts["gradient_updates"] == (2000 - 800) // 4
    evaluations = read_json(run / "evaluations.json")
    assert len(evaluations) == 1 and evaluations[0]["final"] and evaluations[0]["step"] == 2000
    check_evaluation(evaluations[0], episodes=2, n_actions=6, forced_per_game=2)
    assert -21 <= evaluations[0]["mean"] <= 21
