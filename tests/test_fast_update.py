"""The scripts' update and their --fast lines, taken from each script's own source and run as they stand on its
own networks and loss: the fast lines (Adam's fused kernel; channels-last networks on CPU) give the plain
update's loss, metrics, gradients and new parameters to float tolerance, for every script; the visible
``--on-nonfinite skip`` test skips the optimizer step on a non-finite loss; a fused Adam loaded from a checkpoint
continues as the uninterrupted one. (benchmarks/fast_update.py, the variants kept for measurement, is tested in
tests/test_bench_fast_update.py.)"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO

from cleanrl_utils.buffer import ReplayBatch
from cleanrl_utils.run import Run
from cleanrl_utils.tools.evaluate import load_algorithm

ALGOS = ["dqn", "double_dqn", "c51", "qrdqn", "mdqn", "nc_qrdqn", "iqn", "rainbow"]
N_ACTIONS, BATCH = 4, 32
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


# ---------------------------------------------------------------- the scripts' own lines


def main_block(source: str) -> ast.If:
    tree = ast.parse(source)
    return next(node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))


def script_lines(algo: str) -> tuple[str, str]:
    """(the fast lines with the optimizer, the update) as they stand in algos/ALGO.py: from ``run.fast(...)``
    through ``optimizer = optim.Adam(...)``; from the ``compute_loss`` call through ``optimizer.step()``"""
    source = (REPO / "algos" / f"{algo}.py").read_text()
    main = main_block(source)
    body = main.body
    first = next(i for i, s in enumerate(body) if ast.unparse(s).startswith("run.fast("))
    last = next(i for i, s in enumerate(body) if isinstance(s, ast.Assign) and "optim.Adam(" in ast.unparse(s))
    setup = "\n".join(ast.get_source_segment(source, s) for s in body[first : last + 1])
    learning = next(
        node
        for node in ast.walk(main)
        if isinstance(node, ast.With) and ast.unparse(node.items[0].context_expr) == "run.timed('learning')"
    )
    steps = learning.body
    first = next(i for i, s in enumerate(steps) if isinstance(s, ast.Assign) and "compute_loss(" in ast.unparse(s))
    last = next(i for i, s in enumerate(steps) if ast.unparse(s) == "optimizer.step()")
    update = "\n".join(textwrap.dedent(ast.get_source_segment(source, s)) for s in steps[first : last + 1])
    return setup, update


def make_batch(device: str, algo: str, seed: int = 0) -> ReplayBatch:
    """Frames with structure (not uniform noise), rewards in {-1, 0, 1}, some terminals; for Rainbow also
    importance-sampling weights and indices, as its prioritized buffer gives."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (BATCH, 5, 84, 84), dtype=np.uint8)
    frames[:, :, 20:40, 30:60] = rng.integers(0, 40, (BATCH, 5, 1, 1), dtype=np.uint8)
    dones = (rng.random(BATCH) < 0.2).astype(np.float32)

    def tensor(array):
        return torch.as_tensor(array, device=device)

    batch = ReplayBatch(
        observations=tensor(frames[:, :4].copy()),
        actions=tensor(rng.integers(0, N_ACTIONS, BATCH)),
        rewards=tensor(rng.integers(-1, 2, BATCH).astype(np.float32)),
        next_observations=tensor(frames[:, 1:].copy()),
        dones=tensor(dones),
        discounts=tensor(0.99 * (1 - dones)),
    )
    if algo != "rainbow":
        return batch
    weights = rng.uniform(0.1, 1.0, BATCH).astype(np.float32)
    batch_type = load_algorithm(REPO / "algos" / "rainbow.py").PrioritizedReplayBatch
    return batch_type(**batch._asdict(), weights=tensor(weights), indices=np.arange(BATCH))


class Script:
    """One script's networks (seed 0, the target network a little off the online one, as after some learning),
    set up by the script's own fast lines with ``--fast`` or ``--no-fast``, and its update run as it stands."""

    def __init__(self, algo: str, fast: bool, device: str, on_nonfinite: str = "stop"):
        self.module = load_algorithm(REPO / "algos" / f"{algo}.py")
        args = self.module.Args()
        args.fast, args.on_nonfinite = fast, on_nonfinite
        # At dqn's Adam eps (1e-8) a first step moves a weight by lr * g / (|g| + eps), nearly lr * sign(g): where a
        # gradient lies within a few eps of 0, rounding (channels-last sums in another order) moves that weight by
        # a good part of lr, and the next update's gradients differ by 2e-5 (seen on an AMD EPYC). The same kernels
        # run at any eps; at the other scripts' (1.5e-4 and up) the comparison is well-conditioned.
        args.adam_eps = max(args.adam_eps, 1e-4)
        names = list(inspect.signature(self.module.QNetwork).parameters)[1:]
        kwargs = {name: getattr(args, name) for name in names if hasattr(args, name)}
        torch.manual_seed(0)
        q_network = self.module.QNetwork(N_ACTIONS, **kwargs).to(device)
        target_network = self.module.QNetwork(N_ACTIONS, **kwargs).to(device)
        target_network.load_state_dict(q_network.state_dict())
        with torch.no_grad():
            for p in target_network.parameters():
                p.mul_(0.9)
        setup, self.update_code = script_lines(algo)
        run = Run.__new__(Run)  # the run's --fast and --on-nonfinite parts, as the script calls them, without a start
        run.args, run.device, run.record = args, torch.device(device), SimpleNamespace(counts=Counter())
        self.namespace = dict(
            torch=torch, optim=torch.optim, args=args, device=torch.device(device), q_network=q_network,
            target_network=target_network, compute_loss=self.module.compute_loss, run=run,
        )  # fmt: skip
        exec(setup, self.namespace)
        self.q_network, self.optimizer = q_network, self.namespace["optimizer"]
        # `continue` (the skip) needs a loop around the update, as in the script
        self.update = compile("for _ in range(1):\n" + textwrap.indent(self.update_code, "    "), algo, "exec")

    def step(self, data):
        self.namespace["data"] = data
        self.namespace.pop("loss", None)
        torch.manual_seed(1)  # IQN samples its fractions in the loss: the same draws for both variants
        exec(self.update, self.namespace)
        grads = [p.grad.detach().clone() for p in self.q_network.parameters()]
        params = [p.detach().clone() for p in self.q_network.parameters()]
        return self.namespace["loss"].detach(), self.namespace["metrics"], grads, params


