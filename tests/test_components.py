"""The component flags of dqn.py, double_dqn.py and c51.py (--n-step, --prioritized, --dueling, --noisy): the
dueling head, the n-step targets, the importance-weighted losses and the new priorities against naive float64
loops (with planted bugs that the comparisons catch), noisy layers off in evaluation, defaults unchanged, dqn
and c51 with all four flags learning a toy task, their saved models re-evaluated as a user would, and bad flags.
No mocks.

The buffers' own n-step returns and priorities are tested in tests/test_buffer.py and tests/test_prioritized.py;
here, what the scripts compute from them."""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, run_python, run_script
from test_buffer import FRAME, STACK, RandomStreams, fill, naive_n_step
from test_learning import FAST_LEARNING
from test_rainbow import naive_dueling_log_probs, naive_projection
from torch import nn

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.evaluation import load_algorithm
from cleanrl_utils.noisy import NoisyLinear, reset_noise
from cleanrl_utils.prioritized import PrioritizedReplayBuffer

ALGOS = REPO / "algos"
SCRIPTS = {name: load_algorithm(ALGOS / f"{name}.py") for name in ("dqn", "double_dqn", "c51")}
GAMMA = 0.9


# ---------------------------------------------------------------- naive references (float64, loops)


def naive_linear(layer: nn.Module, features: list[list[float]]) -> list[list[float]]:
    """y = W x + b, one output at a time; a noisy layer in training mode with its current noise
    W = mu_w + sigma_w * eps_out eps_in^T, b = mu_b + sigma_b * eps_out, in evaluation mode its means"""
    if isinstance(layer, NoisyLinear):
        mu_w, sigma_w = layer.weight_mu.double().tolist(), layer.weight_sigma.double().tolist()
        mu_b, sigma_b = layer.bias_mu.double().tolist(), layer.bias_sigma.double().tolist()
        eps_in, eps_out = layer.epsilon_in.double().tolist(), layer.epsilon_out.double().tolist()
        noise = 1.0 if layer.training else 0.0
        weight = [
            [mu_w[o][i] + noise * sigma_w[o][i] * eps_out[o] * eps_in[i] for i in range(len(eps_in))]
            for o in range(len(eps_out))
        ]
        bias = [mu_b[o] + noise * sigma_b[o] * eps_out[o] for o in range(len(eps_out))]
    else:
        weight, bias = layer.weight.double().tolist(), layer.bias.double().tolist()
    return [
        [b + sum(w * x for w, x in zip(row, f, strict=True)) for row, b in zip(weight, bias, strict=True)]
        for f in features
    ]


def naive_dueling_q(net, obs: torch.Tensor) -> list[list[float]]:
    """Q(s, a) = V(s) + A(s, a) - mean_a' A(s, a') over the script's layers, from the encoder's features"""
    with torch.no_grad():
        features = net.encoder(obs).double().tolist()
    out = []
    for [v], advantages in zip(naive_linear(net.value, features), naive_linear(net.head, features), strict=True):
        mean = sum(advantages) / len(advantages)
        out.append([v + a - mean for a in advantages])
    return out


def naive_dueling_c51(net, obs: torch.Tensor) -> list[list[list[float]]]:
    """C51's dueling head per atom (as Rainbow), log-softmax over the atoms"""
    with torch.no_grad():
        features = net.encoder(obs).double().tolist()
    n_actions, n_atoms = net.n_actions, net.n_atoms
    value = naive_linear(net.value, features)
    advantage = [
        [row[a * n_atoms : (a + 1) * n_atoms] for a in range(n_actions)] for row in naive_linear(net.head, features)
    ]
    return naive_dueling_log_probs(value, advantage)


def q_rows(net, obs) -> list[list[float]]:
    with torch.no_grad():
        return net(obs).double().tolist()


