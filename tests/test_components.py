"""The component flags, Rainbow's alone now: algos/rainbow.py has every part on by default and a flag to turn each
off, the paper's ablations (--n-step 1, --no-prioritized, --no-dueling, --no-noisy); dqn.py, double_dqn.py and
c51.py are their algorithm and nothing else, and dqn.py and double_dqn.py differ only in their target.

For Rainbow, with and without each part: the head (dueling or one layer, noisy or plain, in training and in
evaluation), the n-step target from a real buffer (n = 3 and n = 1) against the streams' own record, the
importance-weighted loss and the new priorities from a real prioritized buffer and the plain loss without them,
all against naive float64 loops, with planted bugs that the comparisons catch; each ablation flag run end to end
on a toy task and its saved model re-evaluated as a user would (bad flags: test_bad_input.py). No mocks.

The buffers' own n-step returns and priorities are tested in tests/test_buffer.py and tests/test_prioritized.py;
here, what the script computes from them."""

from __future__ import annotations

import difflib
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import FAST_LEARNING, REPO, run_python
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_buffer import FRAME, STACK, RandomStreams, fill, naive_n_step
from test_rainbow import naive_cross_entropies, naive_dueling_log_probs, naive_projection
from test_scripts import scheduled_epsilon
from torch import nn

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.tools.evaluate import load_algorithm

ALGOS = REPO / "algos"
PLAIN = {name: load_algorithm(ALGOS / f"{name}.py") for name in ("dqn", "double_dqn", "c51")}
rainbow = load_algorithm(ALGOS / "rainbow.py")
NoisyLinear, PrioritizedReplayBuffer, reset_noise = (
    rainbow.NoisyLinear,
    rainbow.PrioritizedReplayBuffer,
    rainbow.reset_noise,
)
GAMMA, V_MIN, V_MAX, N_ATOMS, N_ACTIONS = 0.9, -3.0, 3.0, 13, 6
COMPONENT_FLAGS = ("n_step", "prioritized", "prioritized_alpha", "prioritized_beta", "prioritized_beta_end")
COMPONENT_FLAGS += ("prioritized_eps",)
COMPONENT_FLAGS += ("dueling", "noisy", "noisy_sigma")


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


def naive_log_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    log_z = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - log_z for x in logits]


def naive_log_probs(net, obs: torch.Tensor) -> list[list[list[float]]]:
    """Rainbow's head from the encoder's features: per atom v + A - mean_a' A (dueling) or the advantage
    layer's output itself (--no-dueling), then a log-softmax over the atoms; (batch, n_actions, n_atoms)"""
    with torch.no_grad():
        features = net.encoder(obs).double().tolist()
    n_actions, n_atoms = net.n_actions, net.n_atoms
    advantage = [
        [row[a * n_atoms : (a + 1) * n_atoms] for a in range(n_actions)]
        for row in naive_linear(net.advantage, features)
    ]
    if net.value is not None:
        return naive_dueling_log_probs(naive_linear(net.value, features), advantage)
    return [[naive_log_softmax(logits) for logits in rows] for rows in advantage]


def naive_expectations(log_probs: list[list[float]], support: list[float]) -> list[float]:
    return [sum(math.exp(lp) * z for lp, z in zip(row, support, strict=True)) for row in log_probs]


class TinyEncoder(nn.Module):
    """stands in for the Nature encoder on the buffer tests' small frames: a uint8 stack -> 512 features"""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(STACK * FRAME[0] * FRAME[1], 512)

    def forward(self, x):
        return torch.relu(self.linear(x.float().flatten(1) / 255.0))


def network(seed: int, tiny: bool = False, **flags) -> nn.Module:
    """Rainbow's own QNetwork (with the flags' parts), sharpened so that the actions' expected returns differ;
    ``tiny``: on the buffer tests' small frames"""
    torch.manual_seed(seed)
    net = rainbow.QNetwork(N_ACTIONS, N_ATOMS, V_MIN, V_MAX, **flags)
    if tiny:
        net.encoder = TinyEncoder()
    with torch.no_grad():
        for layer in (net.value, net.advantage):
            if layer is not None:
                (layer.weight_mu if isinstance(layer, NoisyLinear) else layer.weight).mul_(30.0)
    return net


