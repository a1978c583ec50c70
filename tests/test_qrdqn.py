"""QR-DQN (algos/qrdqn.py): the quantile Huber loss and the quantile targets against naive float64 loops (and
planted bugs that the comparison catches), no bootstrap after a terminal, the crossing rate, and its own
metrics on the shared Breakout run. Learning the toy task, exact resume and the standard outputs of a real run are
in test_scripts.py, bad flags in test_bad_input.py. No mocks."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, scalars

from cleanrl_utils.tools.evaluate import load_algorithm

SCRIPT = REPO / "algos" / "qrdqn.py"
qrdqn = load_algorithm(SCRIPT)


# ---------------------------------------------------------------- naive references (float64, loops)


def naive_quantile_huber(quantiles, targets, kappa: float) -> float:
    """Dabney et al. (2018), eq. 10, one pair (online quantile i, target quantile j) at a time: the Huber
    loss divided by kappa, weighted by tau_i where the target lies above the quantile and by 1 - tau_i where it
    lies below; summed over i, averaged over j and the batch."""
    total = 0.0
    for theta, target in zip(quantiles, targets, strict=True):
        n = len(theta)
        for i in range(n):
            tau = (2 * i + 1) / (2 * n)
            for t in target:
                u = float(t) - float(theta[i])
                huber = 0.5 * u * u if abs(u) <= kappa else kappa * (abs(u) - 0.5 * kappa)
                weight = 1.0 - tau if u < 0 else tau
                total += weight * huber / kappa / len(target)
    return total / len(quantiles)


def naive_crossing_rate(quantiles) -> float:
    pairs = crossings = 0
    for row in quantiles:
        for i in range(len(row) - 1):
            pairs += 1
            crossings += row[i + 1] < row[i]
    return crossings / pairs


# ---------------------------------------------------------------- 1. the loss math against the naive loops


@pytest.mark.parametrize("kappa", [1.0, 0.3, 2.5])
@pytest.mark.parametrize("n,n_target", [(8, 8), (5, 7), (200, 200)])
def test_quantile_huber_loss_matches_naive_loops(kappa, n, n_target):
    g = torch.Generator().manual_seed(n + n_target)
    batch = 16 if n < 200 else 4
    quantiles = 2.0 * torch.randn(batch, n, generator=g)
    targets = 2.0 * torch.randn(batch, n_target, generator=g) + 0.5
    u = targets.unsqueeze(1) - quantiles.unsqueeze(2)
    # both sides of kappa and both signs of u are exercised
    assert (u.abs() <= kappa).any() and (u.abs() > kappa).any() and (u < 0).any() and (u > 0).any()
    got = qrdqn.quantile_huber_loss(quantiles, qrdqn.quantile_fractions(n), targets, kappa)
    expected = naive_quantile_huber(quantiles.double().tolist(), targets.double().tolist(), kappa)
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_quantile_huber_loss_hand_cases():
    """N = 2 (tau 1/4, 3/4), one target quantile, kappa 1 (and 2 once)."""

    def loss(quantiles, target, kappa):
        return qrdqn.quantile_huber_loss(quantiles, qrdqn.quantile_fractions(2), target, kappa)

    target = torch.tensor([[0.0]])
    # u = 0 - (-0.5) = 0.5 above theta_0 (weight 1/4), u = 0 - 0.5 below theta_1 (weight 1/4): 2 * 1/4 * 0.125
    assert loss(torch.tensor([[-0.5, 0.5]]), target, 1.0).item() == pytest.approx(0.0625)
    # u = 3 for both (linear side: 3 - 0.5 = 2.5): 1/4 * 2.5 + 3/4 * 2.5
    assert loss(torch.tensor([[-3.0, -3.0]]), target, 1.0).item() == pytest.approx(2.5)
    # u = -3 for both: 3/4 * 2.5 + 1/4 * 2.5; kappa 2: 2 * (3 - 1) = 4 on the linear side, divided by kappa 2
    assert loss(torch.tensor([[3.0, 3.0]]), target, 1.0).item() == pytest.approx(2.5)
    assert loss(torch.tensor([[3.0, 3.0]]), target, 2.0).item() == pytest.approx(2.0)
    # the asymmetry: a target below the low quantile costs 3/4, above it 1/4
    assert loss(torch.tensor([[0.5, 0.0]]), target, 1.0).item() == pytest.approx(0.75 * 0.125)
    assert loss(torch.tensor([[-0.5, 0.0]]), target, 1.0).item() == pytest.approx(0.25 * 0.125)


@pytest.mark.parametrize(
    "bug,original,planted",
    [
        ("flipped asymmetric weight", "(u.detach() < 0)", "(u.detach() > 0)"),
        ("left edges i / N instead of midpoints", "+ 0.5) / n", "+ 0.0) / n"),
        ("kappa ignored by the Huber branch", "u.abs() <= kappa", "u.abs() <= 1.0"),
        ("kappa not divided out", "weight * huber / kappa", "weight * huber"),
    ],
)
def test_the_naive_comparison_catches_a_planted_bug(bug, original, planted, tmp_path):
    source = SCRIPT.read_text()
    assert source.count(original) == 1
    broken_path = tmp_path / "broken_qrdqn.py"
    broken_path.write_text(source.replace(original, planted))
    broken = load_algorithm(broken_path)
    g = torch.Generator().manual_seed(0)
    quantiles, targets = 2.0 * torch.randn(16, 8, generator=g), 2.0 * torch.randn(16, 8, generator=g)
    expected = naive_quantile_huber(quantiles.double().tolist(), targets.double().tolist(), 0.3)

    def loss_of(module) -> float:
        return module.quantile_huber_loss(quantiles, module.quantile_fractions(8), targets, 0.3).item()

    assert loss_of(qrdqn) == pytest.approx(expected, rel=1e-5)
    got = loss_of(broken)
    assert got != pytest.approx(expected, rel=1e-3), f"{bug} went unnoticed"


def test_crossing_rate():
    assert float(qrdqn.crossing_rate(torch.tensor([[0.0, 1.0, 0.5, 2.0]]))) == pytest.approx(1 / 3)
    assert float(qrdqn.crossing_rate(torch.tensor([[0.0, 1.0], [1.0, 1.0]]))) == 0.0  # ties do not cross
    assert float(qrdqn.crossing_rate(torch.tensor([[3.0]]))) == 0.0  # one quantile: no pairs
    g = torch.Generator().manual_seed(0)
    quantiles = torch.randn(32, 200, generator=g).cumsum(dim=1)
    assert float(qrdqn.crossing_rate(quantiles)) == pytest.approx(naive_crossing_rate(quantiles.tolist()))


# ---------------------------------------------------------------- 2. the target from the networks; terminals


def network(seed: int, n_actions: int = 4, n_quantiles: int = 16):
    torch.manual_seed(seed)
    return qrdqn.QNetwork(n_actions, n_quantiles)


def frames(batch: int, seed: int) -> torch.Tensor:
    """random frame stacks of increasing brightness (so that the network's greedy action varies)"""
    g = torch.Generator().manual_seed(seed)
    brightness = torch.linspace(0.05, 1.0, batch).view(batch, 1, 1, 1)
    return (255 * brightness * torch.rand(batch, 4, 84, 84, generator=g)).to(torch.uint8)


def test_network_outputs_and_target_match_naive():
    net = network(0)
    next_obs = frames(16, 2)
    quantiles = net.quantiles(next_obs)
    assert quantiles.shape == (16, 4, 16)
    q = net(next_obs)  # forward: the mean quantile, what evaluation takes the argmax of
    np.testing.assert_allclose(q.detach().numpy(), quantiles.mean(dim=2).detach().numpy(), atol=1e-6)
    g = torch.Generator().manual_seed(3)
    data = SimpleNamespace(
        next_observations=next_obs, rewards=torch.randn(16, generator=g), dones=torch.tensor([0.0, 1.0] * 8)
    )
    got = qrdqn.compute_target_quantiles(net, data, 0.9)
    rows = quantiles.double().tolist()
    expected = []
    for k in range(16):
        means = [sum(action) / len(action) for action in rows[k]]
        best = max(range(4), key=lambda a, m=means: m[a])
        reward, done = data.rewards[k].item(), data.dones[k].item()
        expected.append([reward + (0.0 if done else 0.9 * theta) for theta in rows[k][best]])
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)
    # with the same quantiles for every action, the greedy choice would not matter: it does here
    first = [[data.rewards[k].item() + 0.9 * theta for theta in rows[k][0]] for k in range(0, 16, 2)]
    assert not np.allclose(got[::2].double().numpy(), first, atol=1e-4)


