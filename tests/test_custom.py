"""The custom-algorithm template (algos/custom_value_atari.py) and its rules (cleanrl_utils/tools/template_rules.py).

The template as shipped is algos/dqn.py to the number and learns a toy task; the QR-DQN example of
docs/custom_algorithms.md (read from the page) matches a naive float64 loop and learns too; each rule
is broken once and refused at start-up with its message; the launchers take the template and copies
of it; the results table reports a custom algorithm on tuning and held-out games. No mocks.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import FAST_LEARNING, REPO, run_python, weights

from cleanrl_utils.buffer import ReplayBatch
from cleanrl_utils.encoder import NATURE_CNN_PARAMETERS, NatureCNN, check_encoder
from cleanrl_utils.run import Run
from cleanrl_utils.tools import benchmark, results
from cleanrl_utils.tools.evaluate import load_algorithm
from cleanrl_utils.tools.template_rules import (
    REFERENCE_HEADS,
    TemplateRuleError,
    check_actions,
    check_metrics,
    check_network,
    largest_reference_head,
    parameter_budget,
    reference_heads,
    trainable_parameters,
)

TEMPLATE = REPO / "algos" / "custom_value_atari.py"
DOC = REPO / "docs" / "custom_algorithms.md"
BLOCK_START = "class QNetwork(nn.Module):"
BLOCK_END = "# ==================================== end of EDITABLE"
BANDIT = "tests.toy_envs:ImageBandit-v0"
# start-up checks and tiny complete runs: a few dozen updates of a batch of 8
TINY = ["--total-timesteps", "60", "--learning-starts", "32", "--batch-size", "8", "--buffer-size", "64"]
TINY += ["--train-frequency", "1", "--eval-episodes", "1", "--eval-every", "0", "--device", "cpu"]


def template_with(tmp_path: Path, name: str, block: str | None = None, **replacements: str) -> Path:
    """A copy of the template named ``name``.py whose editable block is ``block`` (default: the shipped
    one) with each ``old=new`` text replacement applied (each ``old`` must occur in the block)."""
    source = TEMPLATE.read_text()
    start, end = source.index(BLOCK_START), source.index(BLOCK_END)
    code = source[start:end] if block is None else block.strip() + "\n\n\n"
    for old, new in replacements.values():
        assert old in code, old
        code = code.replace(old, new)
    path = tmp_path / f"{name}.py"
    path.write_text(source[:start] + code + source[end:])
    return path


@pytest.fixture
def cpu_run():
    """``cpu_run(**flags)``: the run a ValueAlgorithm takes, made as the template makes it (``Run(args, __file__,
    check_args)`` with the template's Args, --device cpu, one torch thread), for an algorithm built outside a
    script: its ``device``, ``fast`` and ``fused`` are the real ones. No run folder appears before ``own``; the
    SIGINT/SIGTERM handlers and torch's thread count the run sets are put back afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    threads = torch.get_num_threads()
    template = load_algorithm(TEMPLATE)

    def make(**flags) -> Run:
        args = template.Args(device="cpu", torch_threads=1, **flags)
        return Run(args, str(TEMPLATE), template.check_args)

    yield make
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    torch.set_num_threads(threads)


def doc_example() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- example: qr-dqn .*?-->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/custom_algorithms.md lost its QR-DQN example block"
    return match.group(1)


def start(script: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    return run_python(str(script), "--env-id", BANDIT, "--run-dir", str(tmp_path / "runs"), *TINY, *flags)


def learn(script: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[dict], Path]:
    """tests/test_learning.py's fast-learning flags on ImageBandit, leaner: 1000 steps (one TRAIN_METRICS
    line) and 200 updates of 16 (both algorithms reach 1.0 from seeds 1, 2 and 3 so)."""
    command = [str(script), "--env-id", BANDIT, "--total-timesteps", "1000", "--run-dir", str(tmp_path)]
    lean = ["--batch-size", "16", "--train-frequency", "4"]  # later flags win
    done = run_python(*command, *FAST_LEARNING, *lean, "--save-model", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [run_dir] = tmp_path.iterdir()
    return done, json.loads((run_dir / "evaluations.json").read_text()), run_dir


def parse_standard_output(stdout: str) -> dict:
    """The lines sweeps rely on (DESIGN.md), parsed strictly."""
    metrics = []
    for line in stdout.splitlines():
        if line.startswith("TRAIN_METRICS"):
            match = re.fullmatch(r"TRAIN_METRICS step=(\d+)((?: [a-z_][a-z0-9_]*=\S+)+)", line)
            assert match, line
            fields = dict(f.split("=") for f in match.group(2).split())
            assert list(fields)[:2] == ["td_loss", "q_values"], line
            metrics.append({"step": int(match.group(1)), **{k: float(v) for k, v in fields.items()}})
    evals = [float(v) for v in re.findall(r"^Eval episodic_return: (\S+)$", stdout, re.M)]
    [final] = [float(v) for v in re.findall(r"^Final eval return: (\S+)$", stdout, re.M)]
    episodes = re.findall(r"^global_step=(\d+), episodic_return=(\S+)$", stdout, re.M)
    return {"metrics": metrics, "evals": evals, "final": final, "episodes": episodes}


# ---------------------------------------------------------------- 1. the template as shipped


def test_shipped_template_learns_prints_the_standard_lines_and_its_model_reloads(tmp_path):
    done, evaluations, run_dir = learn(TEMPLATE, tmp_path)
    out = parse_standard_output(done.stdout)
    assert out["final"] == evaluations[-1]["mean"] >= 0.95, "the template's DQN did not learn ImageBandit"
    assert out["evals"] == [e["mean"] for e in evaluations]
    assert [m["step"] for m in out["metrics"]] == [1000]
    assert 0.0 < out["metrics"][-1]["q_values"] < 1.3 and out["metrics"][-1]["td_loss"] >= 0
    assert len(out["episodes"]) > 400
    # the budget is printed; the frozen target network does not count against it
    assert "parameter budget: 1,981,090 trainable parameters" in done.stdout  # IQN's head, for 2 actions
    assert "ValueAlgorithm trains 1,685,154 parameters (q_network 1,685,154)" in done.stdout
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["status"] == "finished" and receipt["algo"] == "custom_value_atari"
    # the saved model is rebuilt by the evaluation command, as every script's: QNetwork(n_actions)
    [model] = run_dir.glob("*.cleanrl_model")
    again = run_python("-m", "cleanrl_utils.tools.evaluate", str(model), "--episodes", "4", "--epsilon", "0")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Eval episodic_return: 1.0" in again.stdout


def test_shipped_template_reproduces_dqn_to_the_bit(tmp_path):
    """Same seed and flags, the fast update on in both: the same games, losses, evaluations and final weights as
    algos/dqn.py, bit for bit, so the harness (the start-up checks, the loop's calls of the algorithm) changes
    nothing of the reference's protocol or random streams. 3 games, --train-frequency 8 and target syncs every 100
    steps: the target sync falls between updates, where it comes from the loop and not from an update."""
    flags = ["--env-id", BANDIT, "--total-timesteps", "1200", "--learning-starts", "100", "--train-frequency", "8"]
    flags += ["--num-envs", "3", "--target-network-frequency", "100", "--batch-size", "8", "--buffer-size", "2000"]
    flags += ["--eval-every", "600", "--eval-episodes", "2", "--save-model", "--device", "cpu"]
    flags += ["--torch-threads", "1"]  # a fixed thread count: the same sums in both
    outputs, models = [], []
    for script in (TEMPLATE, REPO / "algos" / "dqn.py"):
        done = run_python(str(script), *flags, "--run-dir", str(tmp_path / script.stem), timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        kept = r"^(global_step=|TRAIN_METRICS |Eval episodic_return|Final eval return)"
        outputs.append([line for line in done.stdout.splitlines() if re.match(kept, line)])
        models.append(weights(next((tmp_path / script.stem).iterdir())))
    assert len(outputs[0]) > 500 and any(line.startswith("TRAIN_METRICS") for line in outputs[0])
    assert outputs[0] == outputs[1]
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][name], models[1][name]) for name in models[0]), "the weights differ"


# ---------------------------------------------------------------- 2. the QR-DQN example of the docs


def naive_quantile_huber(quantiles: np.ndarray, targets: np.ndarray, kappa: float) -> float:
    """One (online quantile i, target quantile j) pair at a time, in float64: the Huber loss weighted by
    tau_i where the target lies above the quantile and 1 - tau_i below; sum over i, mean over j, batch."""
    total = 0.0
    for theta, target in zip(quantiles.astype(np.float64), targets.astype(np.float64), strict=True):
        n = len(theta)
        for i in range(n):
            tau = (2 * i + 1) / (2 * n)
            for t in target:
                u = t - theta[i]
                huber = 0.5 * u * u if abs(u) <= kappa else kappa * (abs(u) - 0.5 * kappa)
                total += (1.0 - tau if u < 0 else tau) * huber / len(target)
    return total / len(quantiles)


def test_doc_qr_example_loss_matches_a_naive_loop(tmp_path, cpu_run):
    module = load_algorithm(template_with(tmp_path, "doc_qrdqn", doc_example()))
    run = cpu_run(learning_rate=1e-3, batch_size=2, seed=0, gamma=0.9, fast=False)
    args = run.args
    envs = SimpleNamespace(n_actions=3)  # what ValueAlgorithm reads of the environments
    torch.manual_seed(0)
    algorithm = module.ValueAlgorithm(envs, run, args)
    with torch.no_grad():  # spread the quantiles so that some pairs fall beyond kappa
        algorithm.q_network.head.weight.mul_(200.0)
        algorithm.target_network.head.weight.copy_(algorithm.q_network.head.weight.roll(1, 0))
    g = torch.Generator().manual_seed(1)
    obs = torch.randint(0, 256, (2, 4, 84, 84), dtype=torch.uint8, generator=g)
    data = ReplayBatch(
        observations=obs,
        actions=torch.tensor([2, 0]),
        rewards=torch.tensor([1.0, -1.0]),
        next_observations=obs.flip(0),
        dones=torch.tensor([0.0, 1.0]),
        discounts=torch.tensor([0.9, 0.0]),
    )
    with torch.no_grad():
        online = algorithm.q_network.quantiles(obs).numpy()[[0, 1], [2, 0]].astype(np.float64)
        following = algorithm.target_network.quantiles(obs.flip(0)).numpy().astype(np.float64)
    targets = []
    for b in range(2):
        best = int(np.argmax(following[b].mean(axis=1)))
        bootstrap = 0.0 if data.dones[b] else args.gamma
        targets.append(float(data.rewards[b]) + bootstrap * following[b, best])
    targets = np.array(targets)
    spread = np.abs(targets[:, None, :] - online[:, :, None])
    assert (spread > 1).any() and (spread < 1).any(), "the batch must exercise both branches of the Huber loss"
    metrics = check_metrics(algorithm.update(data, global_step=1), global_step=1)
    assert metrics["td_loss"] == pytest.approx(naive_quantile_huber(online, targets, 1.0), rel=1e-5)
    assert metrics["q_values"] == pytest.approx(online.mean(), rel=1e-5)
    naive_crossing = np.mean([row[i + 1] < row[i] for row in online for i in range(len(row) - 1)])
    assert metrics["crossing_rate"] == pytest.approx(naive_crossing)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_doc_example_and_template_are_ruff_clean(tmp_path):
    """A user's copy with the docs' block passes the project's lint and format as algos/*.py does."""
    script = template_with(tmp_path, "doc_qrdqn", doc_example())
    config = ["--config", str(REPO / "pyproject.toml")]
    for command in (["check"], ["format", "--check"]):
        done = subprocess.run(["ruff", *command, *config, str(script), str(TEMPLATE)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_doc_qr_example_plugs_in_and_learns(tmp_path):
    script = template_with(tmp_path, "doc_qrdqn", doc_example())
    runs = tmp_path / "runs"
    runs.mkdir()
    done, evaluations, _ = learn(script, runs)
    out = parse_standard_output(done.stdout)
    assert evaluations[-1]["mean"] >= 0.95, "the docs' QR-DQN did not learn ImageBandit"
    [metrics] = out["metrics"]
    assert 0.0 < metrics["q_values"] < 1.3 and 0.0 <= metrics["crossing_rate"] <= 1.0
    assert "ValueAlgorithm trains 1,889,328 parameters (q_network 1,889,328), 95.4% of the budget" in done.stdout


# ---------------------------------------------------------------- 3. each rule broken once, refused at start-up


def refused(done: subprocess.CompletedProcess, tmp_path: Path, *messages: str) -> None:
    assert done.returncode == 1, done.stdout[-1000:] + done.stderr[-2000:]  # sys.exit("error: ...")
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("error: ") == 1, done.stderr[-2000:]
    for message in messages:
        assert message in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "runs").exists(), "a refused algorithm must not leave a run folder"


def test_a_widened_encoder_is_refused(tmp_path):
    widened = (
        "self.encoder = NatureCNN()\n",
        "self.encoder = NatureCNN()\n        self.encoder.net[7] = nn.Linear(3136, 1024)\n",
    )
    head = ("nn.Linear(512, n_actions)", "nn.Linear(1024, n_actions)")
    done = start(template_with(tmp_path, "wide", widened=widened, head=head), tmp_path)
    refused(done, tmp_path, "QNetwork.encoder is not the unmodified Nature CNN", "3,290,272 parameters")
    assert "expected 1,684,128" in done.stderr


def test_an_encoder_with_other_activations_is_refused(tmp_path):
    tanh = ("self.encoder = NatureCNN()\n", "self.encoder = NatureCNN()\n        self.encoder.net[1] = nn.Tanh()\n")
    done = start(template_with(tmp_path, "tanh", tanh=tanh), tmp_path)
    refused(done, tmp_path, "QNetwork.encoder's layers differ from the Nature CNN's", "Tanh")


MLP_HEAD = (
    "self.head = nn.Linear(512, n_actions)",
    "self.head = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, n_actions))",
)


def test_an_over_budget_head_is_refused_unless_the_budget_is_raised(tmp_path):
    script = template_with(tmp_path, "big_head", head=MLP_HEAD)
    done = start(script, tmp_path)
    refused(done, tmp_path, "ValueAlgorithm trains 2,211,490 parameters", "over the budget of 1,981,090")
    assert "the largest reference head for 2 actions, iqn's, 296,962" in done.stderr
    assert "--parameter-budget" in done.stderr
    # the flag replaces the budget, says so, and the run goes through
    done = start(script, tmp_path, "--parameter-budget", "2300000")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "parameter budget: 2,300,000 trainable parameters set by --parameter-budget" in done.stdout
    assert parse_standard_output(done.stdout)["final"] >= 0


def test_an_unfrozen_target_network_counts_and_the_error_says_so(tmp_path):
    unfrozen = (".to(self.device).requires_grad_(False)", ".to(self.device)")
    done = start(template_with(tmp_path, "unfrozen", unfrozen=unfrozen), tmp_path)
    refused(done, tmp_path, "ValueAlgorithm trains 3,370,308 parameters (q_network 1,685,154, target_network")
    assert "target_network require gradients but no optimizer trains them" in done.stderr
    assert ".requires_grad_(False)" in done.stderr


@pytest.mark.parametrize(
    "name,change,message",
    [
        ("extra_dim", ("        return actions\n", "        return actions[None]\n"), "shape (1, 1); expected (1,)"),
        ("out_of_range", ("        return actions\n", "        return actions + 5\n"), "each must lie in [0, 2)"),
    ],
)
def test_wrong_actions_are_refused(name, change, message, tmp_path):
    done = start(template_with(tmp_path, name, change=change), tmp_path)
    refused(done, tmp_path, "ValueAlgorithm.select_action returned actions", message)


def test_nan_metrics_stop_the_run_at_the_first_update(tmp_path):
    nan = ('{"td_loss": loss.detach(),', '{"td_loss": loss.detach() * float("nan"),')
    done = start(template_with(tmp_path, "nan_loss", nan=nan), tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "ValueAlgorithm.update returned td_loss=nan at step 33; metrics must be finite" in done.stderr
    [receipt] = (tmp_path / "runs").glob("*/receipt.json")
    assert json.loads(receipt.read_text())["status"] == "failed: non-finite metrics"


def test_metric_and_action_checks_in_detail(capsys):
    """The rules raise (library code does not exit): the message for the user, the status for the receipt."""

    def stops(call, message, status):
        with pytest.raises(TemplateRuleError) as info:
            call()
        assert message in str(info.value) and info.value.message == str(info.value)
        assert info.value.status == status
        assert isinstance(info.value, ValueError)

    good = {"td_loss": torch.tensor(0.5), "q_values": 1.0, "extra": np.float32(2.0)}
    assert check_metrics(good, 7, sync=False) == good  # not read: no GPU wait
    synced = check_metrics({"extra": 2, **good}, 7)
    assert synced == {"td_loss": 0.5, "q_values": 1.0, "extra": 2.0} and list(synced)[:2] == ["td_loss", "q_values"]
    invalid, non_finite = "invalid metrics", "non-finite metrics"
    stops(lambda: check_metrics({"td_loss": 1.0}, 7), "lack q_values", invalid)
    stops(lambda: check_metrics({**good, "extra": torch.ones(3)}, 7, sync=False), "tensor of shape (3,)", invalid)
    stops(lambda: check_metrics({**good, "extra": "high"}, 7, sync=False), "metric extra is a str", invalid)
    stops(lambda: check_metrics({**good, "has space": 1.0}, 7, sync=False), "metric name 'has space'", invalid)
    stops(lambda: check_metrics([1.0], 7), "returned a list", invalid)
    stops(lambda: check_metrics({**good, "extra": float("inf")}, 7), "extra=inf at step 7", non_finite)
    assert check_actions(torch.tensor([1, 0, 3]), 3, 4).dtype == np.int64
    stops(lambda: check_actions(np.array([0.0, 1.0]), 2, 4), "float64 actions", "invalid actions")
    stops(lambda: check_actions(np.array([0, -1]), 2, 4), "each must lie in [0, 4)", "invalid actions")
    stops(lambda: check_actions(np.array(1), 1, 4), "shape (); expected (1,)", "invalid actions")
    obs = np.zeros((1, 4, 84, 84), dtype=np.uint8)
    stops(lambda: check_network(torch.nn.Linear(2, 2), 4, obs, torch.device("cpu")), "no `encoder`", "invalid network")
    assert capsys.readouterr() == ("", ""), "the checks print nothing and leave stopping to the script"
    error = TemplateRuleError("what is wrong; how to fix it", "non-finite metrics")
    again = pickle.loads(pickle.dumps(error))  # e.g. from a worker process
    assert (str(again), again.status) == ("what is wrong; how to fix it", "non-finite metrics")


# ---------------------------------------------------------------- 4. the budget and the checkpoint state


def linear(inputs: int, outputs: int) -> int:
    return inputs * outputs + outputs  # weights and biases


# Each reference script's head (its QNetwork with its default settings, the Nature encoder left out), written
# out by hand from the scripts' papers and layers: template_rules.REFERENCE_HEADS must agree
HEADS_BY_HAND = {
    "dqn": lambda n: linear(512, n),
    "double_dqn": lambda n: linear(512, n),
    "mdqn": lambda n: linear(512, n),
    "drq": lambda n: linear(512, 1) + linear(512, n),  # dueling: a value and an advantage stream
    "c51": lambda n: linear(512, 51 * n),  # 51 atoms per action
    "qrdqn": lambda n: linear(512, 200 * n),  # 200 quantiles per action
    "nc_qrdqn": lambda n: linear(512, 200 * n) + linear(512, 2 * n),  # 200 quantile logits, a scale and a shift
    "iqn": lambda n: linear(64, 512) + linear(512, 512) + linear(512, n),  # cosine embedding, 512 -> 512 -> n
    "rainbow": lambda n: 2 * (linear(512, 51) + linear(512, 51 * n)),  # noisy dueling: means and sigmas
}


def reference_scripts() -> list[Path]:
    """Every script in algos/ but copies of the template (they hold ValueAlgorithmBase) and pqn.py (its encoder
    is the declared LayerNorm variant; the budget counts heads over the plain one)."""
    scripts = [p for p in sorted((REPO / "algos").glob("*.py")) if "ValueAlgorithmBase" not in p.read_text()]
    return [p for p in scripts if p.stem != "pqn"]


def test_every_reference_script_is_in_the_budget_table():
    """A new reference algorithm cannot outgrow the budget unnoticed: it must enter REFERENCE_HEADS (and
    HEADS_BY_HAND), which the next test holds equal to its network."""
    assert {p.stem for p in reference_scripts()} == set(REFERENCE_HEADS) == set(HEADS_BY_HAND), (
        "add the new algorithm to template_rules.REFERENCE_HEADS and its head to HEADS_BY_HAND"
    )


@pytest.mark.parametrize("script", reference_scripts(), ids=lambda p: p.stem)
def test_budget_table_holds_each_reference_scripts_network(script):
    """The constant table against the script's own network: QNetwork(n) at its default settings, its trained
    parameters less the Nature encoder's, for several action counts (per action and fixed part both count)."""
    module = load_algorithm(script)
    for n_actions in (2, 3, 4, 18):
        network = module.QNetwork(n_actions)
        if getattr(network.encoder, "same_padding", False):  # drq.py's default, Dopamine's declared variant: its
            network = module.QNetwork(n_actions, same_padding=False)  # head is the same over the Nature encoder
        assert type(network.encoder) is NatureCNN, f"{script.name}: the budget counts heads over the Nature encoder"
        check_encoder(network.encoder)
        head = sum(p.numel() for p in network.parameters() if p.requires_grad) - NATURE_CNN_PARAMETERS
        table = reference_heads(n_actions)[script.stem]
        assert head == table, (
            f"template_rules.REFERENCE_HEADS[{script.stem!r}] gives {table:,} for {n_actions} actions; "
            f"algos/{script.name}'s QNetwork({n_actions}) trains {head:,} parameters beyond the encoder"
        )


def test_budget_is_the_largest_head_of_the_reference_scripts():
    """The table's heads against the same heads written by hand, and the budget against the largest of them."""
    for n_actions in (2, 3, 4, 6, 9, 18):
        by_hand = {name: head(n_actions) for name, head in HEADS_BY_HAND.items()}
        assert reference_heads(n_actions) == by_hand, n_actions
        largest = max(by_hand.values())
        [name] = [name for name, head in by_hand.items() if head == largest]
        assert largest_reference_head(n_actions) == (name, largest)
        assert parameter_budget(n_actions) == NATURE_CNN_PARAMETERS + largest
        assert name == ("iqn" if n_actions == 2 else "nc_qrdqn")
    assert largest_reference_head(2) == ("iqn", 296_962) and parameter_budget(2) == 1_981_090
    assert parameter_budget(4) == 2_098_632 and largest_reference_head(4) == ("nc_qrdqn", 414_504)
    assert parameter_budget(18) == 1_684_128 + 513 * 202 * 18 == 3_549_396  # docs/custom_algorithms.md's formula


def test_trainable_parameters_count_each_trained_parameter_once():
    shared = torch.nn.Linear(3, 4)  # 16 parameters
    holder = SimpleNamespace(
        online=shared,
        again=shared,  # the same module twice: counted once
        ensemble=[torch.nn.Linear(2, 2), {"extra": torch.nn.Linear(1, 1)}],  # 6 + 2
        target=torch.nn.Linear(10, 10).requires_grad_(False),  # frozen: not counted
        loose=torch.nn.Parameter(torch.zeros(5), requires_grad=False),
    )
    holder.optimizer = torch.optim.SGD([*shared.parameters(), holder.loose], lr=0.1)  # loose: trained, 5
    total, per_module = trainable_parameters(holder)
    assert total == 16 + 6 + 2 + 5
    assert per_module == {
        "online": 16,
        "ensemble[0]": 6,
        "ensemble[1]['extra']": 2,
        "optimizer (parameters outside the modules)": 5,
    }


def test_value_algorithm_state_round_trips(cpu_run):
    module = load_algorithm(TEMPLATE)
    run = cpu_run(learning_rate=1e-3, seed=3, fast=True)  # --fast on the CPU: channels-last networks, fused Adam
    args = run.args
    envs = SimpleNamespace(n_actions=4)  # what ValueAlgorithm reads of the environments
    first = module.ValueAlgorithm(envs, run, args)
    assert first.q_network.encoder.net[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert first.optimizer.defaults["fused"] is True
    obs = torch.randint(0, 256, (4, 4, 84, 84), dtype=torch.uint8)
    data = ReplayBatch(obs, torch.tensor([0, 1, 2, 3]), torch.ones(4), obs.flip(0), torch.zeros(4), torch.ones(4))
    first.update(data, 1)
    first.update_target_network(1.0)  # target copied
    first.update(data, 2)
    first.select_action(obs.numpy(), 0.5)
    first.n_actions = 5  # a plain number comes back too
    state = copy.deepcopy(first.state_dict())
    assert set(state) == {"q_network", "optimizer", "target_network", "rng", "n_actions"}
    # Adam's moments as a checkpoint written on CUDA holds them (contiguous), where --fast makes the networks
    # channels-last on the CPU: load_state_dict gives them their parameters' layout for the fused kernel
    moments = [m for saved in state["optimizer"]["state"].values() for m in saved.values() if torch.is_tensor(m)]
    assert any(not m.is_contiguous() for m in moments), "the convolutions' moments should be channels-last here"
    for saved in state["optimizer"]["state"].values():
        saved.update({k: v.contiguous() for k, v in saved.items() if torch.is_tensor(v)})
    second = module.ValueAlgorithm(envs, run, args)
    second.load_state_dict(state)
    for p in second.q_network.parameters():
        for value in second.optimizer.state[p].values():
            assert value.shape != p.shape or value.stride() == p.stride()
    assert second.n_actions == 5
    second.n_actions = first.n_actions = 4
    for name in ("q_network", "target_network"):
        for a, b in zip(getattr(first, name).parameters(), getattr(second, name).parameters(), strict=True):
            assert torch.equal(a, b)
    # the same next actions and the same next update: optimizer moments and the generator came back
    assert (first.select_action(obs.numpy(), 0.5) == second.select_action(obs.numpy(), 0.5)).all()
    assert first.update(data, 3)["td_loss"].item() == second.update(data, 3)["td_loss"].item()
    for a, b in zip(first.q_network.parameters(), second.q_network.parameters(), strict=True):
        assert torch.equal(a, b), "the update after the load differs: the moments came back wrong"
    with pytest.raises(KeyError, match="missing"):
        second.load_state_dict({k: v for k, v in state.items() if k != "rng"})


# ---------------------------------------------------------------- 5. launchers and the results table


def test_shell_launcher_takes_a_copy_by_path(tmp_path):
    """By name, algos/custom_value_atari.py is any algos/ script (tests/test_launchers.py); here a copy elsewhere."""
    copy_path = template_with(tmp_path, "my_algo")
    env = {**os.environ, "PYTHON": sys.executable, "CI": "true"}
    launcher = str(REPO / "scripts" / "train.sh")
    done = subprocess.run(
        [launcher, BANDIT, str(copy_path), "3", *TINY], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [receipt] = (tmp_path / "runs").glob("tests.toy_envs_ImageBandit-v0__my_algo__3__*/receipt.json")
    assert json.loads(receipt.read_text())["status"] == "finished"
    missing = subprocess.run([launcher, BANDIT, "nowhere/my_algo.py"], capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and "algorithm script 'nowhere/my_algo.py' does not exist" in missing.stderr


def test_many_runs_launcher_and_results_table_take_copies(tmp_path):
    copy_path = template_with(tmp_path, "my_algo")
    root = tmp_path / "grid"
    args = ["-m", "cleanrl_utils.tools.benchmark", "--algos", "custom_value_atari", str(copy_path), "--env-ids", BANDIT]
    done = run_python(*args, "--seeds", "1", "--workers", "2", "--run-dir", str(root), "--", *TINY, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 finished, 0 failed" in done.stdout
    table = run_python("-m", "cleanrl_utils.tools.results", str(root))
    assert table.returncode == 0, table.stderr
    for algo in ("custom_value_atari", "my_algo"):
        assert re.search(rf"^\| {algo} \| 1 \| 60 \| ", table.stdout, re.M), table.stdout


def test_results_report_a_custom_algorithm_on_tuning_and_held_out_games_apart():
    records = [
        {"algo": algo, "env_id": f"{game}NoFrameskip-v4", "game": game, "seed": seed, "step": 10, "mean": score}
        for algo, offset in (("dqn", 0.0), ("my_algo", 5.0))
        for game in ("Breakout", "Pong", "Qbert", "MsPacman")
        for seed, score in ((1, 10.0 + offset), (2, 12.0 + offset))
    ]
    table = results.tables(records)
    assert "### Breakout (tuning game)" in table and "### Qbert (held-out game)" in table
    for group in ("tuning", "held-out"):
        for algo in ("dqn", "my_algo"):
            assert re.search(rf"^\| {group} \| {algo} \| 2 \| ", table, re.M), table


def test_many_runs_launcher_refuses_unknown_scripts_and_clashing_names(tmp_path, capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--algos", str(tmp_path / "absent.py"), "--env-ids", BANDIT, "--seeds", "1"])
    assert "unknown algorithm" in capsys.readouterr().err
    clash = template_with(tmp_path, "dqn")  # a copy named like a reference script
    with pytest.raises(SystemExit):
        benchmark.main(["--algos", "dqn", str(clash), "--env-ids", BANDIT, "--seeds", "1"])
    assert "two scripts share a file name" in capsys.readouterr().err
