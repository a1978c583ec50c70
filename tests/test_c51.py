"""C51 (algos/c51.py): the categorical projection and the cross-entropy against naive float64 loops (and a
planted bug that the comparison catches), no bootstrap after a terminal, its own metrics on the shared Breakout
run, and the expected returns of the model the shared toy run saved against the toy task's true values. Learning
the toy task, exact resume and the standard outputs of a real run are in test_scripts.py, bad flags in
test_bad_input.py. No mocks."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, weights
from toy_envs import DelayedImage

from cleanrl_utils.envs import TrainEnvs
from cleanrl_utils.tools.evaluate import load_algorithm

SCRIPT = REPO / "algos" / "c51.py"
c51 = load_algorithm(SCRIPT)


# ---------------------------------------------------------------- naive references (float64, loops)


def naive_projection(next_probs, rewards, dones, gamma: float, v_min: float, v_max: float) -> list[list[float]]:
    """Bellemare et al. (2017), Algorithm 1, one transition and one atom at a time."""
    n = len(next_probs[0])
    delta = (v_max - v_min) / (n - 1)
    support = [v_min + i * delta for i in range(n)]
    out = []
    for k in range(len(rewards)):
        m = [0.0] * n
        for j in range(n):
            tz = float(rewards[k]) if dones[k] else float(rewards[k]) + gamma * support[j]
            tz = min(max(tz, v_min), v_max)
            b = min(max((tz - v_min) / delta, 0.0), n - 1.0)
            lower, upper = math.floor(b), math.ceil(b)
            if lower == upper:  # lands on a support point: all of p_j goes there
                m[lower] += float(next_probs[k][j])
            else:
                m[lower] += float(next_probs[k][j]) * (upper - b)
                m[upper] += float(next_probs[k][j]) * (b - lower)
        out.append(m)
    return out


def naive_cross_entropies(target, log_probs) -> list[float]:
    """-sum_i target_i * log p_i, one transition at a time"""
    return [
        -sum(float(t) * float(lp) for t, lp in zip(tr, lr, strict=True))
        for tr, lr in zip(target, log_probs, strict=True)
    ]


def random_probs(batch: int, n: int, generator: torch.Generator, sharpness: float = 3.0) -> torch.Tensor:
    return torch.softmax(sharpness * torch.randn(batch, n, generator=generator), dim=1)


def atoms(n: int, v_min: float, v_max: float) -> torch.Tensor:
    return torch.linspace(v_min, v_max, n)


# ---------------------------------------------------------------- 1. the loss math against the naive loops


@pytest.mark.parametrize(
    "n,v_min,v_max,gamma",
    [(51, -10.0, 10.0, 0.99), (5, -2.0, 2.0, 1.0), (11, 0.0, 1.0, 0.9), (7, -1.5, 4.5, 0.5)],
)
def test_projection_and_cross_entropy_match_naive_loops(n, v_min, v_max, gamma):
    g = torch.Generator().manual_seed(n)
    batch = 64
    next_probs = random_probs(batch, n, g)
    span = v_max - v_min
    # rewards well outside the support too (clipped to its ends), and integers that, with gamma 1 and
    # the unit spacing of the 5-atom support, put every target atom exactly on a support point
    rewards = torch.where(
        torch.arange(batch) % 2 == 0,
        v_min + span * (2.0 * torch.rand(batch, generator=g) - 0.5),
        torch.randint(-3, 4, (batch,), generator=g).float(),
    )
    dones = (torch.rand(batch, generator=g) < 0.3).float()
    got = c51.project_distribution(next_probs, rewards, gamma * (1 - dones), atoms(n, v_min, v_max))
    expected = naive_projection(next_probs.double().tolist(), rewards.tolist(), dones.tolist(), gamma, v_min, v_max)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(dim=1).numpy(), 1.0, atol=1e-5)  # no mass lost or made
    log_probs = torch.log_softmax(torch.randn(batch, n, generator=g), dim=1)
    losses = c51.per_sample_cross_entropy(got, log_probs)
    naive = naive_cross_entropies(expected, log_probs.double().tolist())
    np.testing.assert_allclose(losses.double().numpy(), naive, rtol=1e-5)
    assert losses.mean().item() == pytest.approx(sum(naive) / batch, rel=1e-5)  # the loss: their batch mean


def test_projection_hand_cases():
    """5 atoms on [-2, 2] (spacing 1), gamma 1: exact landing, clipping at both ends, terminal rewards."""
    support = atoms(5, -2.0, 2.0)
    one_hot = torch.eye(5)
    cases = [  # next distribution, reward, done -> projected target
        (one_hot[0], 1.0, 0.0, [0, 1, 0, 0, 0]),  # -2 + 1 = -1: exactly on atom 1
        (one_hot[4], 1.0, 0.0, [0, 0, 0, 0, 1]),  # 2 + 1 = 3: clipped to 2
        (one_hot[0], -5.0, 0.0, [1, 0, 0, 0, 0]),  # -2 - 5 = -7: clipped to -2
        (one_hot[1], 0.25, 0.0, [0, 0.75, 0.25, 0, 0]),  # -0.75: split between -1 and 0
        (one_hot[4], 0.5, 1.0, [0, 0, 0.5, 0.5, 0]),  # terminal: all mass at r = 0.5
        (torch.full((5,), 0.2), -9.0, 1.0, [1, 0, 0, 0, 0]),  # terminal, reward clipped to -2
        (torch.full((5,), 0.2), 1.0, 1.0, [0, 0, 0, 1, 0]),  # terminal, reward on atom 3
    ]
    next_probs = torch.stack([c[0] for c in cases])
    rewards = torch.tensor([c[1] for c in cases])
    dones = torch.tensor([c[2] for c in cases])
    got = c51.project_distribution(next_probs, rewards, 1.0 * (1 - dones), support)
    np.testing.assert_allclose(got.numpy(), [c[3] for c in cases], atol=1e-6)


def check_projection(module) -> bool:
    g = torch.Generator().manual_seed(0)
    n, v_min, v_max, gamma, batch = 11, -1.0, 1.0, 0.9, 32
    next_probs = random_probs(batch, n, g)
    rewards = 3.0 * torch.randn(batch, generator=g)
    dones = (torch.rand(batch, generator=g) < 0.5).float()
    expected = naive_projection(next_probs.double().tolist(), rewards.tolist(), dones.tolist(), gamma, v_min, v_max)
    got = module.project_distribution(next_probs, rewards, gamma * (1 - dones), atoms(n, v_min, v_max))
    return np.allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)


def check_target(module) -> bool:
    """the target from the script's own network, terminals included, against the naive projection"""
    torch.manual_seed(0)
    net = module.QNetwork(4, 11, -1.0, 1.0)
    g = torch.Generator().manual_seed(3)
    data = SimpleNamespace(
        next_observations=frames(16, 2), rewards=torch.randn(16, generator=g), dones=torch.tensor([0.0, 1.0] * 8)
    )
    with torch.no_grad():
        probs = net.distribution(data.next_observations).double().tolist()
    support = net.atoms.double().tolist()
    chosen = []
    for rows in probs:
        expectations = [sum(p * z for p, z in zip(row, support, strict=True)) for row in rows]
        chosen.append(rows[max(range(4), key=lambda a, e=expectations: e[a])])
    expected = naive_projection(chosen, data.rewards.tolist(), data.dones.tolist(), 0.9, -1.0, 1.0)
    got = module.compute_target_distribution(net, data, 0.9)
    return np.allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)