class TinyQ(nn.Module):
    def __init__(self, seed: int, n_actions: int = 6):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(STACK * FRAME[0] * FRAME[1], n_actions)

    def forward(self, x):
        return 3.0 * self.linear(x.float().flatten(1) / 255.0)


def filled(n_step: int, prioritized: bool = False, seed: int = 0):
    """a real buffer over random streams with terminations, truncations and life losses; the streams' truth"""
    streams = RandomStreams(2, seed=seed, p_term=0.08, p_trunc=0.05, p_life=0.1)
    kwargs = dict(n_step=n_step, gamma=GAMMA, seed=seed)
    buffer = (PrioritizedReplayBuffer if prioritized else ReplayBuffer)(10_000, 2, (STACK, *FRAME), **kwargs)
    fill(buffer, streams, 120, np.random.default_rng(seed + 1))
    truth = {}
    for history in streams.history:
        truth.update(naive_n_step(history, n_step, GAMMA))
    return buffer, truth


def naive_td_targets(algo: str, online, target, batch, truth) -> list[float]:
    """sum_k gamma^k r_{t+k} + gamma^m Q(s_{t+m}, ...) from the streams' own record, no bootstrap after a
    terminal; Q from the networks, the rest in float64"""
    out = []
    for i in range(len(batch.actions)):
        ret, next_obs, done, discount = truth[
            batch.observations[i].numpy().tobytes() + bytes([batch.actions[i].item()])
        ]
        s = torch.from_numpy(np.frombuffer(next_obs, dtype=np.uint8).reshape(1, STACK, *FRAME).copy())
        [online_q], [target_q] = q_rows(online, s), q_rows(target, s)
        if algo == "dqn":
            bootstrap = max(target_q)
        else:  # double: the online network picks, the target network evaluates
            bootstrap = target_q[max(range(len(online_q)), key=lambda a, q=online_q: q[a])]
        out.append(ret + (0.0 if done else discount * bootstrap))
    return out


# ---------------------------------------------------------------- 1. defaults; the scripts' shape


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_is_off_by_default_and_the_default_network_is_unchanged(name):
    module = SCRIPTS[name]
    args = module.Args()
    assert (args.n_step, args.prioritized, args.dueling, args.noisy) == (1, False, False, False)
    assert (args.prioritized_alpha, args.prioritized_beta, args.noisy_sigma) == (0.5, 0.4, 0.5)
    keys = set(module.QNetwork(4).state_dict())  # the same state dict as before the flags: old models load
    assert {k for k in keys if not k.startswith("encoder.")} == {"head.weight", "head.bias"} | (
        {"atoms"} if name == "c51" else set()
    )
    assert type(module.QNetwork(4).head) is nn.Linear


def test_double_dqn_differs_from_dqn_only_in_its_target():
    """`diff algos/dqn.py algos/double_dqn.py` shows what Double DQN changes, with the flags in both"""
    dqn, double = ((ALGOS / f"{name}.py").read_text().splitlines() for name in ("dqn", "double_dqn"))
    start = dqn.index(next(line for line in dqn if line.startswith("def compute_td_target")))
    end = next(i for i in range(start + 1, len(dqn)) if dqn[i].startswith("def "))
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, dqn, double, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        header = i2 <= 1
        target = start <= i1 and i2 < end
        metrics = any("run.train_metrics" in line for line in dqn[i1:i2])  # the two scripts' own logging line
        assert header or target or metrics, f"dqn.py and double_dqn.py differ at lines {i1 + 1}-{i2}: {dqn[i1:i2]}"


# ---------------------------------------------------------------- 2. the dueling head, noisy layers