def assert_same(plain, fast, rtol=1e-4, atol=1e-5):
    (p_loss, p_metrics, p_grads, p_params), (f_loss, f_metrics, f_grads, f_params) = plain, fast
    assert p_metrics.keys() == f_metrics.keys() and len(p_metrics) >= 2
    torch.testing.assert_close(f_loss.cpu(), p_loss.cpu(), rtol=rtol, atol=atol)
    for key in p_metrics:
        torch.testing.assert_close(torch.as_tensor(f_metrics[key]).cpu(), torch.as_tensor(p_metrics[key]).cpu(),
                                   rtol=rtol, atol=atol)  # fmt: skip
    for p, f in zip(p_grads + p_params, f_grads + f_params, strict=True):
        torch.testing.assert_close(f.cpu(), p.cpu(), rtol=rtol, atol=atol)


# ---------------------------------------------------------------- the fast lines against the plain update


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ALGOS)
def test_the_scripts_fast_lines_give_the_plain_update(algo, device):
    if device == "cuda":  # cuDNN may pick other convolution algorithms: a looser tolerance, no TF32
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    batch = make_batch(device, algo)
    plain, fast = Script(algo, False, device), Script(algo, True, device)
    # what --fast turned on: the fused kernel on CPU and CUDA, channels-last weights on CPU only
    assert fast.optimizer.defaults["fused"] is True and not plain.optimizer.defaults["fused"]
    convolutions = [p for p in fast.q_network.parameters() if p.dim() == 4]
    assert all(w.is_contiguous(memory_format=torch.channels_last) == (device == "cpu") for w in convolutions)
    tolerance = {} if device == "cpu" else dict(rtol=1e-3, atol=1e-4)
    for _ in range(2):  # two updates: the second from the first's new parameters and Adam's state
        expected, got = plain.step(batch), fast.step(batch)
        assert_same(expected, got, **tolerance)
    assert expected[0].item() > 0 and all(g.abs().sum() > 0 for g in expected[2])  # a real loss, real gradients


def test_the_comparison_catches_a_different_batch():
    """The tolerance is tight enough: one changed action gives a different update."""
    batch = make_batch("cpu", "dqn")
    changed = batch._replace(actions=batch.actions.clone())
    changed.actions[0] = (changed.actions[0] + 1) % N_ACTIONS
    expected = Script("dqn", False, "cpu").step(batch)
    got = Script("dqn", True, "cpu").step(changed)
    with pytest.raises(AssertionError):
        assert_same(expected, got)


@pytest.mark.parametrize("algo", ALGOS)
def test_on_nonfinite_skip_skips_the_optimizer_step(algo):
    """a NaN reward makes the loss NaN: with --on-nonfinite skip the step is skipped and counted; the next,
    finite batch steps as usual"""
    script = Script(algo, True, "cpu", on_nonfinite="skip")
    before = [p.detach().clone() for p in script.q_network.parameters()]
    batch = make_batch("cpu", algo)
    poisoned = batch._replace(rewards=batch.rewards.clone())
    poisoned.rewards[3] = float("nan")
    script.namespace["data"] = poisoned
    exec(script.update, script.namespace)
    assert not torch.isfinite(script.namespace["loss"])
    assert script.namespace["run"].record.counts["skipped_updates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, script.q_network.parameters(), strict=True))
    script.step(batch)
    assert script.namespace["run"].record.counts["skipped_updates"] == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, script.q_network.parameters(), strict=True))


def test_a_fused_adam_resumed_from_its_state_continues_as_the_uninterrupted_one():
    """what a checkpoint does: the optimizer's state saved after two updates and loaded into a fresh one made by
    the script's own line; the third update is the uninterrupted run's"""
    batches = [make_batch("cpu", "dqn", seed) for seed in range(3)]
    whole = Script("dqn", True, "cpu")
    for batch in batches:
        expected = whole.step(batch)
    first = Script("dqn", True, "cpu")
    for batch in batches[:2]:
        first.step(batch)
    resumed = Script("dqn", True, "cpu")
    resumed.q_network.load_state_dict(first.q_network.state_dict())
    resumed.namespace["target_network"].load_state_dict(first.namespace["target_network"].state_dict())
    resumed.optimizer.load_state_dict(first.optimizer.state_dict())
    assert resumed.optimizer.param_groups[0]["fused"] is True
    assert_same(expected, resumed.step(batches[2]), rtol=1e-5, atol=1e-6)
