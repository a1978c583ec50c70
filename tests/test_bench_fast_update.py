"""benchmarks/fast_update.py, the update's variants that benchmarks/throughput.py measures (channels-last, fused
Adam, torch.compile, a CUDA graph, one forward over s and s'), computes what the eager update computes: same
loss, metrics, gradients and new parameters on the same batch, to float tolerance, for every algorithm's loss
(each script's own ``compute_loss``). The scripts' own update and --fast lines: tests/test_fast_update.py."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from conftest import REPO
from test_fast_update import make_batch  # the same structured batch as the scripts' own update tests

from benchmarks.fast_update import FastSettings, Update, to_channels_last, use_fused_optimizer
from cleanrl_utils.buffer import ReplayBatch

ALGOS = ["dqn", "double_dqn", "c51", "qrdqn", "mdqn", "nc_qrdqn", "iqn", "rainbow"]
N_ACTIONS, BATCH = 4, 32


def throughput():
    spec = importlib.util.spec_from_file_location("throughput", REPO / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["throughput"] = module  # torch.compile finds the losses' globals by module name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return throughput()


def one_update(bench, algo: str, settings: FastSettings, batch: ReplayBatch, device: str, cat: bool = False):
    """(outputs, gradients, new parameters) of one update from the same initial networks (seed 0)."""
    module = bench.load_script(algo)
    args = module.Args()
    q_network, target_network, optimizer = bench.make_networks(module, algo, N_ACTIONS, args, torch.device(device))
    with torch.no_grad():  # a target network that differs from the online one, as after some learning
        for p in target_network.parameters():
            p.mul_(0.9)
    loss_fn = bench.make_loss(algo, module, q_network, target_network, args, cat=cat)
    if settings.channels_last:
        to_channels_last(q_network, target_network)
    if settings.fused:
        assert use_fused_optimizer(optimizer)
    update = Update(
        loss_fn,
        optimizer,
        compile=settings.compile,
        cuda_graph=settings.cuda_graph,
        channels_last=settings.channels_last,
    )
    outputs = update(batch)
    if settings.cuda_graph:  # the first call captured the graph: a second replay must give the same again
        outputs = update(batch)
        torch.cuda.synchronize()
    grads = [p.grad.detach().clone() for p in q_network.parameters()]
    params = [p.detach().clone() for p in q_network.parameters()]
    if settings.cuda_graph:  # the second call took a second step: compare with two eager steps
        return outputs, grads, params, 2
    return outputs, grads, params, 1


def tensors(outputs) -> list[torch.Tensor]:
    """The loss's outputs (loss, metrics dict, per-transition tensors) as one flat list, in order."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    items = outputs.values() if isinstance(outputs, dict) else outputs
    return [t for item in items for t in tensors(item)]


def assert_same(eager, fast, rtol=1e-4, atol=1e-5):
    (e_out, e_grads, e_params), (f_out, f_grads, f_params) = eager, fast
    assert len(tensors(e_out)) >= 3  # the loss and at least two metrics
    for e, f in zip(tensors(e_out), tensors(f_out), strict=True):
        torch.testing.assert_close(f.cpu(), e.cpu(), rtol=rtol, atol=atol)
    for e, f in zip(e_grads, f_grads, strict=True):
        torch.testing.assert_close(f.cpu(), e.cpu(), rtol=rtol, atol=atol)
    for e, f in zip(e_params, f_params, strict=True):
        torch.testing.assert_close(f.cpu(), e.cpu(), rtol=rtol, atol=atol)


def eager_steps(bench, algo, batch, device, steps):
    result = None
    module = bench.load_script(algo)
    args = module.Args()
    q_network, target_network, optimizer = bench.make_networks(module, algo, N_ACTIONS, args, torch.device(device))
    with torch.no_grad():
        for p in target_network.parameters():
            p.mul_(0.9)
    update = Update(bench.make_loss(algo, module, q_network, target_network, args), optimizer)
    for _ in range(steps):
        result = update(batch)
    grads = [p.grad.detach().clone() for p in q_network.parameters()]
    return result, grads, [p.detach().clone() for p in q_network.parameters()]