def frames(batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    brightness = torch.linspace(0.05, 1.0, batch).view(batch, 1, 1, 1)
    return (255 * brightness * torch.rand(batch, 4, 84, 84, generator=g)).to(torch.uint8)


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


def naive_targets(online, target, batch, truth) -> list[list[float]]:
    """Double, from the streams' own record: the n-step return R, the state n steps later s' (fewer at an episode
    end), gamma^k, and no bootstrap after a terminal; a* = argmax of the online network's expectations at s', the
    target network's distribution there projected; the networks' outputs from the naive head, the rest loops"""
    support = [V_MIN + i * (V_MAX - V_MIN) / (N_ATOMS - 1) for i in range(N_ATOMS)]
    records = [
        truth[batch.observations[i].numpy().tobytes() + bytes([batch.actions[i].item()])]
        for i in range(len(batch.actions))
    ]
    next_states = torch.from_numpy(
        np.stack([np.frombuffer(next_obs, dtype=np.uint8).reshape(STACK, *FRAME) for _, next_obs, _, _ in records])
    )
    online_rows, target_rows = naive_log_probs(online, next_states), naive_log_probs(target, next_states)
    chosen = []
    for online_row, target_row in zip(online_rows, target_rows, strict=True):
        expectations = naive_expectations(online_row, support)
        best = max(range(N_ACTIONS), key=lambda a, e=expectations: e[a])
        chosen.append([math.exp(lp) for lp in target_row[best]])
    rewards = [ret for ret, _, _, _ in records]
    discounts = [0.0 if done else discount for _, _, done, discount in records]
    return naive_projection(chosen, rewards, discounts, V_MIN, V_MAX)


def naive_taken_log_probs(net, batch) -> list[list[float]]:
    rows = naive_log_probs(net, batch.observations)
    return [rows[i][batch.actions[i].item()] for i in range(len(batch.actions))]


# ---------------------------------------------------------------- 1. the three plain scripts; Rainbow's defaults


@pytest.mark.parametrize("name", PLAIN)
def test_plain_scripts_carry_no_component_flags_and_keep_their_network(name):
    module = PLAIN[name]
    assert not set(COMPONENT_FLAGS) & set(vars(module.Args())), f"{name}.py still has Rainbow's flags"
    keys = set(module.QNetwork(4).state_dict())  # the same state dict as ever: old models load
    assert {k for k in keys if not k.startswith("encoder.")} == {"head.weight", "head.bias"} | (
        {"atoms"} if name == "c51" else set()
    )
    assert type(module.QNetwork(4).head) is nn.Linear
    for gone in ("dueling_q_values", "weighted_mse_loss", "beta_schedule", "dueling_logits"):
        assert not hasattr(module, gone), f"{name}.py still has {gone}"


@pytest.mark.parametrize("name", ["dqn", "c51"])
def test_a_model_saved_with_settings_the_script_lacks_is_refused(name, tmp_path):
    """no compatibility code: a model saved when the script had network settings it no longer has (dqn.py's
    --dueling, before it moved to rainbow.py) is refused with what to do, without a traceback; one whose settings
    fit but whose weights do not says which weights"""
    module = PLAIN[name]
    torch.manual_seed(0)
    settings = {"n_atoms": 51, "v_min": -10.0, "v_max": 10.0} if name == "c51" else {}
    saved = {"state_dict": module.QNetwork(2).state_dict(), "algo": name, "algo_script": str(ALGOS / f"{name}.py"),
             "env_id": "tests.toy_envs:ImageBandit-v0", "n_actions": 2, "network_kwargs": settings, "forced_steps": True}  # fmt: skip
    torch.save(saved, tmp_path / "fits.cleanrl_model")
    done = run_python(
        "-m", "cleanrl_utils.tools.evaluate", str(tmp_path / "fits.cleanrl_model"), "--episodes", "2", "--json"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads(done.stdout)["episodic_returns"]) == 2
    older = saved | {"network_kwargs": settings | {"dueling": False, "noisy": False}}
    torch.save(older, tmp_path / "older.cleanrl_model")
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(tmp_path / "older.cleanrl_model"), "--episodes", "1")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "network settings" in done.stderr and "(dueling, noisy)" in done.stderr, done.stderr
    wrong = saved | {"state_dict": saved["state_dict"] | {"value.weight": torch.zeros(1, 512)}}
    torch.save(wrong, tmp_path / "wrong.cleanrl_model")
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(tmp_path / "wrong.cleanrl_model"), "--episodes", "1")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"does not fit algos/{name}.py's network" in done.stderr and "value.weight" in done.stderr, done.stderr


