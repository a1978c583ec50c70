"""Munchausen DQN (algos/mdqn.py): its target against naive float64 loops (and planted bugs against them),
terminal handling, and its own metrics on the shared Breakout run. Learning the toy task, exact resume and
the standard outputs of a real run are in test_scripts.py, bad flags in test_bad_input.py. No mocks."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from conftest import REPO, read_json, scalars
from torch import nn

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.tools.evaluate import load_algorithm

SCRIPT = REPO / "algos" / "mdqn.py"
GAMMA, M_ALPHA, M_TAU, M_L0 = 0.97, 0.9, 0.03, -1.0


@pytest.fixture(scope="module")
def mdqn():
    return load_algorithm(SCRIPT)


def tau_log_softmax(row: list[float], tau: float) -> list[float]:
    """tau * log pi(a) with pi = softmax(row / tau), in float64 around the row's max"""
    top = max(row)
    tau_log_sum = top + tau * math.log(math.fsum(math.exp((v - top) / tau) for v in row))
    return [v - tau_log_sum for v in row]


def naive_target(target_q, target_next_q, actions, rewards, dones, tau=M_TAU) -> tuple[list[float], list[float]]:
    """Loop by loop: r + alpha * clip(tau log pi(a|s), l0, 0) + gamma * V(s') * (1 - done), where the soft value
    V(s') = sum_a' pi(a'|s') (q(s', a') - tau log pi(a'|s')) equals tau * log sum_a' exp(q(s', a') / tau)."""
    targets, bonuses = [], []
    for i in range(len(rewards)):
        row, next_row = [float(v) for v in target_q[i]], [float(v) for v in target_next_q[i]]
        bonus = M_ALPHA * min(max(tau_log_softmax(row, tau)[int(actions[i])], M_L0), 0.0)
        top = max(next_row)
        soft_value = top + tau * math.log(math.fsum(math.exp((v - top) / tau) for v in next_row))
        bootstrap = 0.0 if float(dones[i]) == 1.0 else GAMMA * soft_value
        targets.append(float(rewards[i]) + bonus + bootstrap)
        bonuses.append(bonus)
    return targets, bonuses


