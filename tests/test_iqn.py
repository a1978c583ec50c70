"""IQN (algos/iqn.py): the quantile Huber loss at sampled fractions, the cosine embedding network and the target
against naive float64 loops (and planted bugs that the comparison catches), no bootstrap after a terminal,
and its own settings on the shared Breakout run. Learning the toy task, exact resume and
the standard outputs of a real run are in test_scripts.py, bad flags in test_bad_input.py. No mocks."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO

from cleanrl_utils.tools.evaluate import load_algorithm

SCRIPT = REPO / "algos" / "iqn.py"
iqn = load_algorithm(SCRIPT)


# ---------------------------------------------------------------- naive references (float64, loops)


def naive_quantile_huber(quantiles, taus, targets, kappa: float) -> float:
    """Dabney et al. (2018), eq. 3, one pair (online quantile i at fraction tau_i, target quantile j) at a time:
    |tau_i - 1{u < 0}| * L_kappa(u) / kappa with u = T_j - Z_i; summed over i, averaged over j and the batch."""
    total = 0.0
    for theta, tau, target in zip(quantiles, taus, targets, strict=True):
        for i in range(len(theta)):
            for t in target:
                u = float(t) - float(theta[i])
                huber = 0.5 * u * u if abs(u) <= kappa else kappa * (abs(u) - 0.5 * kappa)
                weight = 1.0 - tau[i] if u < 0 else tau[i]
                total += weight * huber / kappa / len(target)
    return total / len(quantiles)


def naive_quantiles(net, obs: torch.Tensor, taus: torch.Tensor) -> list[list[list[float]]]:
    """Z_tau(x, a) in float64: the encoder's 512 features psi(x) (the fixed Nature encoder, run by torch), then
    the embedding phi_j(tau) = ReLU(sum_{i=0}^{n-1} cos(pi i tau) w_ij + b_j) with loops, the product, and the
    head's two layers; returns (batch, n_actions, N)"""
    with torch.no_grad():
        features = net.encoder(obs).double().numpy()
    w_phi, b_phi = net.phi.weight.double().detach().numpy(), net.phi.bias.double().detach().numpy()
    first, last = net.head[0], net.head[2]
    w1, b1 = first.weight.double().detach().numpy(), first.bias.double().detach().numpy()
    w2, b2 = last.weight.double().detach().numpy(), last.bias.double().detach().numpy()
    n_cos = w_phi.shape[1]
    out = []
    for k, row in enumerate(taus.double().tolist()):
        per_tau = []
        for tau in row:
            cosines = [math.cos(math.pi * i * tau) for i in range(n_cos)]
            phi = np.array(
                [max(0.0, sum(cosines[i] * w_phi[j, i] for i in range(n_cos)) + b_phi[j]) for j in range(512)]
            )
            hidden = np.maximum(0.0, w1 @ (features[k] * phi) + b1)
            per_tau.append(w2 @ hidden + b2)
        out.append(np.array(per_tau).T.tolist())
    return out


def network(seed: int, n_actions: int = 4, n_cos: int = 64, k: int = 32):
    torch.manual_seed(seed)
    return iqn.QNetwork(n_actions, n_cos, k)


def frames(batch: int, seed: int) -> torch.Tensor:
    """random frame stacks of increasing brightness (so that the network's greedy action varies)"""
    g = torch.Generator().manual_seed(seed)
    brightness = torch.linspace(0.05, 1.0, batch).view(batch, 1, 1, 1)
    return (255 * brightness * torch.rand(batch, 4, 84, 84, generator=g)).to(torch.uint8)


# ---------------------------------------------------------------- 1. the loss and the network against the naive loops


