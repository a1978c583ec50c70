"""The update's variants that benchmarks/throughput.py measures: one gradient step, run several ways.

The scripts in algos/ run their update in plain sight (the loss, ``optimizer.zero_grad()``, ``loss.backward()``,
``optimizer.step()``) with two visible speed-ups under ``--fast``: Adam's fused kernel (``fused=``) and, on CPU,
channels-last networks. This module keeps, for measurement only, those two and the variants that did not pay
enough to ship (benchmarks/RESULTS.md):

``Update(loss_fn, optimizer, ...)`` runs ``loss_fn(data) -> (loss, *outputs)``, the backward pass and the
optimizer step, and returns the loss and the outputs (tensors, or dicts of tensors) detached, without any host
synchronisation. The algorithm's loss is the script's own ``compute_loss``; what this module changes is only
how that function is run:

- ``channels_last``: the networks' convolutions in NHWC layout (oneDNN on CPU runs them faster), and the
  batch's frame stacks handed to them in that layout too (a copy of the uint8 stacks, not of floats);
- ``compile``: ``torch.compile`` of ``loss_fn`` (forward and backward fused by Inductor);
- ``fused``: the optimizer's fused kernel (one kernel over all parameters instead of one per tensor);
- ``cuda_graph``: on CUDA, the whole step (forward, backward, optimizer) captured once as a CUDA graph and
  replayed: one launch per update instead of hundreds. The batch is copied into static tensors first.

Every one of them computes the same loss and gradients as the plain eager step to float tolerance
(tests/test_bench_fast_update.py). ``FastSettings.for_device`` holds what the scripts' ``--fast`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class FastSettings:
    channels_last: bool = False
    compile: bool = False
    fused: bool = False
    cuda_graph: bool = False

    @staticmethod
    def for_device(device: torch.device | str) -> FastSettings:
        """What paid in benchmarks/RESULTS.md. CPU: channels-last and the fused Adam kernel (1.34x faster
        updates on 2 cores; torch.compile added nothing measurable end to end, for a minute of compiling on
        a cold cache). CUDA: the fused Adam kernel only, until benchmarks/gpu_check.sh has measured the
        CUDA graph (``cuda_graph``) and channels-last on a GPU; both are here, and tested where CUDA is."""
        kind = torch.device(device).type
        if kind == "cuda":
            return FastSettings(channels_last=False, compile=False, fused=True, cuda_graph=False)
        if kind == "cpu":
            return FastSettings(channels_last=True, compile=False, fused=True, cuda_graph=False)
        return FastSettings()  # MPS and others: the plain step

    def describe(self) -> str:
        on = [name for name in ("channels_last", "compile", "fused", "cuda_graph") if getattr(self, name)]
        return "+".join(on) if on else "eager"


def to_channels_last(*modules: nn.Module) -> None:
    """Convert the modules' 4-d parameters and buffers to channels-last (NHWC) memory layout, in place.
    Parameters keep their identity, so an optimizer made before or after this still holds them."""
    for module in modules:
        module.to(memory_format=torch.channels_last)


def use_fused_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Switch an Adam-family optimizer to its fused kernel where this torch and device have one; returns
    whether it did. Existing state (a resumed run) is kept, its step counters moved beside the parameters."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    devices = {p.device.type for group in optimizer.param_groups for p in group["params"]}
    supported = set(torch.utils._foreach_utils._get_fused_kernels_supported_devices())
    if not devices <= supported or len(devices) != 1:
        return False
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
    optimizer._step_supports_amp_scaling = True
    _steps_beside_parameters(optimizer)
    return True


def _steps_beside_parameters(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if isinstance(state.get("step"), torch.Tensor) and state["step"].device != p.device:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``fn`` applied to every tensor of a tensor, a tuple/list or a dict of them (the loss's outputs)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(fn, item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return tuple(_map_tensors(fn, item) for item in value)
    return value


def _detached(outputs: Any) -> tuple[Any, ...]:
    if not isinstance(outputs, (tuple, list)):
        outputs = (outputs,)
    return _map_tensors(torch.Tensor.detach, tuple(outputs))


class Update:
    """``update(data)``: one optimizer step on ``loss_fn(data)``, whose first output is the scalar loss;
    returns ``(loss, *outputs)`` detached. ``skip_nonfinite``: a non-finite loss skips the optimizer step
    (counted in ``skipped``, ``last_skipped`` tells about the latest call; this reads the loss on the host,
    so it costs a synchronisation per update).

    With ``cuda_graph``, the first call warms up on a side stream (three steps on the first batch, after
    which the parameters and the optimizer state are put back as they were, so learning is unchanged),
    captures the step and replays it from then on. The networks' parameters and buffers must then only be
    changed in place (``copy_``, ``load_state_dict``: as the target-network sync does), and the optimizer's
    state must not be replaced after the first call (load a checkpoint before it)."""

    def __init__(
        self,
        loss_fn: Callable[[Any], Any],
        optimizer: torch.optim.Optimizer,
        *,
        compile: bool = False,
        cuda_graph: bool = False,
        skip_nonfinite: bool = False,
        channels_last: bool = False,
        warmup: int = 3,
    ) -> None:
        if cuda_graph and skip_nonfinite:
            raise ValueError(
                "a CUDA graph cannot skip an update on a non-finite loss (the step is one replay); "
                "use --on-nonfinite stop, or turn the CUDA graph off"
            )
        if cuda_graph and not torch.cuda.is_available():
            raise ValueError("cuda_graph needs a CUDA device; this machine has none")
        self.loss_fn = torch.compile(loss_fn) if compile else loss_fn
        self.optimizer = optimizer
        self.cuda_graph = cuda_graph
        self.skip_nonfinite = skip_nonfinite
        self.channels_last = channels_last
        self.warmup = warmup
        self.skipped = 0
        self.last_skipped = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_data: Any = None
        self.static_outputs: tuple[Any, ...] = ()

    def __call__(self, data: Any) -> tuple[torch.Tensor, ...]:
        if self.channels_last:
            data = _channels_last(data)
        if self.cuda_graph:
            if self.graph is None:
                self._capture(data)
            _copy_into(self.static_data, data)
            self.graph.replay()
            return _map_tensors(torch.Tensor.clone, self.static_outputs)
        outputs = _detached(self._step(data, skip=self.skip_nonfinite))
        return outputs

    def _step(self, data: Any, skip: bool = False) -> Any:
        outputs = self.loss_fn(data)
        loss = outputs if isinstance(outputs, torch.Tensor) else outputs[0]
        self.optimizer.zero_grad()
        loss.backward()
        self.last_skipped = skip and not bool(torch.isfinite(loss))
        if self.last_skipped:
            self.skipped += 1
            return outputs
        self.optimizer.step()
        return outputs

    def _capture(self, data: Any) -> None:
        optimizer = self.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for group in optimizer.param_groups:
            if "capturable" in group:
                group["capturable"] = True
        _steps_beside_parameters(optimizer)
        self.static_data = _clone(data)
        saved_params = [p.detach().clone() for p in params]
        saved_state = {
            p: {k: v.clone() for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}
            for p in params
            if p in optimizer.state
        }
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._step(self.static_data)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():  # the warm-up steps are undone: learning starts from the same state
            for p, saved in zip(params, saved_params, strict=True):
                p.copy_(saved)
            for p in params:
                for k, v in optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        v.copy_(saved_state[p][k]) if p in saved_state else v.zero_()
        optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            outputs = self._step(self.static_data)
        self.static_outputs = _detached(outputs)


def _channels_last(data: Any) -> Any:
    """The batch with its 4-d tensors (the frame stacks) in channels-last layout."""

    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() == 4:
            return value.contiguous(memory_format=torch.channels_last)
        return value

    if isinstance(data, torch.Tensor):
        return convert(data)
    if hasattr(data, "_fields"):
        return type(data)(*(convert(v) for v in data))
    return data


def _clone(data: Any) -> Any:
    """A copy of a batch (a NamedTuple of tensors, or a tensor) whose tensors the graph reads from."""
    if isinstance(data, torch.Tensor):
        return data.clone()
    if hasattr(data, "_fields"):
        return type(data)(*(v.clone() if isinstance(v, torch.Tensor) else v for v in data))
    raise TypeError(f"a CUDA-graph update needs a tensor or a NamedTuple of tensors, got {type(data).__name__}")


def _copy_into(static: Any, data: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(data, non_blocking=True)
        return
    for s, d in zip(static, data, strict=True):
        if isinstance(s, torch.Tensor):
            if s.shape != d.shape:
                raise ValueError(
                    f"a CUDA-graph update needs batches of one shape: {tuple(d.shape)} != {tuple(s.shape)}"
                )
            s.copy_(d, non_blocking=True)


def prepare(
    networks: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any], Any],
    settings: FastSettings,
    skip_nonfinite: bool = False,
) -> Update:
    """Apply ``settings`` to the networks and the optimizer and return the ``Update`` that runs
    ``loss_fn``. Call it once the networks and the optimizer exist; a checkpoint may be loaded before or
    after, but before the first update. Skipping non-finite updates needs the host, so it turns the CUDA
    graph off."""
    if skip_nonfinite and settings.cuda_graph:
        settings = replace(settings, cuda_graph=False)
    if settings.channels_last:
        to_channels_last(*networks)
    if settings.fused:
        use_fused_optimizer(optimizer)
    return Update(
        loss_fn,
        optimizer,
        compile=settings.compile,
        cuda_graph=settings.cuda_graph,
        skip_nonfinite=skip_nonfinite,
        channels_last=settings.channels_last,
    )