def batch(seed: int = 0, size: int = 96, n_actions: int = 6):
    """Q-values on three scales: near-uniform policies (bonus inside (l0, 0)), clear gaps (bonus clipped at l0 or
    close to 0), and large values (the log-sum-exp must stay finite where exp(q / tau) overflows)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(size // 3).unsqueeze(1)
    target_q = torch.randn(size, n_actions, generator=g) * scales
    target_next_q = torch.randn(size, n_actions, generator=g) * scales
    actions = torch.randint(0, n_actions, (size,), generator=g)
    rewards = torch.randn(size, generator=g)
    dones = (torch.rand(size, generator=g) < 0.3).float()
    return target_q, target_next_q, actions, rewards, dones


def call(module, target_q, target_next_q, actions, rewards, dones, tau=M_TAU):
    return module.munchausen_target(target_q, target_next_q, actions, rewards, dones, GAMMA, M_ALPHA, tau, M_L0)


@pytest.mark.parametrize("seed", range(3))
def test_target_matches_naive_loops(mdqn, seed):
    data = batch(seed)
    target, bonus = call(mdqn, *data)
    expected, expected_bonus = naive_target(*data)
    np.testing.assert_allclose(target.double().numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bonus.double().numpy(), expected_bonus, rtol=1e-5, atol=1e-6)
    # the batch exercises both sides of the clip: bonuses clipped at alpha * l0, and bonuses strictly inside
    bonuses = np.array(expected_bonus)
    assert (bonuses == M_ALPHA * M_L0).sum() >= 10
    assert ((bonuses > M_ALPHA * M_L0 + 1e-3) & (bonuses < -1e-3)).sum() >= 10
    assert (bonus <= 0).all() and (bonus >= M_ALPHA * M_L0).all()
    assert torch.isfinite(target).all()


@pytest.mark.parametrize("tau", [0.03, 1.0, 10.0])
def test_temperature_enters_the_softmax(mdqn, tau):
    data = batch(5)
    target, _ = call(mdqn, *data, tau=tau)
    expected, _ = naive_target(*data, tau=tau)
    np.testing.assert_allclose(target.double().numpy(), expected, rtol=1e-5, atol=1e-5)


def test_policy_and_entropy_match_naive_loops(mdqn):
    target_q = batch(1)[0]
    scaled = mdqn.scaled_log_policy(target_q, M_TAU)
    entropy = mdqn.policy_entropy(target_q, M_TAU)
    for i in range(len(target_q)):
        tau_log_pi = tau_log_softmax([float(v) for v in target_q[i]], M_TAU)
        naive_entropy = -math.fsum(math.exp(t / M_TAU) * t / M_TAU for t in tau_log_pi)
        np.testing.assert_allclose(scaled[i].double().numpy(), tau_log_pi, rtol=1e-5, atol=1e-6)
        assert entropy[i].item() == pytest.approx(naive_entropy, rel=1e-4, abs=1e-5)
    assert (entropy >= -1e-6).all() and (entropy <= math.log(target_q.shape[1]) + 1e-5).all()


@pytest.mark.parametrize(
    "bug,original,planted",
    [
        ("no clipping at l0", ".clamp(min=m_l0, max=0.0)", ".clamp(max=0.0)"),
        ("bootstraps after a terminal", " * (1 - dones)", ""),
        ("temperature left out of the log-sum-exp", "m_tau * torch.logsumexp", "torch.logsumexp"),
    ],
)
def test_a_planted_bug_disagrees_with_the_naive_loops(bug, original, planted, tmp_path):
    source = SCRIPT.read_text()
    assert source.count(original) == 1
    broken = tmp_path / "broken_mdqn.py"
    broken.write_text(source.replace(original, planted))
    data = batch(0)
    target, _ = call(load_algorithm(broken), *data)
    expected, _ = naive_target(*data)
    assert not np.allclose(target.double().numpy(), expected, rtol=1e-5, atol=1e-5), f"{bug} went unnoticed"


class TinyQ(nn.Module):
    def __init__(self, seed: int, n_actions: int = 5):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(4 * 3 * 3, n_actions)

    def forward(self, x):
        return 3.0 * self.linear(x.float().flatten(1) / 255.0)


def test_terminal_target_never_bootstraps_and_truncation_does(mdqn):
    buffer = ReplayBuffer(100, 1, (4, 3, 3), gamma=GAMMA, seed=0)
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 256, (1, 4, 3, 3), dtype=np.uint8)
    final = np.concatenate([obs[:, 1:], rng.integers(0, 256, (1, 1, 3, 3), dtype=np.uint8)], axis=1)
    # a truncated transition (time limit): not terminal, bootstraps from its real final observation
    buffer.add(obs, final, np.array([2]), np.array([0.5]), np.array([False]), np.array([True]))
    obs2 = rng.integers(0, 256, (1, 4, 3, 3), dtype=np.uint8)
    last = np.concatenate([obs2[:, 1:], rng.integers(0, 256, (1, 1, 3, 3), dtype=np.uint8)], axis=1)
    # a terminal transition (game over)
    buffer.add(obs2, last, np.array([1]), np.array([-1.0]), np.array([True]), np.array([True]))
    data = buffer.sample(50)
    terminal = data.dones == 1.0
    assert terminal.any() and (~terminal).any()
    assert torch.equal(terminal, data.rewards < 0)
    net = TinyQ(0)
    with torch.no_grad():
        target_q, target_next_q = net(data.observations), net(data.next_observations)
    args = (data.actions, data.rewards, data.dones)
    target, bonus = call(mdqn, target_q, target_next_q, *args)
    expected, expected_bonus = naive_target(target_q, target_next_q, *args)
    np.testing.assert_allclose(target.double().numpy(), expected, rtol=1e-5, atol=1e-6)
    # terminal: the reward and the bonus of s alone; whatever the next state's values, the target is the same
    assert torch.equal(target[terminal], (data.rewards + bonus)[terminal])
    other, _ = call(mdqn, target_q, 1e6 * torch.randn_like(target_next_q), *args)
    assert torch.equal(other[terminal], target[terminal])
    assert not torch.isclose(other[~terminal], target[~terminal]).any()  # the truncated one does bootstrap
    assert (target[~terminal] != (data.rewards + bonus)[~terminal]).all()


def test_qnetwork_builds_from_the_action_count(mdqn):
    net = mdqn.QNetwork(4)
    assert net(torch.zeros(2, 4, 84, 84, dtype=torch.uint8)).shape == (2, 4)


# ---------------------------------------------------------------- its own values on Breakout
# (learning the toy task, resuming exactly and the standard outputs: tests/test_scripts.py, on the same runs)


def test_breakout_run_logs_the_bonus_and_the_entropy_in_their_ranges(breakout_run):
    stdout, run = breakout_run("mdqn")
    line = r"^TRAIN_METRICS step=1000 td_loss=\S+ q_values=\S+ munchausen_bonus=\S+ policy_entropy=\S+$"
    assert re.search(line, stdout, re.MULTILINE)
    logged = scalars(run)
    assert all(M_ALPHA * M_L0 <= e.value <= 0 for e in logged["losses/munchausen_bonus"])
    assert all(0 <= e.value <= math.log(4) + 1e-6 for e in logged["losses/policy_entropy"])
    args = read_json(run / "receipt.json")["args"]
    assert args["m_alpha"] == M_ALPHA and args["m_tau"] == M_TAU