@pytest.mark.parametrize("kappa", [1.0, 0.3, 2.5])
@pytest.mark.parametrize("n,n_target", [(8, 8), (5, 7), (64, 64)])
def test_quantile_huber_loss_matches_naive_loops(kappa, n, n_target):
    g = torch.Generator().manual_seed(n + n_target)
    batch = 16 if n < 64 else 4
    quantiles = 2.0 * torch.randn(batch, n, generator=g)
    taus = torch.rand(batch, n, generator=g)  # sampled fractions, a different set per transition
    targets = 2.0 * torch.randn(batch, n_target, generator=g) + 0.5
    u = targets.unsqueeze(1) - quantiles.unsqueeze(2)
    assert (u.abs() <= kappa).any() and (u.abs() > kappa).any() and (u < 0).any() and (u > 0).any()
    got = iqn.quantile_huber_loss(quantiles, taus, targets, kappa)
    expected = naive_quantile_huber(
        quantiles.double().tolist(), taus.double().tolist(), targets.double().tolist(), kappa
    )
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_quantile_huber_loss_hand_case():
    """one online quantile at tau 0.25, two targets, kappa 1: u = 0.5 above (weight 0.25, 0.125) and u = -2
    below (weight 0.75, Huber 1.5): (0.25 * 0.125 + 0.75 * 1.5) / 2"""
    loss = iqn.quantile_huber_loss(torch.tensor([[0.0]]), torch.tensor([[0.25]]), torch.tensor([[0.5, -2.0]]), 1.0)
    assert loss.item() == pytest.approx((0.25 * 0.125 + 0.75 * 1.5) / 2)


def test_network_quantiles_and_q_values_match_naive():
    net = network(0)
    obs = frames(3, 1)
    g = torch.Generator().manual_seed(2)
    taus = torch.rand(3, 5, generator=g)
    got = net.quantiles(obs, taus)
    assert got.shape == (3, 4, 5)
    np.testing.assert_allclose(got.double().detach().numpy(), naive_quantiles(net, obs, taus), rtol=1e-4, atol=1e-5)
    # forward: the Q-values, the mean of K = 32 quantiles at uniform fractions (the same draws by re-seeding)
    torch.manual_seed(9)
    q = net(obs)
    torch.manual_seed(9)
    k_taus = torch.rand(3, 32)
    expected = np.array(naive_quantiles(net, obs, k_taus)).mean(axis=2)
    np.testing.assert_allclose(q.double().detach().numpy(), expected, rtol=1e-4, atol=1e-5)


def naive_target(net, data, gamma: float, n_target: int, k: int, seed: int) -> list[list[float]]:
    """a* = argmax of the mean of the first K quantiles, then r + gamma * (1 - done) * the other N' at a*; the
    fractions are the script's draws (re-seeded): one uniform (batch, K + N') draw"""
    torch.manual_seed(seed)
    taus = torch.rand(len(data.rewards), k + n_target)
    quantiles = naive_quantiles(net, data.next_observations, taus)
    out = []
    for b in range(len(quantiles)):
        means = [sum(action[:k]) / k for action in quantiles[b]]
        best = max(range(len(means)), key=lambda a, m=means: m[a])
        reward, done = float(data.rewards[b]), float(data.dones[b])
        out.append([reward + (0.0 if done else gamma * z) for z in quantiles[b][best][k:]])
    return out


def test_target_matches_naive():
    net = network(1)
    g = torch.Generator().manual_seed(3)
    data = SimpleNamespace(
        next_observations=frames(6, 4), rewards=torch.randn(6, generator=g), dones=torch.tensor([0.0, 1.0] * 3)
    )
    torch.manual_seed(5)
    got = iqn.compute_target_quantiles(net, data, 0.9, 6, 4)
    assert got.shape == (6, 6)
    np.testing.assert_allclose(got.double().numpy(), naive_target(net, data, 0.9, 6, 4, 5), rtol=1e-4, atol=1e-5)


def test_terminal_transitions_never_bootstrap():
    rewards = torch.tensor([0.5, -0.3, 2.0, 0.8])
    dones = torch.tensor([1.0, 1.0, 1.0, 0.0])
    targets = []
    for seed in (1, 2):
        data = SimpleNamespace(next_observations=frames(4, 10 + seed), rewards=rewards, dones=dones)
        targets.append(iqn.compute_target_quantiles(network(seed), data, 0.99, 8, 4))
    for target in targets:
        assert torch.equal(target[:3], rewards[:3].unsqueeze(1).expand(3, 8))
    assert not torch.allclose(targets[0][3], targets[1][3], atol=1e-4)  # a non-terminal one did bootstrap