def test_terminal_transitions_never_bootstrap():
    """dones = 1: every target quantile is the reward, whatever the next state and the target network."""
    rewards = torch.tensor([0.5, -0.3, 2.0, -1.0, 0.0, 0.8])
    dones = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    targets = []
    for seed in (1, 2):
        data = SimpleNamespace(next_observations=frames(6, 10 + seed), rewards=rewards, dones=dones)
        targets.append(qrdqn.compute_target_quantiles(network(seed), data, 0.99))
    for target in targets:
        assert torch.equal(target[:5], rewards[:5].unsqueeze(1).expand(5, 16))
    assert not torch.allclose(targets[0][5], targets[1][5], atol=1e-4)  # a non-terminal one did bootstrap


# ---------------------------------------------------------------- 3. its own values on Breakout
# (learning the toy task, resuming exactly and the standard outputs: tests/test_scripts.py, on the same runs)


def test_breakout_run_logs_the_crossing_rate_and_keeps_the_zoo_defaults(breakout_run):
    stdout, run = breakout_run("qrdqn")
    pattern = r"^TRAIN_METRICS step=1000 td_loss=\S+ q_values=\S+ crossing_rate=(\S+)$"
    [crossing] = re.findall(pattern, stdout, re.M)
    assert 0.0 <= float(crossing) <= 1.0
    assert [e.step for e in scalars(run)["losses/crossing_rate"]] == [1000, 1100]
    args = json.loads((run / "receipt.json").read_text())["args"]
    assert args["n_quantiles"] == 200 and args["learning_rate"] == 5e-5
