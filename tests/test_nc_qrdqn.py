"""Non-crossing QR-DQN (algos/nc_qrdqn.py): the quantile Huber loss and the target against naive float64 loops
(and planted bugs against them), quantiles that never cross whatever the weights and the input, terminal handling,
and its own metrics on the shared Breakout run. Learning the toy task, exact resume and
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
from cleanrl_utils.encoder import check_encoder
from cleanrl_utils.tools.evaluate import load_algorithm

SCRIPT = REPO / "algos" / "nc_qrdqn.py"
GAMMA = 0.97


@pytest.fixture(scope="module")
def nc():
    return load_algorithm(SCRIPT)


def load_mutant(original: str, planted: str, tmp_path):
    source = SCRIPT.read_text()
    assert source.count(original) == 1, original
    broken = tmp_path / "broken_nc_qrdqn.py"
    broken.write_text(source.replace(original, planted))
    return load_algorithm(broken)


# ---------------------------------------------------------------- the loss and the target against naive loops


def naive_loss_and_grad(quantiles, targets, kappa: float) -> tuple[float, list[list[float]]]:
    """Dabney et al. (2018), loop by loop: for each online quantile i (tau_i = (2i + 1) / 2N) and target sample j,
    rho(u) = |tau_i - 1{u < 0}| * huber_kappa(u) / kappa with u = target_j - quantile_i; summed over i, averaged
    over j and over the batch. Also the gradient with respect to each online quantile."""
    batch, n, n_target = len(quantiles), len(quantiles[0]), len(targets[0])
    total, grad = 0.0, [[0.0] * n for _ in range(batch)]
    for b in range(batch):
        for i in range(n):
            tau = (2 * i + 1) / (2 * n)
            for j in range(n_target):
                u = float(targets[b][j]) - float(quantiles[b][i])
                weight = abs(tau - (1.0 if u < 0 else 0.0))
                huber = 0.5 * u * u if abs(u) <= kappa else kappa * (abs(u) - 0.5 * kappa)
                slope = u if abs(u) <= kappa else kappa * math.copysign(1.0, u)  # d huber / d u
                total += weight * huber / kappa / n_target / batch
                grad[b][i] -= weight * slope / kappa / n_target / batch  # d u / d quantile = -1
    return total, grad


def loss_batch(seed: int, n: int, n_target: int, batch: int = 8):
    g = torch.Generator().manual_seed(seed)
    quantiles = (torch.randn(batch, n, generator=g) * 2).requires_grad_()
    targets = torch.randn(batch, n_target, generator=g) * 2
    return quantiles, targets


@pytest.mark.parametrize("kappa", [1.0, 0.3, 2.5])
@pytest.mark.parametrize(("n", "n_target"), [(12, 12), (9, 5), (200, 7)])
def test_quantile_huber_loss_matches_naive_loops(nc, kappa, n, n_target):
    quantiles, targets = loss_batch(n + n_target, n, n_target)
    loss = nc.quantile_huber_loss(quantiles, nc.quantile_fractions(n), targets, kappa)
    loss.backward()
    expected, expected_grad = naive_loss_and_grad(quantiles.tolist(), targets.tolist(), kappa)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(quantiles.grad.double().numpy(), expected_grad, rtol=1e-4, atol=1e-8)
    u = (targets.unsqueeze(1) - quantiles.detach().unsqueeze(2)).abs()
    assert (u <= kappa).any() and (u > kappa).any()  # both branches of the Huber loss are exercised


def naive_target(next_quantiles, rewards, dones) -> list[list[float]]:
    """r + gamma * theta_j(s', a*) with a* maximising the mean of the next quantiles; r alone after a terminal"""
    out = []
    for b in range(len(rewards)):
        means = [math.fsum(float(v) for v in row) / len(row) for row in next_quantiles[b]]
        best = max(range(len(means)), key=lambda a: means[a])
        bootstrap = [0.0 if float(dones[b]) == 1.0 else GAMMA * float(v) for v in next_quantiles[b][best]]
        out.append([float(rewards[b]) + v for v in bootstrap])
    return out


def target_batch(seed: int = 0, batch: int = 32, n_actions: int = 5, n: int = 11):
    g = torch.Generator().manual_seed(seed)
    next_quantiles = torch.randn(batch, n_actions, n, generator=g).sort(dim=-1).values
    rewards = torch.randn(batch, generator=g)
    dones = (torch.rand(batch, generator=g) < 0.3).float()
    return next_quantiles, rewards, dones


def test_target_matches_naive_loops(nc):
    data = target_batch()
    target = nc.quantile_td_target(*data, GAMMA)
    np.testing.assert_allclose(target.double().numpy(), naive_target(*data), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "bug,original,planted",
    [
        ("asymmetry flipped", "(u.detach() < 0)", "(u.detach() > 0)"),
        ("mean over the online quantiles instead of the sum", "/ kappa).sum(dim=1).mean()", "/ kappa).mean()"),
        ("kappa left out of the Huber threshold", "u.abs() <= kappa", "u.abs() <= 1.0"),
        ("kappa not divided out", "weight * huber / kappa", "weight * huber"),
        ("left edges i / N instead of midpoints", "+ 0.5) / n", "+ 0.0) / n"),
    ],
)
def test_a_planted_loss_bug_disagrees_with_the_naive_loops(bug, original, planted, tmp_path):
    broken = load_mutant(original, planted, tmp_path)
    quantiles, targets = loss_batch(0, 12, 12)
    expected, _ = naive_loss_and_grad(quantiles.tolist(), targets.tolist(), 2.5)
    loss = broken.quantile_huber_loss(quantiles, broken.quantile_fractions(12), targets, 2.5).item()
    assert loss != pytest.approx(expected, rel=1e-5, abs=1e-7), f"{bug} went unnoticed"


def test_a_planted_bootstrap_after_terminal_disagrees_with_the_naive_loops(tmp_path):
    broken = load_mutant(" * (1 - dones.unsqueeze(1))", "", tmp_path)
    data = target_batch()
    target = broken.quantile_td_target(*data, GAMMA)
    assert not np.allclose(target.double().numpy(), naive_target(*data), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the non-crossing head


def naive_head(logits, scale) -> list[list[list[float]]]:
    """q_i = max(alpha, 0) * sum_{j <= i} softmax(logits)_j + beta, loop by loop in float64"""
    out = []
    for b in range(len(logits)):
        rows = []
        for a in range(len(logits[b])):
            row = [float(v) for v in logits[b][a]]
            top = max(row)
            weights = [math.exp(v - top) for v in row]
            total = math.fsum(weights)
            alpha, beta = max(float(scale[b][a][0]), 0.0), float(scale[b][a][1])
            rows.append([alpha * math.fsum(weights[: i + 1]) / total + beta for i in range(len(row))])
        out.append(rows)
    return out


def test_head_matches_naive_loops(nc):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, 17, generator=g) * 3
    scale = torch.randn(6, 4, 2, generator=g) * 5
    got = nc.non_crossing_quantiles(logits, scale)
    np.testing.assert_allclose(got.double().numpy(), naive_head(logits, scale), rtol=1e-5, atol=1e-5)
    assert (scale[..., 0] < 0).any()  # some ranges are clamped to 0: every quantile equals the location


def extreme_inputs(g: torch.Generator, n: int = 6) -> torch.Tensor:
    """random frames, plus all-black, all-white and a checkerboard"""
    frames = torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=g)
    checker = ((torch.arange(84).view(-1, 1) + torch.arange(84)) % 2 * 255).to(torch.uint8).expand(4, 84, 84)
    fixed = torch.stack([torch.zeros(4, 84, 84, dtype=torch.uint8), torch.full((4, 84, 84), 255), checker])
    return torch.cat([frames, fixed.to(torch.uint8)])