def check_loss(module) -> bool:
    g = torch.Generator().manual_seed(0)
    quantiles, taus, targets = (
        torch.randn(8, 6, generator=g),
        torch.rand(8, 6, generator=g),
        torch.randn(8, 5, generator=g),
    )
    expected = naive_quantile_huber(quantiles.double().tolist(), taus.double().tolist(), targets.double().tolist(), 0.5)
    return module.quantile_huber_loss(quantiles, taus, targets, 0.5).item() == pytest.approx(expected, rel=1e-5)


def check_network(module) -> bool:
    torch.manual_seed(0)
    net = module.QNetwork(3, 64, 32)
    obs, taus = frames(2, 1), torch.rand(2, 3)
    return np.allclose(net.quantiles(obs, taus).double().detach().numpy(), naive_quantiles(net, obs, taus), atol=1e-5)


def check_target(module) -> bool:
    torch.manual_seed(1)
    net = module.QNetwork(4, 64, 32)
    data = SimpleNamespace(next_observations=frames(4, 4), rewards=torch.randn(4), dones=torch.tensor([0.0, 1.0] * 2))
    torch.manual_seed(5)
    got = module.compute_target_quantiles(net, data, 0.9, 3, 4)
    return np.allclose(got.double().numpy(), naive_target(net, data, 0.9, 3, 4, 5), atol=1e-5)


@pytest.mark.parametrize(
    "bug,original,planted,check",
    [
        (
            "tau weights flipped",
            "(taus.unsqueeze(-1) - (u.detach() < 0)",
            "(1 - taus.unsqueeze(-1) - (u.detach() < 0)",
            check_loss,
        ),
        ("kappa not divided out", "weight * huber / kappa", "weight * huber", check_loss),
        (
            "summed over the targets",
            "(weight * huber / kappa).sum(dim=1)",
            "(weight * huber / kappa).sum(dim=2)",
            check_loss,
        ),
        ("cosines from i = 1", "math.pi * torch.arange(n_cos", "math.pi * torch.arange(1, n_cos + 1", check_network),
        ("no ReLU on the embedding", "F.relu(self.phi(", "(self.phi(", check_network),
        ("missing 1 - done", " * (1 - data.dones.unsqueeze(1))", "", check_target),
    ],
)
def test_the_naive_comparison_catches_a_planted_bug(bug, original, planted, check, tmp_path):
    source = SCRIPT.read_text()
    assert source.count(original) == 1
    broken_path = tmp_path / "broken_iqn.py"
    broken_path.write_text(source.replace(original, planted))
    assert check(iqn), f"{bug}: the right script fails its check"
    assert not check(load_algorithm(broken_path)), f"{bug} went unnoticed"


def test_defaults_are_the_papers():
    args = iqn.Args()
    assert (args.n_tau_samples, args.n_tau_prime_samples, args.n_quantile_samples, args.n_cos) == (64, 64, 32, 64)
    assert (args.kappa, args.learning_rate, args.target_network_frequency) == (1.0, 5e-5, 10_000)


# ---------------------------------------------------------------- 2. its own settings on Breakout
# (learning the toy task, resuming exactly and the standard outputs: tests/test_scripts.py, on the same runs)


def test_breakout_run_keeps_the_papers_defaults_and_the_model_its_network_settings(breakout_run):
    stdout, run = breakout_run("iqn")
    args = json.loads((run / "receipt.json").read_text())["args"]
    assert args["n_tau_samples"] == 64 and args["learning_rate"] == 5e-5
    saved = torch.load(run / "iqn.cleanrl_model", map_location="cpu", weights_only=True)
    assert saved["network_kwargs"] == {"n_cos": 64, "n_quantile_samples": 32}
