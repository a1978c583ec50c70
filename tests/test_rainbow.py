"""Rainbow (algos/rainbow.py): the dueling head, the projection of the Double-DQN n-step target and the
per-transition cross-entropy against naive float64 loops (and planted bugs that the comparison catches), no
bootstrap after a terminal, noisy layers off in evaluation, the beta schedule, its own metrics on the shared
Breakout run, and the expected returns of the model the shared toy run saved at the cues. Learning the toy task,
exact resume and
the standard outputs of a real run are in test_scripts.py, bad flags in test_bad_input.py. No mocks."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, scalars
from test_c51 import SUPPORT, breakout_frames, delayed_image_states

from cleanrl_utils.tools.evaluate import load_algorithm

SCRIPT = REPO / "algos" / "rainbow.py"
rainbow = load_algorithm(SCRIPT)


# ---------------------------------------------------------------- naive references (float64, loops)


def naive_projection(next_probs, rewards, discounts, v_min: float, v_max: float) -> list[list[float]]:
    """Bellemare et al. (2017), Algorithm 1, for an n-step return: target atom R + discount * z_j (discount
    gamma^n, 0 after a terminal), one transition and one atom at a time."""
    n = len(next_probs[0])
    delta = (v_max - v_min) / (n - 1)
    support = [v_min + i * delta for i in range(n)]
    out = []
    for k in range(len(rewards)):
        m = [0.0] * n
        for j in range(n):
            tz = min(max(float(rewards[k]) + float(discounts[k]) * support[j], v_min), v_max)
            b = min(max((tz - v_min) / delta, 0.0), n - 1.0)
            lower, upper = math.floor(b), math.ceil(b)
            if lower == upper:
                m[lower] += float(next_probs[k][j])
            else:
                m[lower] += float(next_probs[k][j]) * (upper - b)
                m[upper] += float(next_probs[k][j]) * (b - lower)
        out.append(m)
    return out


def naive_dueling_log_probs(value, advantage) -> list[list[list[float]]]:
    """per atom i: logit(a, i) = v(i) + A(a, i) - mean_a' A(a', i), then a log-softmax over the atoms"""
    out = []
    for v, adv in zip(value, advantage, strict=True):
        n_actions, n_atoms = len(adv), len(v)
        rows = []
        for a in range(n_actions):
            logits = [v[i] + adv[a][i] - sum(adv[b][i] for b in range(n_actions)) / n_actions for i in range(n_atoms)]
            top = max(logits)
            log_z = top + math.log(sum(math.exp(x - top) for x in logits))
            rows.append([x - log_z for x in logits])
        out.append(rows)
    return out


def naive_cross_entropies(target, log_probs) -> list[float]:
    return [
        -sum(float(t) * float(lp) for t, lp in zip(tr, lr, strict=True))
        for tr, lr in zip(target, log_probs, strict=True)
    ]


def naive_target(online, target, data, v_min: float, v_max: float) -> list[list[float]]:
    """Double: the online network's expected returns pick a*, the target network's distribution at a* is
    projected; the distributions come from the networks, everything after is float64 loops."""
    with torch.no_grad():
        online_probs = online.distribution(data.next_observations).double().tolist()
        target_probs = target.distribution(data.next_observations).double().tolist()
    support = online.atoms.double().tolist()
    chosen = []
    for k in range(len(online_probs)):
        expectations = [sum(p * z for p, z in zip(row, support, strict=True)) for row in online_probs[k]]
        best = max(range(len(expectations)), key=lambda a, e=expectations: e[a])
        chosen.append(target_probs[k][best])
    return naive_projection(chosen, data.rewards.tolist(), data.discounts.tolist(), v_min, v_max)


def random_probs(batch: int, n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.softmax(3.0 * torch.randn(batch, n, generator=generator), dim=1)


def network(seed: int, n_actions: int = 4, n_atoms: int = 11, v_min: float = -1.0, v_max: float = 1.0):
    """The script's own network with sharpened output layers, so that the actions' expected returns differ."""
    torch.manual_seed(seed)
    net = rainbow.QNetwork(n_actions, n_atoms, v_min, v_max)
    with torch.no_grad():
        for layer in (net.value, net.advantage):
            layer.weight_mu.mul_(30.0)
    return net


def frames(batch: int, seed: int) -> torch.Tensor:
    """random frame stacks of increasing brightness (so that the network's greedy action varies)"""
    g = torch.Generator().manual_seed(seed)
    brightness = torch.linspace(0.05, 1.0, batch).view(batch, 1, 1, 1)
    return (255 * brightness * torch.rand(batch, 4, 84, 84, generator=g)).to(torch.uint8)


def n_step_data(batch: int, seed: int, gamma: float = 0.99, n: int = 3) -> SimpleNamespace:
    """what the replay buffer gives: n-step reward sums, gamma^k discounts (k <= n: shorter at an episode end,
    a truncation bootstraps) and 0 after a terminal"""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(1, n + 1, (batch,), generator=g)
    dones = (torch.rand(batch, generator=g) < 0.3).float()
    return SimpleNamespace(
        next_observations=frames(batch, seed + 1),
        rewards=2.0 * torch.randn(batch, generator=g),
        dones=dones,
        discounts=torch.where(dones.bool(), 0.0, gamma ** steps.float()),
    )


# ---------------------------------------------------------------- 1. the math against the naive loops


@pytest.mark.parametrize("n,v_min,v_max", [(51, -10.0, 10.0), (5, -2.0, 2.0), (11, 0.0, 1.0)])
def test_projection_and_cross_entropy_match_naive_loops(n, v_min, v_max):
    g = torch.Generator().manual_seed(n)
    batch = 64
    next_probs = random_probs(batch, n, g)
    rewards = v_min + (v_max - v_min) * (2.0 * torch.rand(batch, generator=g) - 0.5)  # outside the support too
    discounts = torch.where(torch.rand(batch, generator=g) < 0.3, 0.0, 0.99 ** torch.randint(1, 4, (batch,)).float())
    atoms = torch.linspace(v_min, v_max, n)
    got = rainbow.project_distribution(next_probs, rewards, discounts, atoms)
    expected = naive_projection(next_probs.double().tolist(), rewards.tolist(), discounts.tolist(), v_min, v_max)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(dim=1).numpy(), 1.0, atol=1e-5)
    log_probs = torch.log_softmax(torch.randn(batch, n, generator=g), dim=1)
    losses = rainbow.per_sample_cross_entropy(got, log_probs)
    assert losses.shape == (batch,)  # per transition: the loss and the priority
    np.testing.assert_allclose(
        losses.double().numpy(), naive_cross_entropies(expected, log_probs.double().tolist()), rtol=1e-5
    )


