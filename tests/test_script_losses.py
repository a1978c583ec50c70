"""Each script's own ``compute_loss``, the code a run executes, against an independent float64 reference.

The pure pieces (projections, quantile Huber losses, Munchausen targets) have their own naive tests in the
per-algorithm files. Here the whole loss is checked as the script computes it from its networks: which network
gives which term, the taken action, the terminal mask, the fractions, the importance weights, the loss's shape,
and the gradient that reaches every online parameter (none reaches the target network).

The reference recomputes each network's outputs in float64 from its parameters with functional code written
here (the Nature CNN, each head as its paper describes it), then the loss one transition, one atom or one
quantile at a time; autograd through those loops gives the reference gradient. A planted bug in a copy of each
script (the ones a reviewer tried, and one per family at least) must make the comparison fail.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from test_rainbow import naive_projection

from cleanrl_utils.run import Run
from cleanrl_utils.tools.evaluate import load_algorithm

N_ACTIONS = 3
ACTIONS = [2, 0, 1, 2]  # flipped: [2, 1, 0, 2]; every action taken
REWARDS = [1.0, -1.0, 0.0, 1.0]
DONES = [0.0, 1.0, 0.0, 0.0]
GAMMA = 0.9
N_STEP_DISCOUNTS = [GAMMA**3, 0.0, GAMMA**2, GAMMA**3]  # rainbow: 3 steps, a terminal, a truncation after 2
WEIGHTS = [0.5, 1.0, 0.8, 0.3]  # rainbow's importance-sampling weights
HEAD_SCALE = 20.0  # freshly initialised heads give Q-values within 0.05 of each other: spread them

# what each script is built with here: small heads keep the loops short; the losses read the rest from args
ATOMS = {"n_atoms": 11, "v_min": -3.0, "v_max": 3.0}
SETTINGS = {
    "dqn": ({}, {}),
    "double_dqn": ({}, {}),
    "mdqn": ({}, {}),
    "c51": (ATOMS, ATOMS),
    "qrdqn": ({"n_quantiles": 8}, {"n_quantiles": 8, "kappa": 1.0}),
    "qrdqn_kappa2": ({"n_quantiles": 8}, {"n_quantiles": 8, "kappa": 2.0}),
    "nc_qrdqn": ({"n_quantiles": 8}, {"n_quantiles": 8, "kappa": 1.0}),
    "iqn": ({"n_quantile_samples": 4}, {"n_quantile_samples": 4, "n_tau_samples": 5, "n_tau_prime_samples": 6}),
    "rainbow": (ATOMS, ATOMS),
    "rainbow_no_dueling": ({**ATOMS, "dueling": False}, {**ATOMS, "dueling": False}),
    "rainbow_no_noisy": ({**ATOMS, "noisy": False}, {**ATOMS, "noisy": False}),
    "rainbow_no_prioritized": (ATOMS, {**ATOMS, "prioritized": False}),
}


def script_of(case: str) -> str:
    return case.split("_kappa")[0].split("_no_")[0]


# ---------------------------------------------------------------- the networks in float64, written here


def float64_parameters(network: torch.nn.Module, trained: bool) -> dict[str, torch.Tensor]:
    return {name: p.detach().double().requires_grad_(trained) for name, p in network.named_parameters()}


def nature_features(p: dict[str, torch.Tensor], obs: torch.Tensor) -> torch.Tensor:
    """Mnih et al. (2015): conv 8x8/4, 4x4/2, 3x3/1, each with a ReLU, then 3136 -> 512 and a ReLU; frames / 255"""
    x = obs.double() / 255.0
    x = F.relu(F.conv2d(x, p["encoder.net.0.weight"], p["encoder.net.0.bias"], stride=4))
    x = F.relu(F.conv2d(x, p["encoder.net.2.weight"], p["encoder.net.2.bias"], stride=2))
    x = F.relu(F.conv2d(x, p["encoder.net.4.weight"], p["encoder.net.4.bias"], stride=1))
    return F.relu(x.flatten(1) @ p["encoder.net.7.weight"].T + p["encoder.net.7.bias"])


def linear(p: dict[str, torch.Tensor], name: str, x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """a plain layer, or a noisy one (Fortunato et al. 2018): (mu + sigma * f(eps_out) f(eps_in)^T) x + mu_b
    + sigma_b * f(eps_out), with the layer's current noise draw"""
    layer = module.get_submodule(name)
    if f"{name}.weight" in p:
        return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]
    eps_in, eps_out = layer.epsilon_in.double(), layer.epsilon_out.double()
    weight = p[f"{name}.weight_mu"] + p[f"{name}.weight_sigma"] * torch.outer(eps_out, eps_in)
    return x @ weight.T + p[f"{name}.bias_mu"] + p[f"{name}.bias_sigma"] * eps_out


