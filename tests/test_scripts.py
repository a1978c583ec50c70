"""The end-to-end tier, parametrized over the scripts: each algorithm script run as a user would run it, on a toy
task and on a real game, and read back from what it leaves. No mocks.

- Each script learns DelayedImage-v0 (tests/toy_envs.py: the cue's value arrives only through bootstrapping, so a
  broken target fails it) to the optimum, with a sane logged Q-value.
- The same run, continued from its step-900 checkpoint (replay memory, every RNG and the toy games included),
  ends with the same weights, bit for bit.
- Each script's short Breakout run prints the standard lines, writes the TensorBoard tags, counts the run in its
  receipt, records a periodic and a final evaluation, and its saved model plays with the evaluation command.
- Double DQN plays Pong with four environments.

What belongs to one algorithm (its own metrics and their ranges, its defaults) is checked in its own test file,
on the same runs (conftest's ``toy_run`` and ``breakout_run``: one run per script per session).
"""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
import torch
from conftest import (
    FAST_LEARNING,
    REPO,
    TOY_RUN_OWN,
    check_evaluation,
    read_json,
    run_python,
    run_script,
    scalars,
    weights,
)

SCRIPTS = ["dqn", "double_dqn", "c51", "qrdqn", "mdqn", "nc_qrdqn", "iqn", "rainbow"]
TEMPLATE = "custom_value_atari"
# the mean Q-value the last TRAIN_METRICS line may log on DelayedImage, whose values lie in [0, 1]
Q_RANGE = {script: (0.0, 1.3) for script in [*SCRIPTS, TEMPLATE]}
Q_RANGE["mdqn"] = (-2.0, 1.3)  # with its bonus in [alpha * l0, 0] per step and the entropy <= tau * log 2
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


def last_q_value(stdout: str) -> float:
    return [float(v) for v in re.findall(r"^TRAIN_METRICS .* q_values=(\S+)", stdout, re.M)][-1]


# ---------------------------------------------------------------- 1. learning a toy task, and resuming it exactly


@pytest.mark.parametrize("script", [*SCRIPTS, TEMPLATE])
def test_learns_the_delayed_reward_task(script, toy_run):
    stdout, run_dir = toy_run(script)
    mean = read_json(run_dir / "evaluations.json")[-1]["mean"]
    assert mean >= 0.95, f"{script} on DelayedImage: evaluation mean {mean}, optimum 1, random 0.5"
    low, high = Q_RANGE[script]
    assert low < last_q_value(stdout) < high, f"{script}: mean Q {last_q_value(stdout)} outside ({low}, {high})"