def check_loss(module) -> bool:
    g = torch.Generator().manual_seed(1)
    target = random_probs(32, 11, g)
    log_probs = torch.log_softmax(torch.randn(32, 11, generator=g), dim=1)
    got = module.per_sample_cross_entropy(target, log_probs).double().numpy()
    return np.allclose(got, naive_cross_entropies(target.tolist(), log_probs.tolist()), rtol=1e-5)


@pytest.mark.parametrize(
    "bug,original,planted,check",
    [
        ("missing 1 - done", "gamma * (1 - data.dones)", "gamma * torch.ones_like(data.dones)", check_target),
        ("no clipping to the support", ".clamp(atoms[0], atoms[-1])", "", check_projection),
        ("too wide a split", ".abs() / delta_z", ".abs() / (2 * delta_z)", check_projection),
        (
            "cross-entropy with the sign lost",
            "return -(target_probs * log_probs)",
            "return (target_probs * log_probs)",
            check_loss,
        ),
    ],
)
def test_the_naive_comparison_catches_a_planted_bug(bug, original, planted, check, tmp_path):
    source = SCRIPT.read_text()
    assert source.count(original) == 1
    broken_path = tmp_path / "broken_c51.py"
    broken_path.write_text(source.replace(original, planted))
    assert check(c51), f"{bug}: the right script fails its check"
    assert not check(load_algorithm(broken_path)), f"{bug} went unnoticed"