@pytest.mark.parametrize("name", ["dqn", "double_dqn"])
def test_dueling_head_matches_naive_loops(name):
    torch.manual_seed(0)
    net = SCRIPTS[name].QNetwork(5, dueling=True)
    obs = (255 * torch.rand(3, 4, 84, 84)).to(torch.uint8)
    got = q_rows(net, obs)
    np.testing.assert_allclose(got, naive_dueling_q(net, obs), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        advantages = net.head(net.encoder(obs))
    assert not np.allclose(got, advantages.double().numpy(), atol=1e-3)  # the value stream counts


def test_c51_dueling_head_matches_naive_loops():
    torch.manual_seed(1)
    net = SCRIPTS["c51"].QNetwork(3, 7, -1.0, 1.0, dueling=True)
    obs = (255 * torch.rand(2, 4, 84, 84)).to(torch.uint8)
    with torch.no_grad():
        got = net.log_distribution(obs).double().numpy()
    np.testing.assert_allclose(got, naive_dueling_c51(net, obs), rtol=1e-5, atol=1e-5)


def check_dueling(module) -> bool:
    torch.manual_seed(0)
    net = module.QNetwork(4, dueling=True)
    obs = (255 * torch.rand(2, 4, 84, 84)).to(torch.uint8)
    return np.allclose(q_rows(net, obs), naive_dueling_q(net, obs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["dqn", "c51"])
def test_noisy_head_acts_with_noise_in_training_and_its_means_in_evaluation(name):
    """training mode: the current noise draw, a new one at reset_noise; evaluation mode (what evaluation and a
    saved model use): the mean weights, whatever the noise"""
    torch.manual_seed(2)
    net = SCRIPTS[name].QNetwork(4, dueling=True, noisy=True, noisy_sigma=0.5)
    assert isinstance(net.head, NoisyLinear) and isinstance(net.value, NoisyLinear)
    obs = (255 * torch.rand(2, 4, 84, 84)).to(torch.uint8)
    naive = naive_dueling_q if name == "dqn" else naive_dueling_c51
    output = (lambda x: net(x)) if name == "dqn" else net.log_distribution
    with torch.no_grad():
        first = output(obs).double().numpy()
        np.testing.assert_allclose(first, naive(net, obs), rtol=1e-5, atol=1e-5)
        reset_noise(net)
        assert not np.allclose(first, output(obs).double().numpy(), atol=1e-4)
        net.eval()
        evaluated = output(obs).double().numpy()
        np.testing.assert_allclose(evaluated, naive(net, obs), rtol=1e-5, atol=1e-5)
        reset_noise(net)
        np.testing.assert_array_equal(evaluated, output(obs).double().numpy())


# ---------------------------------------------------------------- 3. n-step targets


@pytest.mark.parametrize("name", ["dqn", "double_dqn"])
def test_n_step_target_matches_naive_loops(name):
    module = SCRIPTS[name]
    online, target = TinyQ(0), TinyQ(1)
    buffer, truth = filled(n_step=3)
    batch = buffer.sample(256)
    got = module.compute_td_target(online, target, batch, GAMMA, n_step=3)
    expected = naive_td_targets("dqn" if name == "dqn" else "double", online, target, batch, truth)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-5)
    steps = torch.round(torch.log(batch.discounts.clamp(min=1e-9)) / np.log(GAMMA))
    assert (batch.dones == 1).any() and (steps[batch.dones == 0] < 3).any() and (steps == 3).any()


@pytest.mark.parametrize("name", ["dqn", "double_dqn"])
def test_one_step_target_is_unchanged_and_equals_the_discounts_form(name):
    """at --n-step 1 the script computes CleanRL's r + gamma * max Q * (1 - done), bit for bit the same as
    the n-step form r + discounts * max Q over the same batch"""
    module = SCRIPTS[name]
    online, target = TinyQ(2), TinyQ(3)
    buffer, truth = filled(n_step=1)
    batch = buffer.sample(256)
    one_step = module.compute_td_target(online, target, batch, GAMMA)
    assert torch.equal(one_step, module.compute_td_target(online, target, batch, GAMMA, n_step=1))
    assert torch.equal(one_step, module.compute_td_target(online, target, batch, GAMMA, n_step=2))  # discounts
    expected = naive_td_targets("dqn" if name == "dqn" else "double", online, target, batch, truth)
    np.testing.assert_allclose(one_step.double().numpy(), expected, rtol=1e-5, atol=1e-5)


def check_n_step(module) -> bool:
    online, target = TinyQ(0), TinyQ(1)
    buffer, truth = filled(n_step=3, seed=4)
    batch = buffer.sample(128)
    got = module.compute_td_target(online, target, batch, GAMMA, n_step=3)
    return np.allclose(got.double().numpy(), naive_td_targets("dqn", online, target, batch, truth), atol=1e-5)


def test_c51_n_step_target_matches_naive_loops():
    c51 = SCRIPTS["c51"]
    torch.manual_seed(5)
    net = c51.QNetwork(4, 11, -1.0, 1.0)
    with torch.no_grad():
        net.head.weight.mul_(30.0)  # so that the greedy next action varies
    g = torch.Generator().manual_seed(6)
    steps, dones = torch.randint(1, 4, (16,), generator=g), torch.tensor([0.0, 0.0, 1.0, 0.0] * 4)
    data = SimpleNamespace(
        next_observations=(255 * torch.linspace(0.05, 1, 16).view(16, 1, 1, 1) * torch.rand(16, 4, 84, 84)).byte(),
        rewards=torch.randn(16, generator=g),
        dones=dones,
        discounts=torch.where(dones.bool(), 0.0, GAMMA ** steps.float()),
    )
    got = c51.compute_target_distribution(net, data, GAMMA, n_step=3)
    with torch.no_grad():
        probs = net.distribution(data.next_observations).double().tolist()
    support = net.atoms.double().tolist()
    chosen = []
    for rows in probs:
        expectations = [sum(p * z for p, z in zip(row, support, strict=True)) for row in rows]
        chosen.append(rows[max(range(4), key=lambda a, e=expectations: e[a])])
    expected = naive_projection(chosen, data.rewards.tolist(), data.discounts.tolist(), -1.0, 1.0)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)
    # at --n-step 1, the discounts a one-step buffer gives (gamma * (1 - done)) make the same target as before
    data.discounts = GAMMA * (1 - dones)
    torch.testing.assert_close(
        c51.compute_target_distribution(net, data, GAMMA, n_step=2), c51.compute_target_distribution(net, data, GAMMA)
    )