def q_rows(p, obs, module) -> list[list[torch.Tensor]]:
    """Q(s, a) of a linear head over the features, as [transition][action] float64 scalars"""
    out = linear(p, "head", nature_features(p, obs), module)
    return [[out[i, a] for a in range(N_ACTIONS)] for i in range(len(obs))]


def log_softmax_loop(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    top = max(float(x) for x in logits)
    log_z = top + torch.log(sum(torch.exp(x - top) for x in logits))
    return [x - log_z for x in logits]


def c51_log_probs(p, obs, module, n_atoms: int) -> list[list[list[torch.Tensor]]]:
    """[transition][action][atom] log-probabilities; Rainbow's dueling logits v(i) + A(a, i) - mean_b A(b, i)"""
    features = nature_features(p, obs)
    name = "head" if "head.weight" in p else "advantage"
    advantage = linear(p, name, features, module).view(len(obs), N_ACTIONS, n_atoms)
    value = linear(p, "value", features, module) if getattr(module, "value", None) is not None else None
    out = []
    for i in range(len(obs)):
        rows = []
        for a in range(N_ACTIONS):
            if value is None:
                logits = [advantage[i, a, k] for k in range(n_atoms)]
            else:
                logits = [
                    value[i, k] + advantage[i, a, k] - sum(advantage[i, b, k] for b in range(N_ACTIONS)) / N_ACTIONS
                    for k in range(n_atoms)
                ]
            rows.append(log_softmax_loop(logits))
        out.append(rows)
    return out


def qr_quantiles(p, obs, module, n: int) -> list[list[list[torch.Tensor]]]:
    """[transition][action][quantile]: QR-DQN's linear head, or the non-crossing head (Zhou et al. 2020): the
    cumulative sum of a softmax over N logits, times ReLU(alpha), plus beta"""
    features = nature_features(p, obs)
    if "head.weight" in p:
        out = linear(p, "head", features, module).view(len(obs), N_ACTIONS, n)
        return [[[out[i, a, k] for k in range(n)] for a in range(N_ACTIONS)] for i in range(len(obs))]
    logits = linear(p, "logits", features, module).view(len(obs), N_ACTIONS, n)
    scale = linear(p, "scale", features, module).view(len(obs), N_ACTIONS, 2)
    out = []
    for i in range(len(obs)):
        rows = []
        for a in range(N_ACTIONS):
            probs = [x.exp() for x in log_softmax_loop([logits[i, a, k] for k in range(n)])]
            alpha, beta = F.relu(scale[i, a, 0]), scale[i, a, 1]
            rows.append([alpha * sum(probs[: k + 1]) + beta for k in range(n)])
        out.append(rows)
    return out


def iqn_quantiles(p, obs, taus, module) -> list[list[list[torch.Tensor]]]:
    """Dabney et al. (2018): phi_j(tau) = ReLU(sum_i cos(pi i tau) w_ij + b_j) times the 512 features, then the
    head 512 -> 512 -> n_actions; [transition][action][fraction]"""
    features = nature_features(p, obs)
    n_cos = p["phi.weight"].shape[1]
    out = []
    for i in range(len(obs)):
        rows = [[] for _ in range(N_ACTIONS)]
        for tau in taus[i].double():
            cosines = torch.stack([torch.cos(math.pi * k * tau) for k in range(n_cos)])
            x = features[i] * F.relu(p["phi.weight"] @ cosines + p["phi.bias"])
            x = F.relu(p["head.0.weight"] @ x + p["head.0.bias"])
            q = p["head.2.weight"] @ x + p["head.2.bias"]
            for a in range(N_ACTIONS):
                rows[a].append(q[a])
        out.append(rows)
    return out


def argmax(values) -> int:
    values = [float(v) for v in values]
    return values.index(max(values))


def tau_log_pi(row: list[float], t: float) -> list[float]:
    """t log softmax(row / t)"""
    log_z = math.log(sum(math.exp(x / t) for x in row))
    return [t * (x / t - log_z) for x in row]


def huber(u: torch.Tensor, kappa: float) -> torch.Tensor:
    return 0.5 * u * u if abs(float(u)) <= kappa else kappa * (u.abs() - 0.5 * kappa)


def quantile_loss(theta: list[torch.Tensor], taus: list[float], targets: list[float], kappa: float) -> torch.Tensor:
    """rho_tau(u) = |tau - 1{u < 0}| huber_kappa(u) / kappa, u = target_j - theta_i: summed over i, mean over j"""
    total = 0.0
    for theta_i, tau in zip(theta, taus, strict=True):
        for target in targets:
            u = target - theta_i
            total = total + abs(tau - (1.0 if float(u) < 0 else 0.0)) * huber(u, kappa) / kappa / len(targets)
    return total


# ---------------------------------------------------------------- the losses, one transition at a time


def reference(case: str, online, target, q_network, target_network, data, args, taus=None):
    """(loss, mean Q(s, a) of the taken actions) in float64; the loss carries the online parameters' gradient"""
    algo = script_of(case)
    batch = range(len(data.actions))
    a_taken = [int(a) for a in data.actions]
    r = [float(x) for x in data.rewards]
    not_done = [1.0 - float(d) for d in data.dones]
    total, q_taken = 0.0, []
    if algo in ("dqn", "double_dqn", "mdqn"):
        q = q_rows(online, data.observations, q_network)
        next_q_target = [[float(x) for x in row] for row in q_rows(target, data.next_observations, target_network)]
        next_q_online = q_rows(online, data.next_observations, q_network)
        q_target_s = [[float(x) for x in row] for row in q_rows(target, data.observations, target_network)]
        for i in batch:
            if algo == "dqn":  # r + gamma max_a' Q_target(s', a')
                y = r[i] + args.gamma * not_done[i] * max(next_q_target[i])
            elif algo == "double_dqn":  # the online network chooses, the target network evaluates
                y = r[i] + args.gamma * not_done[i] * next_q_target[i][argmax(next_q_online[i])]
            else:  # Munchausen: pi = softmax(Q_target / tau), the clipped alpha tau log pi(a|s) bonus, a soft value
                t = args.m_tau
                bonus = args.m_alpha * min(max(tau_log_pi(q_target_s[i], t)[a_taken[i]], args.m_l0), 0.0)
                next_log = tau_log_pi(next_q_target[i], t)
                soft = sum(math.exp(lp / t) * (qv - lp) for qv, lp in zip(next_q_target[i], next_log, strict=True))
                y = r[i] + bonus + args.gamma * not_done[i] * soft
            u = y - q[i][a_taken[i]]
            total = total + (huber(u, 1.0) if algo == "mdqn" else u * u) / len(batch)  # MSE; M-DQN: Huber
            q_taken.append(q[i][a_taken[i]].item())
        return total, sum(q_taken) / len(q_taken)
    if algo in ("c51", "rainbow"):
        n = args.n_atoms
        support = [args.v_min + k * (args.v_max - args.v_min) / (n - 1) for k in range(n)]
        log_p = c51_log_probs(online, data.observations, q_network, n)
        next_p = [
            [[math.exp(float(x)) for x in row] for row in rows]
            for rows in c51_log_probs(target, data.next_observations, target_network, n)
        ]
        expectations = [[sum(z * pk for z, pk in zip(support, row, strict=True)) for row in rows] for rows in next_p]
        if algo == "c51":  # the target network chooses and evaluates; one step, no bootstrap after a terminal
            chosen = [argmax(expectations[i]) for i in batch]
            discounts = [args.gamma * not_done[i] for i in batch]
        else:  # Double DQN: the online network chooses; n-step discounts from the batch
            online_next = c51_log_probs(online, data.next_observations, q_network, n)
            online_q = [
                [sum(z * math.exp(float(x)) for z, x in zip(support, row, strict=True)) for row in rows]
                for rows in online_next
            ]
            chosen = [argmax(online_q[i]) for i in batch]
            discounts = [float(x) for x in data.discounts]
        projected = naive_projection([next_p[i][chosen[i]] for i in batch], r, discounts, args.v_min, args.v_max)
        for i in batch:
            cross_entropy = -sum(m * lp for m, lp in zip(projected[i], log_p[i][a_taken[i]], strict=True))
            weight = float(data.weights[i]) if algo == "rainbow" and args.prioritized else 1.0
            total = total + weight * cross_entropy / len(batch)
            q_taken.append(sum(z * math.exp(float(lp)) for z, lp in zip(support, log_p[i][a_taken[i]], strict=True)))
        return total, sum(q_taken) / len(q_taken)
    if algo in ("qrdqn", "nc_qrdqn"):
        n = args.n_quantiles
        theta = qr_quantiles(online, data.observations, q_network, n)
        next_theta = [
            [[float(x) for x in row] for row in rows]
            for rows in qr_quantiles(target, data.next_observations, target_network, n)
        ]
        fractions = [(2 * k + 1) / (2 * n) for k in range(n)]  # the midpoints
        for i in batch:
            best = argmax([sum(row) / n for row in next_theta[i]])
            targets = [r[i] + args.gamma * not_done[i] * x for x in next_theta[i][best]]
            total = total + quantile_loss(theta[i][a_taken[i]], fractions, targets, args.kappa) / len(batch)
            q_taken.append(sum(float(x) for x in theta[i][a_taken[i]]) / n)
        return total, sum(q_taken) / len(q_taken)
    # IQN: the target network's K fractions choose a', its N' others are the target samples
    target_taus, online_taus = taus
    k = args.n_quantile_samples
    theta = iqn_quantiles(online, data.observations, online_taus, q_network)
    next_theta = [
        [[float(x) for x in row] for row in rows]
        for rows in iqn_quantiles(target, data.next_observations, target_taus, target_network)
    ]
    for i in batch:
        best = argmax([sum(row[:k]) / k for row in next_theta[i]])
        targets = [r[i] + args.gamma * not_done[i] * x for x in next_theta[i][best][k:]]
        fractions = [float(x) for x in online_taus[i]]
        total = total + quantile_loss(theta[i][a_taken[i]], fractions, targets, args.kappa) / len(batch)
        q_taken.append(sum(float(x) for x in theta[i][a_taken[i]]) / len(fractions))
    return total, sum(q_taken) / len(q_taken)


# ---------------------------------------------------------------- the comparison


def networks(module, case: str, seed: int = 0):
    """the script's own QNetwork twice, with different weights (online and target), heads spread out"""
    kwargs = SETTINGS[case][0]
    torch.manual_seed(seed)
    q_network, target_network = module.QNetwork(N_ACTIONS, **kwargs), module.QNetwork(N_ACTIONS, **kwargs)
    for net in (q_network, target_network):
        with torch.no_grad():
            for name, p in net.named_parameters():
                if not name.startswith("encoder."):
                    p.mul_(HEAD_SCALE)
    return q_network, target_network


def make_batch(seed: int = 1) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    frames = lambda: torch.randint(0, 256, (len(ACTIONS), 4, 84, 84), generator=g, dtype=torch.uint8)  # noqa: E731
    return SimpleNamespace(
        observations=frames(),
        actions=torch.tensor(ACTIONS),
        rewards=torch.tensor(REWARDS),
        next_observations=frames(),
        dones=torch.tensor(DONES),
        discounts=torch.tensor(N_STEP_DISCOUNTS),
        weights=torch.tensor(WEIGHTS),
    )


def script_args(module, case: str):
    return dataclasses.replace(module.Args(), gamma=GAMMA, **SETTINGS[case][1])


def compare(module, case: str) -> tuple[float, float, float]:
    """The script's loss, its logged q_values and its gradients against the reference's; returns the largest
    relative differences (loss, q_values, gradient)."""
    q_network, target_network = networks(module, case)
    data, args = make_batch(), script_args(module, case)
    online, target = float64_parameters(q_network, True), float64_parameters(target_network, False)
    torch.manual_seed(7)  # IQN draws its fractions inside compute_loss: the target's K + N', then the online N
    loss, metrics, *_ = module.compute_loss(q_network, target_network, data, args)
    taus = None
    if script_of(case) == "iqn":
        torch.manual_seed(7)
        batch = len(ACTIONS)
        taus = (
            torch.rand(batch, args.n_quantile_samples + args.n_tau_prime_samples),
            torch.rand(batch, args.n_tau_samples),
        )
    assert loss.shape == () and loss.dtype == torch.float32, "the loss must be one float32 number"
    loss.backward()
    assert all(p.grad is None for p in target_network.parameters()), "a gradient reached the target network"
    expected, expected_q = reference(case, online, target, q_network, target_network, data, args, taus)
    expected.backward()
    loss_gap = abs(loss.item() - expected.item()) / max(1.0, abs(expected.item()))
    q_gap = abs(torch.as_tensor(metrics["q_values"]).item() - expected_q) / max(1.0, abs(expected_q))
    scale = max(online[name].grad.abs().max().item() for name in online)
    grad_gap = 0.0
    for name, p in q_network.named_parameters():
        if p.grad is None:
            grad_gap = math.inf if online[name].grad.abs().max() > 0 else grad_gap
            continue
        grad_gap = max(grad_gap, (p.grad.double() - online[name].grad).abs().max().item() / scale)
    return loss_gap, q_gap, grad_gap


@pytest.mark.parametrize("case", list(SETTINGS))
def test_compute_loss_matches_the_float64_reference(case):
    module = load_algorithm(REPO / "algos" / f"{script_of(case)}.py")
    loss_gap, q_gap, grad_gap = compare(module, case)
    assert loss_gap < 1e-5, f"{case}: the loss differs from the reference by {loss_gap:.2e} (relative)"
    assert q_gap < 1e-5, f"{case}: the logged q_values differ from the reference by {q_gap:.2e}"
    assert grad_gap < 1e-4, f"{case}: the gradient differs from the reference's by {grad_gap:.2e} of its largest"


# the realistic bugs a reviewer planted, and at least one per family: each must fail the comparison
PLANTS = [
    ("dqn", "no 1 - done", "target_max * (1 - data.dones)", "target_max"),
    ("dqn", "the online network bootstraps", "target_max, _ = target_network(", "target_max, _ = q_network("),
    ("double_dqn", "the target network chooses", "next_actions = q_network(", "next_actions = target_network("),
    ("mdqn", "the bonus from the online network", "target_q = target_network(data", "target_q = q_network(data"),
    ("mdqn", "the next action's bonus", "data.actions, data.rewards", "data.actions.flip(0), data.rewards"),
    ("c51", "other samples' actions", "[rows, data.actions]", "[rows, data.actions.flip(0)]"),
    ("c51", "no 1 - done", "gamma * (1 - data.dones), target_network.atoms", "gamma + 0 * data.dones, target_network.atoms"),
    ("qrdqn", "reversed fractions", "loss = quantile_huber_loss(quantiles, taus,", "loss = quantile_huber_loss(quantiles, taus.flip(0),"),
    ("qrdqn_kappa2", "kappa left out", "target_quantiles, args.kappa)", "target_quantiles, 1.0)"),
    ("nc_qrdqn", "the online network bootstraps", "target_network.quantiles(data.next", "q_network.quantiles(data.next"),
    ("nc_qrdqn", "other samples' actions", "[rows, data.actions]", "[rows, data.actions.flip(0)]"),
    ("iqn", "sorted fractions", "loss = quantile_huber_loss(quantiles, taus,", "loss = quantile_huber_loss(quantiles, taus.sort(dim=1).values,"),
    ("iqn", "a' chosen by the N' samples", "next_quantiles[:, :, :k].mean", "next_quantiles[:, :, k:].mean"),
    ("rainbow", "importance weights ignored", "(data.weights * losses).mean()", "losses.mean()"),
    ("rainbow", "the target network chooses", "next_actions = q_network(data", "next_actions = target_network(data"),
    ("rainbow_no_dueling", "one step, not the batch's discounts", "data.rewards, data.discounts,", "data.rewards, 0.9 * (1 - data.dones),"),
]  # fmt: skip


@pytest.mark.parametrize("case,bug,original,planted", PLANTS, ids=[f"{p[0]}-{p[1]}" for p in PLANTS])
def test_a_planted_bug_in_compute_loss_fails_the_comparison(case, bug, original, planted, tmp_path: Path):
    source = (REPO / "algos" / f"{script_of(case)}.py").read_text()
    assert source.count(original) == 1, f"the plant's text is not in the script once: {original}"
    mutant = tmp_path / f"planted_{script_of(case)}.py"
    mutant.write_text(source.replace(original, planted))
    loss_gap, q_gap, grad_gap = compare(load_algorithm(mutant), case)
    assert loss_gap > 1e-3 or grad_gap > 1e-2, f"{case}: '{bug}' went unnoticed ({loss_gap:.1e}, {grad_gap:.1e})"


def test_the_templates_shipped_update_has_dqns_loss():
    """algos/custom_value_atari.py's ValueAlgorithm.update (its loss sits inside, before its optimizer step): the
    loss and q_values it reports against dqn's reference, and the update moves only the online network."""
    template = load_algorithm(REPO / "algos" / "custom_value_atari.py")
    dqn = load_algorithm(REPO / "algos" / "dqn.py")
    q_network, target_network = networks(dqn, "dqn")
    data, args = make_batch(), script_args(dqn, "dqn")
    envs = SimpleNamespace(n_actions=N_ACTIONS)
    settings = SimpleNamespace(**{**vars(args), "fast": False})
    run = Run.__new__(Run)  # what the algorithm reads of its run (the device, --fast), without starting one
    run.args, run.device = settings, torch.device("cpu")
    algorithm = template.ValueAlgorithm(envs, run, settings)
    algorithm.q_network.load_state_dict(q_network.state_dict())
    algorithm.target_network.load_state_dict(target_network.state_dict())
    online, target = float64_parameters(q_network, True), float64_parameters(target_network, False)
    expected, expected_q = reference("dqn", online, target, q_network, target_network, data, args)
    metrics = algorithm.update(data, global_step=1)
    assert abs(metrics["td_loss"].item() - expected.item()) / max(1.0, abs(expected.item())) < 1e-5
    assert abs(metrics["q_values"].item() - expected_q) / max(1.0, abs(expected_q)) < 1e-5
    pairs = zip(algorithm.target_network.parameters(), target_network.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs), "the update changed the target network"
    pairs = zip(algorithm.q_network.parameters(), q_network.parameters(), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs), "the update did not step the online network"