def reinitialise(net: nn.Module, g: torch.Generator) -> None:
    """every parameter drawn anew, each tensor at its own scale between 1e-3 and 1e2 (biases too)"""
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 10 ** float(torch.empty(1).uniform_(-3, 2, generator=g)), generator=g)


def quantile_checks(net, obs) -> torch.Tensor:
    with torch.no_grad():
        quantiles = net.quantiles(obs)
    assert torch.isfinite(quantiles).all()
    return quantiles


@pytest.mark.parametrize("n_quantiles", [2, 3, 51, 200])
def test_quantiles_never_cross_whatever_the_weights_and_the_input(nc, n_quantiles):
    g = torch.Generator().manual_seed(n_quantiles)
    for trial in range(8):
        n_actions = 2 + trial
        net = nc.QNetwork(n_actions, n_quantiles)
        reinitialise(net, g)
        obs = extreme_inputs(g)
        quantiles = quantile_checks(net, obs)
        assert quantiles.shape == (len(obs), n_actions, n_quantiles)
        assert (quantiles.diff(dim=-1) >= 0).all(), f"crossing with {n_quantiles} quantiles, trial {trial}"
        assert nc.crossing_rate(quantiles.flatten(0, 1)).item() == 0.0
        with torch.no_grad():
            torch.testing.assert_close(net(obs), quantiles.mean(dim=-1))  # forward: the Q-values


def test_head_never_crosses_on_extreme_raw_values(nc):
    g = torch.Generator().manual_seed(1)
    for magnitude in [1e-30, 1e-3, 1.0, 1e3, 1e10, 1e30]:
        logits = torch.randn(64, 3, 200, generator=g) * magnitude
        scale = torch.randn(64, 3, 2, generator=g) * magnitude
        quantiles = nc.non_crossing_quantiles(logits, scale)
        assert torch.isfinite(quantiles).all()
        assert (quantiles.diff(dim=-1) >= 0).all(), f"crossing at magnitude {magnitude}"