@pytest.mark.parametrize("script", [*SCRIPTS, TEMPLATE])
def test_resumed_from_a_checkpoint_ends_bit_identical(script, toy_run, tmp_path):
    """the toy run, continued from its step-900 checkpoint in a copy of its folder, ends with its weights"""
    straight = toy_run(script).dir
    copy = tmp_path / straight.name
    subprocess.run(["cp", "-r", str(straight), str(copy)], check=True)
    for model in copy.glob("*.cleanrl_model"):
        model.unlink()
    again = run_python(f"algos/{script}.py", "--resume", str(copy / "checkpoints" / "step_000000000900"), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "games continued" in again.stdout, again.stdout[-2000:]
    a, b = weights(straight), weights(copy)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), (
            f"{script}: {key} differs after resume (max {(a[key] - b[key]).abs().max()})"
        )


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_learns_the_contextual_bandit(script, tmp_path):
    """ImageBandit-v0 needs no bootstrapping (one step per episode): a check of acting and the loss alone"""
    flags = ["--env-id", "tests.toy_envs:ImageBandit-v0", "--total-timesteps", "1200", *FAST_LEARNING]
    done = run_script(script, *flags, *TOY_RUN_OWN.get(script, []), timeout=900, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    assert read_json(run_dir / "evaluations.json")[-1]["mean"] >= 0.95
    low, high = Q_RANGE[script]
    assert low < last_q_value(done.stdout) < high


# ---------------------------------------------------------------- 2. a short real game


@pytest.mark.parametrize("script", SCRIPTS)
def test_breakout_run_prints_the_standard_lines(script, breakout_run):
    stdout, run = breakout_run(script)
    assert re.fullmatch(rf"BreakoutNoFrameskip-v4__{script}__1__\d+", run.name)
    assert re.search(r"^global_step=\d+, episodic_return=\S+$", stdout, re.M)
    metrics = re.findall(r"^TRAIN_METRICS step=(\d+) td_loss=(\S+) q_values=(\S+)( \S+)*$", stdout, re.M)
    assert [int(m[0]) for m in metrics] == [1000]
    assert np.isfinite(float(metrics[0][1])) and float(metrics[0][1]) >= 0 and np.isfinite(float(metrics[0][2]))
    assert stdout.count("Eval episodic_return: ") == 2
    assert len(re.findall(r"^Final eval return: \S+$", stdout, re.M)) == 1


@pytest.mark.parametrize("script", SCRIPTS)
def test_breakout_run_writes_the_tensorboard_scalars(script, breakout_run):
    run = breakout_run(script).dir
    logged = scalars(run)
    assert set(TAGS) <= set(logged)
    args = read_json(run / "receipt.json")["args"]
    epsilon = [e.value for e in sorted(logged["charts/epsilon"], key=lambda e: e.step)]
    assert all(args["end_e"] - 1e-6 <= value <= args["start_e"] + 1e-6 for value in epsilon)
    assert np.all(np.diff(epsilon) <= 0)
    assert [e.step for e in logged["eval/episodic_return"]] == [1000, 1100]


@pytest.mark.parametrize("script", SCRIPTS)
def test_breakout_receipt_counts_the_run(script, breakout_run):
    run = breakout_run(script).dir
    receipt = read_json(run / "receipt.json")
    assert receipt["status"] == "finished" and receipt["algo"] == script
    counts = receipt["counts"]
    assert counts["env_steps"] == 1100
    assert counts["gradient_updates"] == (1100 - 900) // 4  # one per 4 agent steps once past learning_starts
    assert counts["eval_episodes"] == 2
    assert {"torch", "gymnasium", "ale_py", "numpy", "python"} <= set(receipt["versions"])
    assert {"setup", "acting", "environment", "learning", "evaluation"} <= set(receipt["timings_seconds"])
    assert "git" in receipt
    assert receipt["peak_process_memory_bytes"] > 0
    assert any(part.endswith(f"algos/{script}.py") for part in receipt["command"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_breakout_records_the_periodic_and_final_evaluations(script, breakout_run):
    evaluations = read_json(breakout_run(script).dir / "evaluations.json")
    assert [(e["step"], e["final"]) for e in evaluations] == [(1000, False), (1100, True)]
    for entry in evaluations:
        check_evaluation(entry, episodes=1, n_actions=4)


@pytest.mark.parametrize("script", SCRIPTS)
def test_breakout_saved_model_plays_with_the_evaluation_command(script, breakout_run):
    """evaluation rebuilds the network from what the model file records and plays with it"""
    model = breakout_run(script).dir / f"{script}.cleanrl_model"
    saved = torch.load(model, map_location="cpu", weights_only=True)
    assert saved["n_actions"] == 4 and saved["env_id"] == "BreakoutNoFrameskip-v4"
    done = run_python("-m", "cleanrl_utils.evaluation", str(model), "--episodes", "1", "--epsilon", "0.05")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Eval episodic_return:" in done.stdout


def test_double_dqn_plays_pong_with_four_environments(tmp_path):
    flags = "--env-id PongNoFrameskip-v4 --seed 3 --num-envs 4 --total-timesteps 2000 --learning-starts 800"
    flags += " --buffer-size 4000 --eval-every 0 --eval-episodes 2 --device cpu"
    done = run_script("double_dqn", *flags.split(), timeout=600, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"PongNoFrameskip-v4__double_dqn__3__\d+", run.name)
    assert "Final eval return: " in done.stdout
    counts = read_json(run / "receipt.json")["counts"]
    assert counts["env_steps"] == 2000
    assert counts["gradient_updates"] == (2000 - 800) // 4  # with 4 envs, one update per vector step
    evaluations = read_json(run / "evaluations.json")
    assert len(evaluations) == 1 and evaluations[0]["final"] and evaluations[0]["step"] == 2000
    check_evaluation(evaluations[0], episodes=2, n_actions=6, forced_per_game=2)
    assert -21 <= evaluations[0]["mean"] <= 21


def test_every_script_is_covered():
    assert sorted([*SCRIPTS, TEMPLATE]) == sorted(p.stem for p in (REPO / "algos").glob("*.py"))