def test_dueling_head_matches_naive_loops():
    net = network(0, n_actions=3, n_atoms=7)
    obs = frames(6, 1)
    with torch.no_grad():
        features = net.encoder(obs)
        value = net.value(features).double().tolist()
        advantage = net.advantage(features).view(6, 3, 7).double().tolist()
        got = net.log_distribution(obs)
    np.testing.assert_allclose(got.double().numpy(), naive_dueling_log_probs(value, advantage), rtol=1e-5, atol=1e-5)
    probs = net.distribution(obs)
    np.testing.assert_allclose(probs.sum(dim=2).detach().numpy(), 1.0, atol=1e-5)
    q = net(obs)  # forward: the expected returns, what evaluation takes the argmax of
    np.testing.assert_allclose(q.detach().numpy(), (probs * net.atoms).sum(dim=2).detach().numpy(), atol=1e-6)


def test_double_n_step_target_matches_naive():
    online, target = network(4), network(0)  # their greedy actions differ on several next states
    data = n_step_data(16, 2)
    got = rainbow.compute_target_distribution(online, target, data)
    expected = naive_target(online, target, data, -1.0, 1.0)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)
    # the online network's choice matters here: the target network's own greedy choice gives another target
    target_choice = naive_target(target, target, data, -1.0, 1.0)
    assert not np.allclose(got.double().numpy(), target_choice, atol=1e-4)


def test_terminal_transitions_never_bootstrap():
    """discount 0 (a terminal within the n steps): the target is the reward's projection, whatever comes next."""
    data = SimpleNamespace(rewards=torch.tensor([0.5, -0.3, 2.0, 0.8]), discounts=torch.tensor([0.0, 0.0, 0.0, 0.97]))
    targets = []
    for seed in (1, 2):
        data.next_observations = frames(4, 10 + seed)
        targets.append(rainbow.compute_target_distribution(network(seed), network(seed + 10), data))
    expected = torch.zeros(3, 11)  # 11 atoms on [-1, 1], spacing 0.2
    expected[0, 7], expected[0, 8] = 0.5, 0.5
    expected[1, 3], expected[1, 4] = 0.5, 0.5
    expected[2, 10] = 1.0
    for target in targets:
        np.testing.assert_allclose(target[:3].numpy(), expected.numpy(), atol=1e-5)
    assert not torch.allclose(targets[0][3], targets[1][3], atol=1e-3)  # a non-terminal one did bootstrap