def test_crossing_rate_counts_adjacent_pairs(nc):
    quantiles = torch.tensor([[0.0, 1.0, 0.5, 2.0, 2.0], [3.0, 2.0, 1.0, 0.0, -1.0]])
    # pairs: (0, 1) ok, (1, 0.5) crosses, (0.5, 2) ok, (2, 2) ok; then 4 crossings: 5 of 8
    assert nc.crossing_rate(quantiles).item() == pytest.approx(5 / 8)


def test_a_planted_negative_range_makes_the_quantiles_cross(tmp_path):
    broken = load_mutant("F.relu(scale[..., :1])", "scale[..., :1]", tmp_path)
    g = torch.Generator().manual_seed(0)
    net = broken.QNetwork(4, 51)
    reinitialise(net, g)
    assert broken.crossing_rate(quantile_checks(net, extreme_inputs(g)).flatten(0, 1)).item() > 0


def test_the_construction_alone_is_monotone_here_without_the_guard(tmp_path):
    """The cummax guard is for parallel (GPU) scans; on the CPU the softmax and cumulative sum suffice."""
    guard = "    psi = psi.cummax(dim=-1).values"
    source = SCRIPT.read_text()
    line = next(line for line in source.splitlines() if line.startswith(guard))
    broken = load_mutant(line + "\n", "", tmp_path)
    g = torch.Generator().manual_seed(2)
    for magnitude in [1e-3, 1.0, 1e3, 1e30]:
        logits = torch.randn(64, 3, 200, generator=g) * magnitude
        scale = torch.randn(64, 3, 2, generator=g) * magnitude
        assert (broken.non_crossing_quantiles(logits, scale).diff(dim=-1) >= 0).all()


def test_qnetwork_builds_from_the_action_count(nc):
    net = nc.QNetwork(4)
    check_encoder(net.encoder)
    assert net.n_quantiles == nc.Args.n_quantiles == 200
    obs = torch.zeros(2, 4, 84, 84, dtype=torch.uint8)
    assert net(obs).shape == (2, 4) and net.quantiles(obs).shape == (2, 4, 200)


# ---------------------------------------------------------------- terminal transitions


class TinyQuantiles(nn.Module):
    def __init__(self, nc, n_actions: int = 5, n_quantiles: int = 7):
        super().__init__()
        torch.manual_seed(0)
        self.nc, self.n_actions, self.n_quantiles = nc, n_actions, n_quantiles
        self.logits = nn.Linear(4 * 3 * 3, n_actions * n_quantiles)
        self.scale = nn.Linear(4 * 3 * 3, n_actions * 2)

    def quantiles(self, x):
        features = x.float().flatten(1) / 255.0
        logits = self.logits(features).view(-1, self.n_actions, self.n_quantiles)
        return self.nc.non_crossing_quantiles(logits, 3.0 * self.scale(features).view(-1, self.n_actions, 2))


def test_terminal_target_is_the_reward_and_truncation_bootstraps(nc):
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
    with torch.no_grad():
        next_quantiles = TinyQuantiles(nc).quantiles(data.next_observations)
    target = nc.quantile_td_target(next_quantiles, data.rewards, data.dones, GAMMA)
    expected = naive_target(next_quantiles, data.rewards, data.dones)
    np.testing.assert_allclose(target.double().numpy(), expected, rtol=1e-5, atol=1e-6)
    terminal = data.dones == 1.0
    assert terminal.any() and (~terminal).any() and torch.equal(terminal, data.rewards < 0)
    assert (target[terminal] == -1.0).all()  # every target quantile is the reward
    other = nc.quantile_td_target(1e6 * next_quantiles, data.rewards, data.dones, GAMMA)
    assert torch.equal(other[terminal], target[terminal])
    assert (target[~terminal] != 0.5).any()  # the truncated one does bootstrap
    assert not torch.isclose(other[~terminal], target[~terminal]).all()


# ---------------------------------------------------------------- its own values on Breakout
# (learning the toy task, resuming exactly and the standard outputs: tests/test_scripts.py, on the same runs)


def test_breakout_run_logs_no_crossing(breakout_run):
    stdout, run = breakout_run("nc_qrdqn")
    assert re.search(r"^TRAIN_METRICS step=1000 td_loss=\S+ q_values=\S+ crossing_rate=0$", stdout, re.M)
    assert [(e.step, e.value) for e in scalars(run)["losses/crossing_rate"]] == [(1000, 0.0), (1100, 0.0)]
    args = read_json(run / "receipt.json")["args"]
    assert args["n_quantiles"] == 200 and args["kappa"] == 1.0