@pytest.mark.parametrize("algo", ALGOS)
def test_fast_update_on_cpu_matches_the_eager_update(bench, algo):
    batch = make_batch("cpu", algo=algo)
    *eager, _ = one_update(bench, algo, FastSettings(), batch, "cpu")
    *fast, _ = one_update(bench, algo, FastSettings.for_device("cpu"), batch, "cpu")
    assert_same(eager, fast)
    assert eager[0][0].item() > 0 and all(g.abs().sum() > 0 for g in eager[1])  # a real loss, real gradients


@pytest.mark.parametrize("algo", ["double_dqn", "mdqn"])
def test_one_forward_over_observations_and_next_observations_matches_two(bench, algo):
    batch = make_batch("cpu", "dqn")
    *two, _ = one_update(bench, algo, FastSettings(), batch, "cpu")
    *one, _ = one_update(bench, algo, FastSettings(), batch, "cpu", cat=True)
    one[0] = one[0][: len(two[0])]  # the loss and its metrics (the benchmark's double_dqn variant adds TD errors)
    assert_same(two, one)


def test_the_comparison_catches_a_different_batch(bench):
    """The tolerance is tight enough: one changed action gives a different update."""
    batch = make_batch("cpu", "dqn")
    changed = batch._replace(actions=batch.actions.clone())
    changed.actions[0] = (changed.actions[0] + 1) % N_ACTIONS
    *eager, _ = one_update(bench, "dqn", FastSettings(), batch, "cpu")
    *fast, _ = one_update(bench, "dqn", FastSettings.for_device("cpu"), changed, "cpu")
    with pytest.raises(AssertionError):
        assert_same(eager, fast)


def test_fused_optimizer_continues_a_started_adam_state():
    """A resumed run switches to the fused kernel with Adam's state already there: same steps as before."""
    torch.manual_seed(0)
    params = [torch.randn(64, 32, requires_grad=True), torch.randn(32, requires_grad=True)]
    twin = [p.detach().clone().requires_grad_(True) for p in params]
    opt_a, opt_b = torch.optim.Adam(params, lr=1e-2), torch.optim.Adam(twin, lr=1e-2)
    for step in range(6):
        if step == 3:
            assert use_fused_optimizer(opt_b)
        for group, opt in ((params, opt_a), (twin, opt_b)):
            opt.zero_grad()
            (group[0].sin().sum() + (group[1] ** 2).sum()).backward()
            opt.step()
    for a, b in zip(params, twin, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_a_nonfinite_loss_skips_the_step_when_asked():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([weight], lr=0.1)
    update = Update(lambda x: ((weight * x).sum(),), optimizer, skip_nonfinite=True)
    update(torch.tensor([float("nan"), 1.0, 1.0]))
    assert update.skipped == 1 and torch.equal(weight.detach(), torch.ones(3))
    update(torch.ones(3))
    assert update.skipped == 1 and not torch.equal(weight.detach(), torch.ones(3))


def test_cuda_graph_without_cuda_or_with_skipping_is_refused():
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(ValueError, match="non-finite"):
        Update(lambda x: x, optimizer, cuda_graph=True, skip_nonfinite=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            Update(lambda x: x, optimizer, cuda_graph=True)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["dqn", "c51"])
def test_compiled_update_matches_the_eager_update(bench, algo):
    """torch.compile (Inductor): compiling takes about a minute on a cold cache, hence slow."""
    batch = make_batch("cpu", "dqn")
    *eager, _ = one_update(bench, algo, FastSettings(), batch, "cpu")
    *fast, _ = one_update(bench, algo, FastSettings(channels_last=True, compile=True, fused=True), batch, "cpu")
    assert_same(eager, fast)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("settings", ["cuda", "channels_last,fused,cuda_graph"])
def test_fast_update_on_cuda_matches_the_eager_update(bench, algo, settings):
    """On the GPU: the settings FastSettings.for_device picks (a CUDA graph), replayed twice, against two
    eager steps; cuDNN's convolutions may pick other algorithms, so the tolerance is looser than on CPU."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    chosen = (
        FastSettings.for_device("cuda") if settings == "cuda" else bench.parse_settings(settings, torch.device("cuda"))
    )
    batch = make_batch("cuda", algo=algo)
    *fast, steps = one_update(bench, algo, chosen, batch, "cuda")
    eager = eager_steps(bench, algo, batch, "cuda", steps)
    assert_same(eager, fast, rtol=1e-3, atol=1e-4)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
