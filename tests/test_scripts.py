"""The end-to-end tier, parametrized over the scripts: each algorithm script run as a user would run it, on a toy
task and on a real game, and read back from what it leaves. No mocks.

- Each script learns DelayedImage-v0 (tests/toy_envs.py: the cue's value arrives only through bootstrapping, so a
  broken target fails it) to the optimum, with a sane logged Q-value.
- The same run, continued from its step-900 checkpoint (replay memory, every RNG and the toy games included),
  ends with the same weights, bit for bit.
- Each script's short Breakout run prints the standard lines, writes the TensorBoard tags, counts the run in its
  receipt, records a periodic and a final evaluation, and its saved model plays with the evaluation command.
- The logged exploration rate is the closed form of the linear schedule at the step each action was chosen, at
  each step that crosses a multiple of 100, with one game (Breakout) and with four (Pong).
- Double DQN plays Pong with four environments: whole games, scored and normalised as the reference table says.

What belongs to one algorithm (its own metrics and their ranges, its defaults) is checked in its own test file,
on the same runs (conftest's ``toy_run`` and ``breakout_run``: one run per script per session).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    FAST_LEARNING,
    REPO,
    TOY_RUN_OWN,
    check_evaluation,
    mark_interrupted,
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


def scheduled_epsilon(start: float, end: float, duration: float, t: int) -> float:
    """the linear exploration schedule in closed form: from ``start`` at step 0 to ``end`` at step ``duration``
    (--exploration-fraction x --total-timesteps), then ``end``"""
    return max(start + (end - start) * t / duration, end)


def check_logged_epsilon(events: list, args: dict) -> list[float]:
    """``charts/epsilon`` is logged at each vector step that crosses a multiple of 100 (steps num_envs,
    2 num_envs, ...), and its value is the schedule's at the step the actions were chosen, before that vector step
    (step - num_envs), to float32 precision (TensorBoard's). Returns the logged values, in step order."""
    n, total = args["num_envs"], args["total_timesteps"]
    duration = args["exploration_fraction"] * total
    logged = sorted((e.step, e.value) for e in events)
    assert [step for step, _ in logged] == [s for s in range(n, total + 1, n) if s // 100 > (s - n) // 100]
    for step, value in logged:
        expected = scheduled_epsilon(args["start_e"], args["end_e"], duration, step - n)
        assert value == pytest.approx(expected, rel=1e-6, abs=1e-7), f"epsilon {value} at step {step}, not {expected}"
    return [value for _, value in logged]


# ---------------------------------------------------------------- 1. learning a toy task, and resuming it exactly


def assert_each_evaluation_game_shown(stdout: str, run: Path) -> None:
    """Each evaluation game is printed as it ends, with what evaluations.json keeps of it."""
    shown = re.findall(r"^eval_episode=(\d+)/(\d+), episodic_return=(\S+), length=(\d+), seed=(\d+)$", stdout, re.M)
    for evaluation in read_json(run / "evaluations.json"):
        n = len(evaluation["episodic_returns"])
        games, shown = shown[:n], shown[n:]
        assert [(int(k), int(total)) for k, total, *_ in games] == [(k, n) for k in range(1, n + 1)]
        played = zip(evaluation["episodic_returns"], evaluation["episodic_lengths"], strict=True)
        expected = {(r, length, evaluation["seed"] + i) for i, (r, length) in enumerate(played)}
        assert {(float(r), int(length), int(seed)) for *_, r, length, seed in games} == expected
    assert shown == []


@pytest.mark.parametrize("script", [*SCRIPTS, TEMPLATE])
def test_learns_the_delayed_reward_task(script, toy_run):
    stdout, run_dir = toy_run(script)
    assert_each_evaluation_game_shown(stdout, run_dir)  # 20 games: their seeds and the order they end in
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
    mark_interrupted(copy)  # as if stopped after that checkpoint: a finished run refuses an older checkpoint
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
    td_loss, q_value = float(metrics[0][1]), float(metrics[0][2])
    assert np.isfinite(td_loss) and np.isfinite(q_value)
    # the printed figures (6 significant digits) are the ones logged to TensorBoard at that step
    logged = scalars(run)
    # losses/* has a point every 100 steps once learning runs (CleanRL's granularity), read once per 1000
    assert [e.step for e in logged["losses/td_loss"]] == [1000, 1100]
    assert [e.step for e in logged["losses/q_values"]] == [1000, 1100]
    assert logged["losses/td_loss"][0].value == pytest.approx(td_loss, rel=1e-5)
    assert logged["losses/q_values"][0].value == pytest.approx(q_value, rel=1e-5)
    assert stdout.count("Eval episodic_return: ") == 2
    assert len(re.findall(r"^Final eval return: \S+$", stdout, re.M)) == 1
    assert_each_evaluation_game_shown(stdout, run)


@pytest.mark.parametrize("script", SCRIPTS)
def test_breakout_run_writes_the_tensorboard_scalars(script, breakout_run):
    run = breakout_run(script).dir
    logged = scalars(run)
    assert set(TAGS) <= set(logged)
    args = read_json(run / "receipt.json")["args"]
    epsilon = check_logged_epsilon(logged["charts/epsilon"], args)  # one game: at steps 100, 200, ..., 1100
    if script == "rainbow":  # its noisy layers explore: epsilon 0 throughout (test_rainbow.py)
        assert (args["start_e"], args["end_e"]) == (0.0, 0.0)
    else:  # from 1 to 0.01 over the first 550 steps: points on the slope and after it, so a wrong slope shows
        assert (args["start_e"], args["end_e"], args["exploration_fraction"]) == (1.0, 0.01, 0.5)
        assert sum(0.01 < e < 1.0 for e in epsilon) == 5 and sum(e == pytest.approx(0.01) for e in epsilon) == 6
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
    # in bytes (Linux's ru_maxrss is in KiB): a process that imports torch and plays Breakout holds over 100 MiB,
    # and no more than the machine has
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 100 * 2**20 < receipt["peak_process_memory_bytes"] < physical
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
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(model), "--episodes", "1", "--epsilon", "0.05")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Eval episodic_return:" in done.stdout


def test_double_dqn_plays_pong_with_four_environments(tmp_path):
    # exploration over the first 1000 steps: 10 of the 20 logged epsilons on the slope, 10 after it
    flags = "--env-id PongNoFrameskip-v4 --seed 3 --num-envs 4 --total-timesteps 2000 --learning-starts 800"
    flags += " --buffer-size 4000 --exploration-fraction 0.5 --eval-every 0 --eval-episodes 2 --device cpu"
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
    entry = evaluations[0]
    check_evaluation(entry, episodes=2, n_actions=6, forced_per_game=2)
    # whole games: Pong ends when a side has 21 points, so a game's score is a whole number, never 0, after
    # 42 - |score| points; the bound takes 100 frames (25 agent steps) a point, where 139 or more were measured from
    # one point to the next (random play, or one action held: 0-21 in 764 steps). A game cut short shows here
    for score, length in zip(entry["episodic_returns"], entry["episodic_lengths"], strict=True):
        assert score == int(score) and 1 <= abs(score) <= 21, f"{score}: not the score of a whole game of Pong"
        assert 25 * (42 - abs(score)) <= length <= 27_000, f"a game of {42 - abs(score)} points in {length} steps"
    # the human-normalised score with Pong's reference scores (random -20.7, human 14.6), logged as recorded
    assert entry["human_normalized_score"] == pytest.approx((entry["mean"] + 20.7) / (14.6 + 20.7))
    logged = scalars(run)
    assert [(e.step, e.value) for e in logged["eval/episodic_return"]] == [(2000, pytest.approx(entry["mean"]))]
    assert [(e.step, e.value) for e in logged["eval/human_normalized_score"]] == [
        (2000, pytest.approx(entry["human_normalized_score"], rel=1e-6))
    ]
    # four games at once: epsilon at steps 100, 200, ..., 2000, the schedule's value 4 steps before each
    args = read_json(run / "receipt.json")["args"]
    assert (args["num_envs"], args["start_e"], args["end_e"]) == (4, 1.0, 0.01)
    epsilon = check_logged_epsilon(logged["charts/epsilon"], args)
    assert sum(0.01 < e < 1.0 for e in epsilon) == 10 and sum(e == pytest.approx(0.01) for e in epsilon) == 10


def test_every_script_is_covered():
    """drq.py (Atari 100k defaults) and pqn.py (no replay) have their end-to-end tests in test_drq.py, test_pqn.py"""
    assert sorted([*SCRIPTS, TEMPLATE, "drq", "pqn"]) == sorted(p.stem for p in (REPO / "algos").glob("*.py"))