def test_double_dqn_differs_from_dqn_only_in_its_target():
    """`diff algos/dqn.py algos/double_dqn.py` shows what Double DQN changes, and nothing else"""
    dqn, double = ((ALGOS / f"{name}.py").read_text().splitlines() for name in ("dqn", "double_dqn"))
    start = dqn.index(next(line for line in dqn if line.startswith("def compute_td_target")))
    end = next(i for i in range(start + 1, len(dqn)) if dqn[i].startswith("def "))
    changes = 0
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, dqn, double, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        changes += 1
        header = i2 <= 1
        target = start <= i1 and i2 < end
        assert header or target, f"dqn.py and double_dqn.py differ at lines {i1 + 1}-{i2}: {dqn[i1:i2]}"
    assert changes >= 2  # the header and the target


def test_rainbow_has_every_part_on_by_default_and_its_network_unchanged():
    args = rainbow.Args()
    assert (args.n_step, args.prioritized, args.dueling, args.noisy) == (3, True, True, True)
    net = rainbow.QNetwork(4)  # the state dict of the models saved before the flags: they still load
    keys = {k for k in net.state_dict() if not k.startswith("encoder.")}
    layers = {
        f"{name}.{p}_{kind}" for name in ("value", "advantage") for p in ("weight", "bias") for kind in ("mu", "sigma")
    }
    assert keys == layers | {"atoms"}
    plain = rainbow.QNetwork(4, dueling=False, noisy=False)
    assert plain.value is None and type(plain.advantage) is nn.Linear
    assert {k for k in plain.state_dict() if not k.startswith("encoder.")} == {
        "advantage.weight",
        "advantage.bias",
        "atoms",
    }


# ---------------------------------------------------------------- 2. the head with and without each part


HEADS = [
    pytest.param({}, id="dueling+noisy"),
    pytest.param({"dueling": False}, id="no-dueling"),
    pytest.param({"noisy": False}, id="no-noisy"),
    pytest.param({"dueling": False, "noisy": False}, id="neither"),
]


@pytest.mark.parametrize("flags", HEADS)
def test_head_matches_naive_loops_in_training_and_evaluation(flags):
    """training mode: the current noise draw, a new one at reset_noise; evaluation mode (what evaluation and a
    saved model use): the mean weights. Without noisy layers both modes give the same, and reset_noise nothing."""
    net = network(2, **flags)
    noisy = flags.get("noisy", True)
    assert all(isinstance(layer, NoisyLinear) == noisy for layer in (net.value, net.advantage) if layer is not None)
    obs = frames(3, 1)
    with torch.no_grad():
        first = net.log_distribution(obs).double().numpy()
        np.testing.assert_allclose(first, naive_log_probs(net, obs), rtol=1e-5, atol=1e-5)
        reset_noise(net)
        redrawn = net.log_distribution(obs).double().numpy()
        assert np.allclose(first, redrawn, atol=1e-4) == (not noisy)
        net.eval()
        evaluated = net.log_distribution(obs).double().numpy()
        np.testing.assert_allclose(evaluated, naive_log_probs(net, obs), rtol=1e-5, atol=1e-5)
        reset_noise(net)
        np.testing.assert_array_equal(evaluated, net.log_distribution(obs).double().numpy())
        if not noisy:
            np.testing.assert_array_equal(evaluated, first)
        q = net(obs).double().numpy()
    support = net.atoms.double().tolist()
    np.testing.assert_allclose(q, [naive_expectations(rows, support) for rows in evaluated], rtol=1e-5, atol=1e-5)
    if flags.get("dueling", True):  # the value stream counts
        with torch.no_grad():
            plain = torch.log_softmax(net.advantage(net.encoder(obs)).view(3, N_ACTIONS, N_ATOMS), dim=2)
        assert not np.allclose(evaluated, plain.double().numpy(), atol=1e-3)