# ---------------------------------------------------------------- 2. the target from the networks; terminals


def network(seed: int, n_actions: int = 4, n_atoms: int = 11, v_min: float = -1.0, v_max: float = 1.0):
    """The script's own network with a sharpened head, so that the actions' expected returns differ."""
    torch.manual_seed(seed)
    net = c51.QNetwork(n_actions, n_atoms, v_min, v_max)
    with torch.no_grad():
        net.head.weight.mul_(30.0)
    return net


def frames(batch: int, seed: int) -> torch.Tensor:
    """random frame stacks of increasing brightness (so that the network's greedy action varies)"""
    g = torch.Generator().manual_seed(seed)
    brightness = torch.linspace(0.05, 1.0, batch).view(batch, 1, 1, 1)
    return (255 * brightness * torch.rand(batch, 4, 84, 84, generator=g)).to(torch.uint8)


def test_network_outputs_and_target_match_naive():
    net = network(0)
    next_obs = frames(16, 2)
    probs = net.distribution(next_obs)
    assert probs.shape == (16, 4, 11)
    np.testing.assert_allclose(probs.sum(dim=2).detach().numpy(), 1.0, atol=1e-5)
    q = net(next_obs)  # forward: the expected returns, what evaluation takes the argmax of
    np.testing.assert_allclose(q.detach().numpy(), (probs * net.atoms).sum(dim=2).detach().numpy(), atol=1e-6)
    g = torch.Generator().manual_seed(3)
    data = SimpleNamespace(
        next_observations=next_obs, rewards=torch.randn(16, generator=g), dones=torch.tensor([0.0, 1.0] * 8)
    )
    got = c51.compute_target_distribution(net, data, 0.9)
    rows = probs.double().tolist()
    support = net.atoms.double().tolist()
    expectations = [[sum(p * z for p, z in zip(row, support, strict=True)) for row in action] for action in rows]
    best = [max(range(4), key=lambda a, e=e: e[a]) for e in expectations]
    assert len(set(best)) > 1  # the greedy next action varies, so picking it matters
    chosen = [rows[k][best[k]] for k in range(16)]
    expected = naive_projection(chosen, data.rewards.tolist(), data.dones.tolist(), 0.9, -1.0, 1.0)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_terminal_transitions_never_bootstrap():
    """dones = 1: the target is the reward's projection, whatever the next state and the target network."""
    rewards = torch.tensor([0.5, -0.3, 2.0, -1.0, 0.0, 0.8])
    dones = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    targets = []
    for seed in (1, 2):
        data = SimpleNamespace(next_observations=frames(6, 10 + seed), rewards=rewards, dones=dones)
        targets.append(c51.compute_target_distribution(network(seed), data, 0.99))
    # 11 atoms on [-1, 1], spacing 0.2: 0.5 halfway between 0.4 and 0.6, -0.3 between -0.4 and -0.2,
    # 2 clipped to 1, -1 and 0 on atoms
    expected = torch.zeros(5, 11)
    expected[0, 7], expected[0, 8] = 0.5, 0.5
    expected[1, 3], expected[1, 4] = 0.5, 0.5
    expected[2, 10] = 1.0
    expected[3, 0] = 1.0
    expected[4, 5] = 1.0
    for target in targets:
        np.testing.assert_allclose(target[:5].numpy(), expected.numpy(), atol=1e-5)
    assert not torch.allclose(targets[0][5], targets[1][5], atol=1e-3)  # a non-terminal one did bootstrap


# ---------------------------------------------------------------- 3. its own values on Breakout and the toy task
# (learning the toy task, resuming exactly and the standard outputs: tests/test_scripts.py, on the same runs)

SUPPORT = torch.tensor([-10.0 + 20.0 * i / 50 for i in range(51)], dtype=torch.float64)  # the default 51 atoms