def check_target(module) -> bool:
    online, target = network(4), network(0)
    data = n_step_data(16, 2)
    got = module.compute_target_distribution(online, target, data)
    return np.allclose(got.double().numpy(), naive_target(online, target, data, -1.0, 1.0), rtol=1e-5, atol=1e-6)


def check_dueling(module) -> bool:
    g = torch.Generator().manual_seed(0)
    value, advantage = torch.randn(4, 1, 5, generator=g), torch.randn(4, 3, 5, generator=g)
    got = torch.log_softmax(module.dueling_logits(value, advantage), dim=2)
    expected = naive_dueling_log_probs(value[:, 0].double().tolist(), advantage.double().tolist())
    return np.allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "bug,original,planted,check",
    [
        ("one-step discount", "discounts.unsqueeze(1) * atoms", "0.99 * atoms", check_target),
        (
            "not Double",
            "q_network(data.next_observations).argmax",
            "target_network(data.next_observations).argmax",
            check_target,
        ),
        ("no clipping to the support", ".clamp(atoms[0], atoms[-1])", "", check_target),
        ("dueling without the mean", " - advantage.mean(dim=1, keepdim=True)", "", check_dueling),
    ],
)
def test_the_naive_comparison_catches_a_planted_bug(bug, original, planted, check, tmp_path):
    source = SCRIPT.read_text()
    assert source.count(original) == 1
    broken_path = tmp_path / "broken_rainbow.py"
    broken_path.write_text(source.replace(original, planted))
    assert check(rainbow), f"{bug}: the right script fails its check"
    assert not check(load_algorithm(broken_path)), f"{bug} went unnoticed"


def test_noise_acts_in_training_and_evaluation_uses_the_mean_weights():
    net = network(3)
    obs = frames(4, 5)
    with torch.no_grad():
        first = net(obs)
        rainbow.reset_noise(net)
        assert not torch.allclose(first, net(obs), atol=1e-4)  # training mode: a new draw, other Q-values
        net.eval()
        evaluated = net(obs)
        rainbow.reset_noise(net)
        torch.testing.assert_close(evaluated, net(obs))  # evaluation mode: the mean weights, no noise


def test_beta_schedule():
    assert rainbow.beta_schedule(0.4, 1.0, 1000, 0) == pytest.approx(0.4)
    assert rainbow.beta_schedule(0.4, 1.0, 1000, 500) == pytest.approx(0.7)
    assert rainbow.beta_schedule(0.4, 1.0, 1000, 1000) == pytest.approx(1.0)
    assert rainbow.beta_schedule(0.4, 1.0, 1000, 5000) == pytest.approx(1.0)
    assert rainbow.beta_schedule(0.4, 0.6, 1000, 500) == pytest.approx(0.5)  # to another end
    assert [rainbow.beta_schedule(0.5, 0.5, 1000, t) for t in (0, 500, 5000)] == [0.5] * 3  # DER: held
    assert rainbow.Args().prioritized_beta_end == 1.0


def test_defaults_are_the_papers():
    args = rainbow.Args()
    assert (args.n_atoms, args.v_min, args.v_max, args.n_step) == (51, -10.0, 10.0, 3)
    assert (args.learning_rate, args.adam_eps) == (6.25e-5, 1.5e-4)
    assert (args.prioritized_alpha, args.prioritized_beta, args.noisy_sigma) == (0.5, 0.4, 0.5)
    assert (args.target_network_frequency, args.learning_starts, args.buffer_size) == (8_000, 20_000, 1_000_000)
    assert (args.batch_size, args.train_frequency) == (32, 4)
    assert (args.n_step, args.prioritized, args.dueling, args.noisy) == (3, True, True, True)  # every part on
    assert (args.start_e, args.end_e) == (0.0, 0.0)  # resolved by Args: 0 with noisy layers (the receipts)
    assert (rainbow.Args(noisy=False).start_e, rainbow.Args(noisy=False).end_e) == (1.0, 0.01)  # DQN's without
    assert rainbow.Args(start_e=0.5).start_e == 0.5  # a value given stays


# ---------------------------------------------------------------- 2. its own values on Breakout
# (learning the toy task, resuming exactly and the standard outputs: tests/test_scripts.py, on the same runs)