# ---------------------------------------------------------------- 4. prioritized: weighted losses, new priorities


@pytest.mark.parametrize("name", ["dqn", "double_dqn"])
def test_weighted_loss_and_new_priorities_match_naive_loops(name):
    """the script's loss is sum_i w_i (y_i - Q(s_i, a_i))^2 / B with w_i = (p_min / p_i) ** beta, and the
    new priority of each sampled transition (|y_i - Q(s_i, a_i)| + eps) ** alpha"""
    module = SCRIPTS[name]
    source = (ALGOS / f"{name}.py").read_text()
    assert source.count("rb.update_priorities(data.indices, td_errors)") == 1  # compute_loss's third output
    online, target = TinyQ(0), TinyQ(1)
    buffer, truth = filled(n_step=3, prioritized=True)
    live = np.flatnonzero(buffer.tree.get(np.arange(buffer.tree.size)) > 0)
    priorities = np.random.default_rng(0).exponential(size=len(live)) + 0.05
    buffer.tree.update(live, priorities)
    batch = buffer.sample(64, beta=0.6)
    # what the script does: its compute_loss, as its loop runs it
    args = SimpleNamespace(gamma=GAMMA, n_step=3, prioritized=True)
    loss, metrics, td_errors = module.compute_loss(online, target, batch, args)
    buffer.update_priorities(batch.indices, td_errors.detach())
    # naive
    targets = naive_td_targets("dqn" if name == "dqn" else "double", online, target, batch, truth)
    q = q_rows(online, batch.observations)
    p_min = min(priorities.tolist())
    p = dict(zip(live.tolist(), priorities.tolist(), strict=True))
    weights = [(p_min / p[int(i)]) ** 0.6 for i in batch.indices]
    errors = [targets[i] - q[i][batch.actions[i].item()] for i in range(64)]
    mean_q = sum(q[i][batch.actions[i].item()] for i in range(64)) / 64
    assert metrics["td_loss"] is loss and metrics["q_values"].item() == pytest.approx(mean_q, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(batch.weights.double().numpy(), weights, rtol=1e-5)
    assert loss.item() == pytest.approx(sum(w * e * e for w, e in zip(weights, errors, strict=True)) / 64, rel=1e-5)
    new = [(abs(e) + buffer.eps) ** buffer.alpha for e in errors]
    np.testing.assert_allclose(buffer.tree.get(batch.indices), new, rtol=1e-5)
    assert min(weights) < 0.5  # the weights matter here
    assert loss.item() != pytest.approx(sum(e * e for e in errors) / 64, rel=1e-3)


def check_weighted_loss(module) -> bool:
    g = torch.Generator().manual_seed(0)
    y, q, w = torch.randn(32, generator=g), torch.randn(32, generator=g), torch.rand(32, generator=g)
    naive = sum(float(wi) * (float(yi) - float(qi)) ** 2 for yi, qi, wi in zip(y, q, w, strict=True)) / 32
    return module.weighted_mse_loss(y, q, w).item() == pytest.approx(naive, rel=1e-5)


def test_c51_weighted_cross_entropy_and_priorities_match_naive_loops():
    c51 = SCRIPTS["c51"]
    source = (ALGOS / "c51.py").read_text()
    assert source.count("rb.update_priorities(data.indices, priorities)") == 1
    assert (
        source.count(
            'return loss, {"td_loss": loss, "q_values": old_val.mean()}, cross_entropies(target_probs, log_probs)'
        )
        == 1
    )
    g = torch.Generator().manual_seed(7)
    target = torch.softmax(3 * torch.randn(32, 11, generator=g), dim=1)
    log_probs = torch.log_softmax(torch.randn(32, 11, generator=g), dim=1)
    weights = torch.rand(32, generator=g)
    entropies = [
        -sum(float(t) * float(lp) for t, lp in zip(tr, lr, strict=True))
        for tr, lr in zip(target, log_probs, strict=True)
    ]
    np.testing.assert_allclose(c51.cross_entropies(target, log_probs).double().numpy(), entropies, rtol=1e-5)
    weighted = sum(float(w) * e for w, e in zip(weights, entropies, strict=True)) / 32
    assert c51.cross_entropy(target, log_probs, weights).item() == pytest.approx(weighted, rel=1e-5)
    assert c51.cross_entropy(target, log_probs).item() == pytest.approx(sum(entropies) / 32, rel=1e-5)


@pytest.mark.parametrize(
    "bug,original,planted,check",
    [
        (
            "one-step discount",
            "data.rewards + data.discounts * target_max",
            "data.rewards + gamma * target_max",
            check_n_step,
        ),
        (
            "unweighted loss",
            "(weights * (td_target - old_val) ** 2).mean()",
            "((td_target - old_val) ** 2).mean()",
            check_weighted_loss,
        ),
        ("dueling without the mean", " - advantage.mean(dim=1, keepdim=True)", "", check_dueling),
    ],
)
def test_the_naive_comparisons_catch_a_planted_bug(bug, original, planted, check, tmp_path):
    source = (ALGOS / "dqn.py").read_text()
    assert source.count(original) == 1
    broken_path = tmp_path / "broken_dqn.py"
    broken_path.write_text(source.replace(original, planted))
    assert check(SCRIPTS["dqn"]), f"{bug}: the right script fails its check"
    assert not check(load_algorithm(broken_path)), f"{bug} went unnoticed"


# ---------------------------------------------------------------- 5. all four flags learn; the saved model


# FAST_LEARNING with fewer updates (250): seeds 1 to 5 all reached the optimum, for dqn (also with 150 updates) and
# for c51. The 3-step return stops at the two-step episodes' end, so the cue's target is the reward that follows.
ALL_FLAGS = ["--n-step", "3", "--prioritized", "--dueling", "--noisy"]
STEPS = ["--total-timesteps", "1000", "--learning-starts", "500", "--train-frequency", "2", "--save-model"]


@pytest.fixture(scope="module", params=["dqn", "c51"])
def all_flags_run(request, tmp_path_factory) -> tuple[str, str, Path]:
    name = request.param
    tmp_path = tmp_path_factory.mktemp(f"{name}_all_flags")
    command = [str(ALGOS / f"{name}.py"), "--env-id", "tests.toy_envs:DelayedImage-v0", "--run-dir", str(tmp_path)]
    done = run_python(*command, *FAST_LEARNING, *STEPS, *ALL_FLAGS, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [run_dir] = tmp_path.iterdir()
    return name, done.stdout, run_dir


def test_every_flag_on_reaches_the_optimum_with_sane_values(all_flags_run):
    name, stdout, run_dir = all_flags_run
    [q_value] = [float(v) for v in re.findall(r"^TRAIN_METRICS .* q_values=(\S+)", stdout, re.M)]
    mean = json.loads((run_dir / "evaluations.json").read_text())[-1]["mean"]
    assert mean >= 0.95, f"{name} with {ALL_FLAGS} on DelayedImage-v0: evaluation mean {mean}, optimum 1, random 0.5"
    assert 0.0 < q_value < 1.3, f"{name}: mean Q {q_value}, true values lie in [0, 1]"
    receipt = json.loads((run_dir / "receipt.json").read_text())
    args = receipt["args"]
    assert (args["n_step"], args["prioritized"], args["dueling"], args["noisy"]) == (3, True, True, True)
    assert receipt["counts"]["gradient_updates"] == 250


def test_saved_dueling_noisy_model_reevaluates(all_flags_run):
    """evaluation rebuilds the dueling, noisy network from the saved settings and plays with its mean weights"""
    name, _, run_dir = all_flags_run
    model = run_dir / f"{name}.cleanrl_model"
    saved = torch.load(model, map_location="cpu", weights_only=True)
    assert {"dueling": True, "noisy": True, "noisy_sigma": 0.5}.items() <= saved["network_kwargs"].items()
    assert {"value.weight_mu", "value.weight_sigma", "head.weight_mu"} <= set(saved["state_dict"])
    done = run_python("-m", "cleanrl_utils.evaluation", str(model), "--episodes", "10", "--epsilon", "0", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["mean"] == 1.0, result  # the trained policy's optimum, as in the run's own evaluation


# ---------------------------------------------------------------- 6. bad input for the new flags


@pytest.mark.parametrize(
    "script,flags,words",
    [
        ("dqn", "--n-step 0", ["--n-step 0", "positive"]),
        ("double_dqn", "--prioritized-alpha -1", ["--prioritized-alpha -1.0", ">= 0"]),
        ("dqn", "--prioritized-beta 1.5", ["--prioritized-beta 1.5", "[0, 1]"]),
        ("c51", "--prioritized-eps 0", ["--prioritized-eps 0.0", "> 0"]),
        ("double_dqn", "--noisy-sigma nan", ["--noisy-sigma nan"]),
        ("c51", "--n-step 70 --buffer-size 64 --learning-starts 32", ["--n-step 70", "--buffer-size 64", "75"]),
    ],
)
def test_bad_flag_stops_early_with_a_message(script, flags, words, tmp_path):
    done = run_script(script, *flags.split(), timeout=120, tmp_path=tmp_path)
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir())