def expected_returns(probs: torch.Tensor) -> torch.Tensor:
    """sum_i p_i z_i on the default support, in float64, written here: (..., 51) -> (...)"""
    return (probs.double() * SUPPORT).sum(dim=-1)


def breakout_frames(n: int = 200, seed: int = 7) -> torch.Tensor:
    """n observations of a Breakout game played at random, as the training games show them"""
    envs = TrainEnvs("BreakoutNoFrameskip-v4", 1, seed=seed)
    rng = np.random.default_rng(seed)
    try:
        envs.reset()
        observations = [envs.step(rng.integers(0, 4, 1)).next_obs[0] for _ in range(n)]
    finally:
        envs.close()
    return torch.as_tensor(np.stack(observations))


def delayed_image_states(gamma: float = 0.99) -> tuple[torch.Tensor, torch.Tensor]:
    """DelayedImage-v0's six states (cue 0, the good frame after the matching action, the bad frame after the other;
    then the same for cue 1: the cues at rows 0 and 3) and their true values Q*(s, a): gamma for the matching action at the cue, 0 for the other; 1 for every
    action at the good frame, 0 at the bad one. Returns observations (6, 4, 84, 84) and values (6, 2)."""
    observations, values = [], []
    for cue in (0, 1):
        for action in (cue, 1 - cue):
            env, seed = DelayedImage(), 0
            observation, _ = env.reset(seed=seed)
            while env.cue != cue:
                seed += 1
                observation, _ = env.reset(seed=seed)
            if action == cue:  # the cue itself, once
                observations.append(observation)
                values.append([gamma if a == cue else 0.0 for a in (0, 1)])
            observations.append(env.step(action)[0])
            values.append([1.0, 1.0] if action == cue else [0.0, 0.0])
    return torch.as_tensor(np.stack(observations)), torch.tensor(values, dtype=torch.float64)


def test_breakout_run_logs_a_cross_entropy_and_the_expectation_of_its_distribution(breakout_run):
    stdout, run = breakout_run("c51")
    [(td_loss, q_value)] = re.findall(r"^TRAIN_METRICS step=1000 td_loss=(\S+) q_values=(\S+)$", stdout, re.M)
    assert 0.0 < float(td_loss) < 10.0  # a cross-entropy over 51 atoms: log(51) = 3.9 against a uniform prediction
    args = json.loads((run / "receipt.json").read_text())["args"]
    assert args["n_atoms"] == 51 and args["learning_rate"] == 2.5e-4
    # the saved network's support is the 51 atoms of [-10, 10], and the logged mean Q-value (step 1000, on replayed
    # states) is what the distribution expects: within 0.2 (half the atoms' spacing) of the saved model's (25
    # updates later) mean expectation on Breakout frames, computed here. Both lie near 0 so early, so a sign error
    # cannot show on Breakout: the toy run's values below and in test_scripts.py catch it
    saved = weights(run)
    torch.testing.assert_close(saved["atoms"].double(), SUPPORT, rtol=0, atol=1e-6)
    net = c51.QNetwork(4)
    net.load_state_dict(saved)
    with torch.no_grad():
        probs = net.distribution(breakout_frames())
    recomputed = expected_returns(probs).mean().item()
    assert abs(float(q_value) - recomputed) < 0.2, f"logged mean Q {q_value}, the model expects {recomputed:.4f}"


def test_toy_run_model_expects_the_true_values(toy_run):
    """The model that the shared DelayedImage run saved (600 updates, at the optimum) expects each state's true
    value, Q* (gamma 0.99), within 0.1 for every action; its forward (what evaluation takes the argmax of) is that
    expectation. A wrong support, a sign error or a scaled expectation fails this while the greedy policy can still
    win (measured: within 0.011 of Q* everywhere)."""
    saved = weights(toy_run("c51").dir)
    net = c51.QNetwork(2)
    net.load_state_dict(saved)
    observations, true_values = delayed_image_states()
    with torch.no_grad():
        probs, forward = net.distribution(observations), net(observations)
    values = expected_returns(probs)
    np.testing.assert_allclose(forward.double().numpy(), values.numpy(), atol=1e-5)
    np.testing.assert_allclose(values.numpy(), true_values.numpy(), atol=0.1)