def test_breakout_run_logs_beta_and_sigma_and_explores_by_noise_alone(breakout_run):
    stdout, run = breakout_run("rainbow")
    pattern = r"^TRAIN_METRICS step=1000 td_loss=(\S+) q_values=(\S+) beta=(\S+) noisy_sigma=(\S+)$"
    [metrics] = re.findall(pattern, stdout, re.M)
    td_loss, q_value, beta, sigma = (float(v) for v in metrics)
    assert 0.0 < td_loss < 10.0  # a cross-entropy over 51 atoms: log(51) = 3.9 against a uniform prediction
    # the saved network's support is the 51 atoms of [-10, 10], and the logged mean Q-value (step 1000, replayed
    # states, noisy weights) is what the distribution expects: within 0.2 (half the atoms' spacing) of the saved
    # model's (25 updates later, its mean weights) mean expectation on Breakout frames, computed here. Both lie near 0
    # so early, so a sign error cannot show on Breakout (the toy run's values in test_scripts.py catch it)
    saved = torch.load(run / "rainbow.cleanrl_model", map_location="cpu", weights_only=True)
    torch.testing.assert_close(saved["state_dict"]["atoms"].double(), SUPPORT, rtol=0, atol=1e-6)
    net = rainbow.QNetwork(4, **saved["network_kwargs"])
    net.load_state_dict(saved["state_dict"])
    net.eval()
    with torch.no_grad():
        recomputed = (net.distribution(breakout_frames()).double() * SUPPORT).sum(dim=-1).mean().item()
    assert abs(q_value - recomputed) < 0.2, f"logged mean Q {q_value}, the model expects {recomputed:.4f}"
    assert beta == pytest.approx(0.4 + 0.6 * 1000 / 1100, abs=1e-3)  # annealed towards 1 over the run
    assert 0.0 < sigma < 0.1  # sigma_0 / sqrt(512) = 0.022 at the start
    logged = scalars(run)
    assert {"losses/beta", "losses/noisy_sigma"} <= set(logged)
    assert all(e.value == 0.0 for e in logged["charts/epsilon"])  # the noisy layers explore
    args = json.loads((run / "receipt.json").read_text())["args"]
    assert args["n_step"] == 3 and args["learning_rate"] == 6.25e-5
    assert (args["start_e"], args["end_e"]) == (0.0, 0.0)


def test_toy_run_model_expects_the_discounted_reward_at_each_cue(toy_run):
    """The model that the shared DelayedImage run saved (at the optimum; evaluation mode, its mean weights) expects
    gamma (0.99: the reward 1 one step later) for the matching action at each cue, within 0.05, on the support
    written here; its forward is that expectation. A wrong support, a sign error or a scaled expectation fails this
    while the greedy policy can still win. Only the cues: at seed 1 the frames after a wrong cue action, rarely seen
    once the policy is right, stay far from their value 0 (measured: up to 0.95; 0.00-0.11 at seeds 2 and 3),
    where C51's run learns every state (test_c51.py)."""
    states, true_values = delayed_image_states()
    assert true_values[[0, 3]].diagonal().tolist() == [0.99, 0.99]  # rows 0 and 3 are the cues
    saved = torch.load(toy_run("rainbow").dir / "rainbow.cleanrl_model", map_location="cpu", weights_only=True)
    net = rainbow.QNetwork(2, **saved["network_kwargs"])
    net.load_state_dict(saved["state_dict"])
    net.eval()
    observations = states[[0, 3]]  # the two cues
    with torch.no_grad():
        probs, forward = net.distribution(observations), net(observations)
    values = (probs.double() * SUPPORT).sum(dim=-1)  # (cue, action)
    np.testing.assert_allclose(forward.double().numpy(), values.numpy(), atol=1e-5)
    np.testing.assert_allclose(values.diagonal().numpy(), [0.99, 0.99], atol=0.05)


def test_breakout_model_records_its_network_settings(breakout_run):
    """evaluation rebuilds the network from these (noisy sigma included), in evaluation mode"""
    saved = torch.load(breakout_run("rainbow").dir / "rainbow.cleanrl_model", map_location="cpu", weights_only=True)
    assert saved["network_kwargs"] == {
        "n_atoms": 51, "v_min": -10.0, "v_max": 10.0, "noisy_sigma": 0.5, "dueling": True, "noisy": True
    }  # fmt: skip
