"""The loop's schedules, read back from real runs of algos/dqn.py (and the template, which shares its loop).

With 3 games at once and --train-frequency 4 (neither divides the other), every checkpoint of a run is a
snapshot of the loop at a known step: the target network equals the online network at each step that
crosses a multiple of --target-network-frequency and not between, a soft update with --tau < 1 gives the
weighted mix of the two, the number of gradient updates is the closed form of the loop's rule, the replay
memory holds clipped rewards while the logged returns are raw, and each evaluation's recorded seed replays
its game. The exploration schedule's closed form is checked on the shared runs in test_scripts.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, read_json, run_python

from cleanrl_utils.checkpoint import list_checkpoints, load_checkpoint

GAMES, TRAIN_FREQUENCY, LEARNING_STARTS, TARGET_FREQUENCY, TOTAL = 3, 4, 100, 50, 600
LOOP_RUN = [
    "--env-id", "tests.toy_envs:ScaledBandit-v0", "--num-envs", str(GAMES), "--total-timesteps", str(TOTAL),
    "--learning-starts", str(LEARNING_STARTS), "--train-frequency", str(TRAIN_FREQUENCY),
    "--target-network-frequency", str(TARGET_FREQUENCY), "--buffer-size", "400", "--batch-size", "16",
    "--learning-rate", "1e-3", "--eval-every", "0", "--eval-episodes", "2", "--device", "cpu", "--torch-threads", "1",
    "--checkpoint-keep", "100", "--checkpoint-buffer",
]  # fmt: skip


def run_loop(script: str, tmp_path: Path, *flags: str) -> tuple[Path, str]:
    done = run_python(str(REPO / "algos" / f"{script}.py"), *LOOP_RUN, *flags, "--run-dir", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [run_dir] = tmp_path.iterdir()
    return run_dir, done.stdout


def snapshots(run_dir: Path, script: str) -> list[tuple[int, dict]]:
    """(step, checkpoint state) of every checkpoint of the run, oldest first"""
    found = [load_checkpoint(path, script) for path in reversed(list_checkpoints(run_dir))]
    return [(checkpoint.step, {**checkpoint.state, "replay_state": checkpoint.replay()}) for checkpoint in found]


def networks(state: dict) -> tuple[dict, dict]:
    if "algorithm" in state:  # the template's ValueAlgorithm holds them
        state = state["algorithm"]
        return state["q_network"], state["target_network"]
    return state["q_network"]["state_dict"], state["target_network"]["state_dict"]


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


def crosses(step: int, every: int, num_envs: int = GAMES) -> bool:
    """whether the vector step that ended at ``step`` passed a multiple of ``every``"""
    return step // every > (step - num_envs) // every


def updates_by(step: int) -> int:
    """closed form of the loop's rule: each vector step past --learning-starts makes one update per multiple of
    --train-frequency that its --num-envs agent steps crossed (one update per --train-frequency agent steps)"""
    vector_steps = [s for s in range(GAMES, step + 1, GAMES) if s > LEARNING_STARTS]
    return sum(s // TRAIN_FREQUENCY - (s - GAMES) // TRAIN_FREQUENCY for s in vector_steps)


@pytest.fixture(scope="session")
def hard_sync_run(tmp_path_factory) -> tuple[Path, str]:
    return run_loop("dqn", tmp_path_factory.mktemp("hard"), "--checkpoint-every", str(TARGET_FREQUENCY // 2))


def test_the_target_network_is_the_online_network_right_after_each_sync_and_not_between(hard_sync_run):
    run_dir, _ = hard_sync_run
    taken = snapshots(run_dir, "dqn")
    assert len(taken) == TOTAL // (TARGET_FREQUENCY // 2)  # one at each crossing of 25, and the end's
    after_sync = between = 0
    for step, state in taken:
        q, target = networks(state)
        if updates_by(step) == 0:  # no update yet: the target is still the initial copy
            assert same(q, target), step
        elif crosses(step, TARGET_FREQUENCY):
            assert same(q, target), f"step {step} crossed a multiple of {TARGET_FREQUENCY}: the target must be synced"
            after_sync += 1
        else:
            assert not same(q, target), f"step {step}: the target network changed between syncs"
            between += 1
    assert after_sync >= 8 and between >= 8


def test_the_number_of_updates_is_the_closed_form_of_the_loops_rule(hard_sync_run):
    run_dir, _ = hard_sync_run
    for step, state in snapshots(run_dir, "dqn"):
        assert state["run"]["counts"]["gradient_updates"] == updates_by(step), step
    receipt = read_json(run_dir / "receipt.json")
    assert receipt["counts"]["gradient_updates"] == updates_by(TOTAL) == 126  # 1 per vector step: 167


def test_the_replay_memory_holds_clipped_rewards_and_the_logged_returns_are_raw(hard_sync_run):
    run_dir, stdout = hard_sync_run
    step, state = snapshots(run_dir, "dqn")[5]  # step 150: the greedy policy of an untrained network errs
    memory = state["replay_state"]
    transitions = memory["rewards"][memory["valid"]]
    assert set(np.unique(transitions).tolist()) == {-1.0, 1.0}, "the learner must see the rewards' signs"
    assert np.isin(memory["rewards"], [-1.0, 0.0, 1.0]).all(), "a raw reward reached the replay memory"
    returns = [float(r) for r in re.findall(r"^global_step=\d+, episodic_return=(\S+)$", stdout, re.M)]
    assert len(returns) == TOTAL // 2 and set(returns) == {-3.0, 5.0}, "the logged returns must be the raw game score"


def test_a_soft_update_mixes_the_online_network_into_the_target_by_tau(tmp_path):
    tau = 0.25
    run_dir, _ = run_loop("dqn", tmp_path, "--tau", str(tau), "--checkpoint-every", str(TARGET_FREQUENCY))
    taken = snapshots(run_dir, "dqn")  # one at each sync step
    assert [step for step, _ in taken] == [s for s in range(GAMES, TOTAL + 1, GAMES) if crosses(s, TARGET_FREQUENCY)]
    previous_target = None
    mixes = 0
    for step, state in taken:
        q, target = networks(state)
        if updates_by(step) == 0:
            assert same(q, target)
        else:
            for name in q:  # in float64: tau * online + (1 - tau) * the target of the previous sync
                expected = tau * q[name].double() + (1 - tau) * previous_target[name].double()
                assert torch.allclose(target[name].double(), expected, rtol=1e-6, atol=1e-7), (step, name)
            assert not same(q, target), "a soft update must not copy the online network"
            mixes += 1
        previous_target = target
    assert mixes >= 8


@pytest.mark.parametrize("script", ["dqn"])
def test_each_evaluation_plays_the_games_of_the_seeds_it_records(script, breakout_run):
    """The run record's seeds are those the games were played with: the saved model, replayed by the evaluation
    command with the final evaluation's recorded seed, plays the same game (return and length), and the seeds
    follow the documented rule (seed + 10,000 + 100 * the evaluation's index), one per evaluation."""
    run = breakout_run(script)
    evaluations = read_json(run.dir / "evaluations.json")
    receipt = read_json(run.dir / "receipt.json")
    seed = receipt["args"]["seed"]
    assert [e["seed"] for e in evaluations] == [seed + 10_000 + 100 * k for k in range(len(evaluations))]
    final = evaluations[-1]
    [model] = run.dir.glob("*.cleanrl_model")

    def replay(game_seed: int) -> tuple[float, int]:
        command = ["-m", "cleanrl_utils.tools.evaluate", str(model), "--episodes", "1"]
        done = run_python(*command, "--epsilon", str(final["epsilon"]), "--seed", str(game_seed), timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        match = re.search(rf"game 1/1 \(seed {game_seed}\): return (\S+), ([\d,]+) agent steps", done.stderr)
        return float(match.group(1)), int(match.group(2).replace(",", ""))

    assert replay(final["seed"]) == (final["episodic_returns"][0], final["episodic_lengths"][0])
    others = [replay(final["seed"] + k) for k in (1, 2)]
    assert any(game[1] != final["episodic_lengths"][0] for game in others), "the seed did not change the game"


def test_closed_forms_of_this_file():
    """the helpers above on hand-worked steps (3 games: steps 3, 6, ...)"""
    assert [s for s in range(3, 160, 3) if crosses(s, 50)] == [51, 102, 150]
    assert updates_by(99) == 0 and updates_by(102) == 1 and updates_by(105) == 2 and updates_by(111) == 3
    assert updates_by(600) == 126  # (600 - 99 // 4 * 4) // 4: the multiples of 4 from 100 to 600