# ---------------------------------------------------------------- 3. the n-step target from a real buffer


@pytest.mark.parametrize("n_step", [3, 1])
@pytest.mark.parametrize("prioritized", [True, False])
def test_n_step_target_from_a_real_buffer_matches_naive_loops(n_step, prioritized):
    online, target = network(4, tiny=True), network(0, tiny=True)
    buffer, truth = filled(n_step, prioritized)
    batch = buffer.sample(64, 0.5) if prioritized else buffer.sample(64)
    got = rainbow.compute_target_distribution(online, target, batch)
    np.testing.assert_allclose(got.double().numpy(), naive_targets(online, target, batch, truth), rtol=1e-5, atol=1e-6)
    steps = torch.round(torch.log(batch.discounts.clamp(min=1e-9)) / np.log(GAMMA))
    assert (batch.dones == 1).any() and (steps[batch.dones == 0] == n_step).any()
    if n_step > 1:  # some returns stopped early at an episode end (truncation), and still bootstrap
        assert (steps[batch.dones == 0] < n_step).any()
    else:  # one step: the buffer's discounts are c51's gamma * (1 - done), bit for bit
        assert torch.equal(batch.discounts, GAMMA * (1 - batch.dones))


def check_n_step(module) -> bool:
    online, target = network(4, tiny=True), network(0, tiny=True)
    buffer, truth = filled(3, seed=4)
    batch = buffer.sample(64)
    got = module.compute_target_distribution(online, target, batch)
    return np.allclose(got.double().numpy(), naive_targets(online, target, batch, truth), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- 4. prioritized: weighted loss, new priorities


def prioritized_batch(seed: int = 0):
    """a real prioritized buffer with planted, uneven priorities, a batch drawn with beta 0.6, its truth"""
    buffer, truth = filled(3, prioritized=True, seed=seed)
    live = np.flatnonzero(buffer.tree.get(np.arange(buffer.tree.size)) > 0)
    priorities = np.random.default_rng(seed).exponential(size=len(live)) + 0.05
    buffer.tree.update(live, priorities)
    batch = buffer.sample(64, beta=0.6)
    p = dict(zip(live.tolist(), priorities.tolist(), strict=True))
    weights = [(min(priorities.tolist()) / p[int(i)]) ** 0.6 for i in batch.indices]
    return buffer, batch, truth, weights


def test_weighted_loss_and_new_priorities_match_naive_loops():
    """the loss is sum_i w_i CE_i / B with w_i = (p_min / p_i) ** beta and CE_i the cross-entropy of the projected
    target and the online distribution at the taken action; each sampled transition's new priority is
    (CE_i + eps) ** alpha; td_loss is the unweighted mean, q_values the mean expected return"""
    source = (ALGOS / "rainbow.py").read_text()
    assert source.count("rb.update_priorities(data.indices, priorities)") == 1  # compute_loss's third output
    online, target = network(4, tiny=True), network(0, tiny=True)
    buffer, batch, truth, weights = prioritized_batch()
    loss, metrics, priorities = rainbow.compute_loss(online, target, batch, SimpleNamespace(prioritized=True))
    buffer.update_priorities(batch.indices, priorities)
    log_probs = naive_taken_log_probs(online, batch)
    entropies = naive_cross_entropies(naive_targets(online, target, batch, truth), log_probs)
    support = online.atoms.double().tolist()
    np.testing.assert_allclose(batch.weights.double().numpy(), weights, rtol=1e-5)
    assert loss.item() == pytest.approx(sum(w * e for w, e in zip(weights, entropies, strict=True)) / 64, rel=1e-5)
    assert metrics["td_loss"].item() == pytest.approx(sum(entropies) / 64, rel=1e-5)
    assert metrics["q_values"].item() == pytest.approx(sum(naive_expectations(log_probs, support)) / 64, rel=1e-5)
    new = [(e + buffer.eps) ** buffer.alpha for e in entropies]
    np.testing.assert_allclose(buffer.tree.get(batch.indices), new, rtol=1e-5)
    assert min(weights) < 0.5  # the weights matter here
    assert loss.item() != pytest.approx(sum(entropies) / 64, rel=1e-3)


def test_without_prioritized_the_loss_is_the_plain_mean_of_a_uniform_batch():
    """--no-prioritized: a plain n-step buffer (no weights, no indices), the loss the cross-entropies' mean"""
    online, target = network(4, tiny=True), network(0, tiny=True)
    buffer, truth = filled(3)
    batch = buffer.sample(64)
    assert not hasattr(batch, "weights")
    loss, metrics, _ = rainbow.compute_loss(online, target, batch, SimpleNamespace(prioritized=False))
    entropies = naive_cross_entropies(naive_targets(online, target, batch, truth), naive_taken_log_probs(online, batch))
    assert loss.item() == pytest.approx(sum(entropies) / 64, rel=1e-5)
    assert metrics["td_loss"].item() == pytest.approx(loss.item(), rel=1e-6)


def check_weighted_loss(module) -> bool:
    online, target = network(4, tiny=True), network(0, tiny=True)
    _, batch, truth, weights = prioritized_batch(seed=2)
    loss, _, _ = module.compute_loss(online, target, batch, SimpleNamespace(prioritized=True))
    entropies = naive_cross_entropies(naive_targets(online, target, batch, truth), naive_taken_log_probs(online, batch))
    return loss.item() == pytest.approx(sum(w * e for w, e in zip(weights, entropies, strict=True)) / 64, rel=1e-5)


def check_plain_layers(module) -> bool:
    """--no-noisy gives plain layers, whose output a new noise draw leaves alone"""
    torch.manual_seed(0)
    net = module.QNetwork(3, 5, -1.0, 1.0, noisy=False)
    obs = frames(2, 3)
    with torch.no_grad():
        before = net(obs)
        module.reset_noise(net)
        return torch.equal(before, net(obs))


def check_plain_head(module) -> bool:
    """--no-dueling gives one layer's logits, log-softmaxed over the atoms"""
    torch.manual_seed(0)
    net = module.QNetwork(3, 5, -1.0, 1.0, dueling=False, noisy=False)
    obs = frames(2, 3)
    with torch.no_grad():
        got = net.log_distribution(obs).double().numpy()
        features = net.encoder(obs).double().tolist()
    logits = [[row[a * 5 : (a + 1) * 5] for a in range(3)] for row in naive_linear(net.advantage, features)]
    return np.allclose(got, [[naive_log_softmax(x) for x in rows] for rows in logits], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bug,original,planted,check",
    [
        ("one-step discount", "data.rewards, data.discounts, target_network.atoms", "data.rewards, 0.9 * (1 - data.dones), target_network.atoms", check_n_step),
        ("unweighted loss", "(data.weights * losses).mean() if", "losses.mean() if", check_weighted_loss),
        ("noisy whatever the flag", "partial(NoisyLinear, sigma_0=noisy_sigma) if noisy else nn.Linear", "partial(NoisyLinear, sigma_0=noisy_sigma)", check_plain_layers),
        ("dueling whatever the flag", "linear(512, n_atoms) if dueling else None", "linear(512, n_atoms)", check_plain_head),
    ],
)  # fmt: skip
def test_the_naive_comparisons_catch_a_planted_bug(bug, original, planted, check, tmp_path):
    source = (ALGOS / "rainbow.py").read_text()
    assert source.count(original) == 1
    broken_path = tmp_path / "broken_rainbow.py"
    broken_path.write_text(source.replace(original, planted))
    assert check(rainbow), f"{bug}: the right script fails its check"
    assert not check(load_algorithm(broken_path)), f"{bug} went unnoticed"


# ---------------------------------------------------------------- 5. each ablation end to end; the saved model

# FAST_LEARNING with fewer updates (250) on the contextual bandit; one part off at a time. --no-noisy explores
# epsilon-greedy, 1 -> 0.01 over the first half of the run (FAST_LEARNING's --exploration-fraction 0.5).
ABLATIONS = {"n-step-1": ["--n-step", "1"], "no-prioritized": ["--no-prioritized"], "no-dueling": ["--no-dueling"],
             "no-noisy": ["--no-noisy"]}  # fmt: skip
STEPS = ["--total-timesteps", "1000", "--learning-starts", "500", "--train-frequency", "2", "--save-model"]


# n-step-1 and no-dueling are slow (about 25 s each): their maths stays in CI through the naive-loop tests above
# (the 1-step target from a real buffer, the plain head); CI runs the two ablations that change how it explores
# and samples end to end
ABLATION_PARAMS = [pytest.param(name, marks=pytest.mark.slow) if name in ("n-step-1", "no-dueling") else name
                   for name in ABLATIONS]  # fmt: skip


@pytest.fixture(scope="session", params=ABLATION_PARAMS)  # made once (tests/conftest.py's _shared_run_group)
def ablation_run(request, tmp_path_factory) -> tuple[str, str, Path]:
    name = request.param
    tmp_path = tmp_path_factory.mktemp(f"rainbow_{name}")
    command = [str(ALGOS / "rainbow.py"), "--env-id", "tests.toy_envs:ImageBandit-v0", "--run-dir", str(tmp_path)]
    done = run_python(*command, *FAST_LEARNING, *STEPS, *ABLATIONS[name], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [run_dir] = tmp_path.iterdir()
    return name, done.stdout, run_dir


def test_each_ablation_runs_end_to_end_and_learns(ablation_run):
    name, stdout, run_dir = ablation_run
    receipt = json.loads((run_dir / "receipt.json").read_text())
    args = receipt["args"]
    expected = {"n-step-1": (1, True, True, True), "no-prioritized": (3, False, True, True),
                "no-dueling": (3, True, False, True), "no-noisy": (3, True, True, False)}[name]  # fmt: skip
    assert (args["n_step"], args["prioritized"], args["dueling"], args["noisy"]) == expected
    assert receipt["status"] == "finished" and receipt["counts"]["gradient_updates"] == 250
    [line] = re.findall(r"^TRAIN_METRICS .*$", stdout, re.M)
    keys = re.findall(r" (\w+)=", line)
    assert keys == ["step", "td_loss", "q_values"] + ["beta"] * args["prioritized"] + ["noisy_sigma"] * args["noisy"]
    q_value = float(re.search(r" q_values=(\S+)", line).group(1))
    assert 0.0 < q_value < 1.3, f"rainbow --{name}: mean Q {q_value}, true values lie in [0, 1]"
    mean = json.loads((run_dir / "evaluations.json").read_text())[-1]["mean"]
    assert mean >= 0.95, f"rainbow --{name} on ImageBandit-v0: evaluation mean {mean}, optimum 1, random 0.5"
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    logged = sorted((e.step, e.value) for e in events.Scalars("charts/epsilon"))
    epsilons = [value for _, value in logged]
    assert [step for step, _ in logged] == list(range(100, 1001, 100))  # one game: each multiple of 100
    if name == "no-noisy":  # epsilon-greedy explores instead: DQN's schedule from 1 to 0.01
        assert (args["start_e"], args["end_e"]) == (1.0, 0.01)
        # its closed form over the first 500 steps, at the step each action was chosen (one before the logged one)
        expected = [scheduled_epsilon(1.0, 0.01, 500, step - 1) for step, _ in logged]
        assert epsilons == pytest.approx(expected, rel=1e-6, abs=1e-7)
        assert sum(0.01 < e < 1.0 for e in expected) == 5  # on the slope, and after it
    else:  # the noisy layers explore
        assert (args["start_e"], args["end_e"]) == (0.0, 0.0) and set(epsilons) == {0.0}


def test_each_ablation_saved_model_reevaluates(ablation_run):
    """evaluation rebuilds the network from the saved settings (which parts it has) and plays with its means"""
    name, _, run_dir = ablation_run
    model = run_dir / "rainbow.cleanrl_model"
    saved = torch.load(model, map_location="cpu", weights_only=True)
    kwargs = saved["network_kwargs"]
    assert (kwargs["dueling"], kwargs["noisy"]) == (name != "no-dueling", name != "no-noisy")
    keys = set(saved["state_dict"])
    assert ("value.weight_mu" in keys or "value.weight" in keys) == kwargs["dueling"]
    assert any(k.endswith("_sigma") for k in keys) == kwargs["noisy"]
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(model), "--episodes", "10", "--epsilon", "0", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["mean"] == 1.0  # the trained policy's optimum, as in the run's own evaluation
