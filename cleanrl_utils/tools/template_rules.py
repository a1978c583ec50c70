"""The rules of algos/custom_value_atari.py, the fair-comparison template for new algorithms.

A custom algorithm is a ``QNetwork`` (a head over the fixed Nature encoder) and a ``ValueAlgorithm``; everything
else is the template's fixed part. Each check raises ``TemplateRuleError``; docs/custom_algorithms.md ("What the
checks refuse", "The parameter budget") lists the rules, what each refuses and how the budget is counted.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from cleanrl_utils.checkpoint import load_parts, parts_state
from cleanrl_utils.encoder import NATURE_CNN_PARAMETERS, NatureCNN, check_encoder
from cleanrl_utils.random_state import random_state, set_random_state

REQUIRED_METRICS = ("td_loss", "q_values")


class TemplateRuleError(ValueError):
    """A broken rule of the template. ``str(error)`` says what is wrong and how to fix it; ``status`` names
    the failure for the run's receipt (the template closes the run as ``failed: {status}``)."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # pickled (another process) with its status
        return type(self), (self.message, self.status)


# The trained parameters of each reference script's head (its QNetwork at its default settings, beyond the Nature
# encoder) for A actions: per_action * A + fixed. A constant, so that no script is loaded at run time;
# tests/test_custom.py builds every script's network and holds this table equal to it (and checks that every script
# in algos/ but copies of the template is listed, so a new reference algorithm cannot outgrow the budget). pqn.py is
# not: its encoder is the declared LayerNorm variant, and the budget counts heads over the plain one.
REFERENCE_HEADS = {  # script: (per_action, fixed)
    "dqn": (513, 0),  # linear 512 -> A
    "double_dqn": (513, 0),
    "mdqn": (513, 0),
    "c51": (26_163, 0),  # 51 atoms per action
    "qrdqn": (102_600, 0),  # 200 quantiles per action
    "nc_qrdqn": (103_626, 0),  # 200 quantile increments and the scale and shift per action
    "iqn": (513, 295_936),  # the 64-cosine embedding of tau, and the linear head
    "rainbow": (52_326, 52_326),  # noisy dueling: a value and an advantage stream of 51 atoms
    "drq": (513, 513),  # dueling: a value and an advantage stream
}


def reference_heads(n_actions: int) -> dict[str, int]:
    """The trained parameters of each reference script's ``QNetwork(n_actions)`` (its default settings)
    beyond the Nature encoder's, by script name."""
    return {name: per_action * n_actions + fixed for name, (per_action, fixed) in REFERENCE_HEADS.items()}


def largest_reference_head(n_actions: int) -> tuple[str, int]:
    """The reference algorithm with the largest head for ``n_actions`` and that head's parameters."""
    heads = reference_heads(n_actions)
    name = max(heads, key=heads.__getitem__)
    return name, heads[name]


def parameter_budget(n_actions: int) -> int:
    """The default budget: the Nature encoder plus the largest reference head for ``n_actions``
    (non-crossing QR-DQN's 200 quantiles for 3 actions or more, IQN's for 2)."""
    return NATURE_CNN_PARAMETERS + largest_reference_head(n_actions)[1]


def _members(value: Any, name: str) -> Iterator[tuple[str, Any]]:
    """``(name, value)``, looking inside lists, tuples and dicts (an ensemble of networks, say)."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _members(item, f"{name}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _members(item, f"{name}[{key!r}]")
    else:
        yield name, value


def _attributes(algorithm: Any) -> Iterator[tuple[str, Any]]:
    for name, value in vars(algorithm).items():
        yield from _members(value, name)


def modules_of(algorithm: Any) -> dict[str, nn.Module]:
    """Every ``nn.Module`` the algorithm holds, by attribute name (``ensemble[0]`` inside a list)."""
    return {n: v for n, v in _attributes(algorithm) if isinstance(v, nn.Module)}


def optimizers_of(algorithm: Any) -> dict[str, torch.optim.Optimizer]:
    """Every ``torch.optim`` optimizer the algorithm holds, by attribute name (also inside lists, tuples, dicts)."""
    return {n: v for n, v in _attributes(algorithm) if isinstance(v, torch.optim.Optimizer)}


def trainable_parameters(algorithm: Any) -> tuple[int, dict[str, int]]:
    """The number of trained parameters (each counted once) and how many each module holds."""
    seen: set[int] = set()
    per_module: dict[str, int] = {}
    for name, module in modules_of(algorithm).items():
        count = 0
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
        if count:
            per_module[name] = count
    for name, optimizer in optimizers_of(algorithm).items():
        count = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    count += p.numel()
        if count:
            per_module[f"{name} (parameters outside the modules)"] = count
    return sum(per_module.values()), per_module


def check_network(q_network: nn.Module, n_actions: int, obs: np.ndarray, device: torch.device) -> None:
    """The encoder is the unmodified Nature CNN and ``forward`` gives one Q-value per action."""
    encoder = getattr(q_network, "encoder", None)
    if encoder is None:
        raise TemplateRuleError(
            "QNetwork has no `encoder` attribute; build the head over the fixed encoder: "
            "`self.encoder = NatureCNN()` (from cleanrl_utils.encoder) and `forward(x)` = head(encoder(x))",
            "invalid network",
        )
    if type(encoder) is not NatureCNN:
        raise TemplateRuleError(
            f"QNetwork.encoder is a {type(encoder).__name__}, not cleanrl_utils' NatureCNN itself "
            "(a subclass may change what it computes); use `self.encoder = NatureCNN()` unchanged and put "
            "the algorithm's own layers in the head",
            "invalid network",
        )
    try:
        check_encoder(encoder)
    except ValueError as error:
        raise TemplateRuleError(
            f"QNetwork.encoder is not the unmodified Nature CNN: {error}", "invalid network"
        ) from None
    if repr(encoder) != repr(NatureCNN()):
        raise TemplateRuleError(
            f"QNetwork.encoder's layers differ from the Nature CNN's (activations, strides or order):\n{encoder}\n"
            "use `self.encoder = NatureCNN()` unchanged and put the algorithm's own layers in the head",
            "invalid network",
        )
    with torch.no_grad():
        q_values = q_network(torch.as_tensor(obs[:1], device=device))
    if not isinstance(q_values, torch.Tensor) or tuple(q_values.shape) != (1, n_actions):
        shape = tuple(q_values.shape) if isinstance(q_values, torch.Tensor) else type(q_values).__name__
        raise TemplateRuleError(
            f"QNetwork.forward returned {shape} for a batch of 1 observation; it must return one Q-value per "
            f"action, shape (batch, n_actions) = (1, {n_actions}): evaluation acts on its argmax",
            "invalid network",
        )
    if not q_values.is_floating_point() or not torch.isfinite(q_values).all():
        raise TemplateRuleError(
            f"QNetwork.forward returned {q_values.tolist()}; Q-values must be finite floating-point numbers",
            "invalid network",
        )


def check_parameter_budget(algorithm: Any, n_actions: int, budget: int | None = None) -> tuple[int, int]:
    """Refuse an algorithm that trains more parameters than the budget; print both figures."""
    default = parameter_budget(n_actions)
    limit = default if budget is None else budget
    if not optimizers_of(algorithm):
        raise TemplateRuleError(
            "ValueAlgorithm holds no torch.optim optimizer as an attribute (e.g. `self.optimizer = "
            "optim.Adam(self.q_network.parameters(), lr=args.learning_rate)`); the template checkpoints it",
            "invalid algorithm",
        )
    count, per_module = trainable_parameters(algorithm)
    detail = ", ".join(f"{name} {n:,}" for name, n in per_module.items())
    reference, head = largest_reference_head(n_actions)
    origin = (
        f"Nature encoder {NATURE_CNN_PARAMETERS:,} + the largest reference head for {n_actions} actions, "
        f"{reference}'s, {head:,}"
    )
    if count > limit:
        frozen_hint = ""
        optimized = {id(p) for opt in optimizers_of(algorithm).values() for g in opt.param_groups for p in g["params"]}
        untrained = [
            name
            for name, module in modules_of(algorithm).items()
            if any(p.requires_grad and id(p) not in optimized for p in module.parameters())
        ]
        if untrained:
            frozen_hint = (
                f"; {', '.join(untrained)} require gradients but no optimizer trains them: if they are target "
                "networks, freeze them with `.requires_grad_(False)` so they do not count"
            )
        raise TemplateRuleError(
            f"ValueAlgorithm trains {count:,} parameters ({detail}), over the budget of {limit:,} "
            + (f"({origin})" if budget is None else "(--parameter-budget)")
            + frozen_hint
            + "; make the head smaller, or pass --parameter-budget N to run outside the fair-comparison budget",
            "over the parameter budget",
        )
    if budget is None:
        print(f"parameter budget: {limit:,} trainable parameters ({origin})", flush=True)
    else:
        print(
            f"parameter budget: {limit:,} trainable parameters set by --parameter-budget (the default, {default:,}, "
            "keeps comparisons with the reference algorithms fair)",
            flush=True,
        )
    print(f"ValueAlgorithm trains {count:,} parameters ({detail}), {100 * count / limit:.1f}% of the budget")
    return count, limit


def check_actions(actions: Any, num_envs: int, n_actions: int) -> np.ndarray:
    """One integer action in [0, n_actions) per environment, as the int64 array the environments take;
    ``TemplateRuleError`` (status ``invalid actions``) otherwise."""
    if isinstance(actions, torch.Tensor):
        actions = actions.detach().cpu().numpy()
    array = np.asarray(actions)
    if array.shape != (num_envs,):
        raise TemplateRuleError(
            f"ValueAlgorithm.select_action returned actions of shape {array.shape}; expected ({num_envs},): "
            f"one action per environment (--num-envs {num_envs})",
            "invalid actions",
        )
    if not np.issubdtype(array.dtype, np.integer):
        raise TemplateRuleError(
            f"ValueAlgorithm.select_action returned {array.dtype} actions; they must be integers (e.g. argmax)",
            "invalid actions",
        )
    if array.size and (array.min() < 0 or array.max() >= n_actions):
        raise TemplateRuleError(
            f"ValueAlgorithm.select_action returned actions {array.tolist()}; each must lie in [0, {n_actions})",
            "invalid actions",
        )
    return array.astype(np.int64, copy=False)


def check_metrics(metrics: Any, global_step: int, sync: bool = True) -> dict[str, Any]:
    """``update``'s metrics: a dict of numbers (Python numbers or one-element tensors) with at least
    ``td_loss`` and ``q_values``, returned with those two first. With ``sync`` (the template's first
    update) they are read as floats and must be finite; without it only their kind is checked, so a
    GPU is not made to wait at every update (the template's loop checks the logged values, every 1000
    agent steps). ``TemplateRuleError`` otherwise, with status ``invalid metrics`` or ``non-finite metrics``."""
    if not isinstance(metrics, dict):
        raise TemplateRuleError(
            f"ValueAlgorithm.update returned a {type(metrics).__name__}; it must return a dict of float metrics",
            "invalid metrics",
        )
    missing = [key for key in REQUIRED_METRICS if key not in metrics]
    if missing:
        raise TemplateRuleError(
            f"ValueAlgorithm.update's metrics {sorted(map(str, metrics))} lack {', '.join(missing)}; every "
            "algorithm reports td_loss (its loss) and q_values (the mean Q-value of the batch's actions)",
            "invalid metrics",
        )
    for key, value in metrics.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise TemplateRuleError(
                f"ValueAlgorithm.update's metric name {key!r} must be a name like td_loss (letters, digits, _)",
                "invalid metrics",
            )
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (number or (isinstance(value, torch.Tensor) and value.numel() == 1)):
            kind = f"tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise TemplateRuleError(
                f"ValueAlgorithm.update's metric {key} is a {kind}; each metric must be one number "
                "(a float, or a one-element tensor such as loss.detach())",
                "invalid metrics",
            )
    order = [*REQUIRED_METRICS, *(key for key in metrics if key not in REQUIRED_METRICS)]
    if not sync:
        return {key: metrics[key] for key in order}  # td_loss and q_values first, as every script prints
    values = {key: float(metrics[key]) for key in order}
    bad = [f"{key}={value}" for key, value in values.items() if not math.isfinite(value)]
    if bad:
        raise TemplateRuleError(
            f"ValueAlgorithm.update returned {', '.join(bad)} at step {global_step}; metrics must be finite "
            "(a diverging loss: lower --learning-rate, clip gradients, or look for log(0) or 0/0 in the loss)",
            "non-finite metrics",
        )
    return values


class ValueAlgorithmBase:
    """``state_dict`` / ``load_state_dict`` over everything a checkpoint needs: the networks, optimizers and numpy
    random generators the algorithm holds (as ``parts_state`` / ``load_parts`` save and restore a script's) and its
    plain numbers (counters, settings); ``args`` and ``device`` are left out."""

    def _state_members(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the parts, the plain numbers), by attribute name"""
        members = {n: v for n, v in vars(self).items() if n not in ("args", "device")}
        parts = {
            n: v for n, v in members.items() if isinstance(v, (nn.Module, torch.optim.Optimizer, np.random.Generator))
        }
        plain = {n: v for n, v in members.items() if isinstance(v, numbers.Number)}  # numpy scalars too
        return parts, plain

    def state_dict(self) -> dict[str, Any]:
        parts, plain = self._state_members()
        return {**parts_state(parts), **{n: v.item() if isinstance(v, np.generic) else v for n, v in plain.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what ``state_dict`` returned (each optimizer's moments take their parameters' memory layout)."""
        parts, plain = self._state_members()
        unknown, missing = sorted(set(state) - {*parts, *plain}), sorted({*parts, *plain} - set(state))
        if unknown or missing:
            raise KeyError(f"checkpoint does not match the ValueAlgorithm: missing {missing}, unexpected {unknown}")
        load_parts(parts, state)
        for name in plain:
            setattr(self, name, state[name])


def check_algorithm(
    algorithm: Any,
    q_network_class: type,
    envs: Any,
    obs: np.ndarray,
    device: torch.device,
    budget: int | None = None,
) -> nn.Module:
    """Every start-up rule; returns the Q-network that evaluation plays with (``algorithm.q_network``).

    ``forward`` and ``select_action`` (at epsilon 0 and 1) are tried on ``obs``; the algorithm's state
    and the global random generators are restored afterwards, so the checks do not change the run.
    A broken rule raises ``TemplateRuleError`` (the first one found)."""
    for method in ("select_action", "update", "update_target_network", "state_dict", "load_state_dict"):
        if not callable(getattr(algorithm, method, None)):
            raise TemplateRuleError(
                f"ValueAlgorithm has no {method}() method; it needs select_action(obs, epsilon), "
                "update(batch, global_step), update_target_network(tau) (a pass where there is no target network) "
                "and, from ValueAlgorithmBase, state_dict() / load_state_dict()",
                "invalid algorithm",
            )
    q_network = getattr(algorithm, "q_network", None)
    if not isinstance(q_network, q_network_class):
        raise TemplateRuleError(
            f"ValueAlgorithm.q_network is a {type(q_network).__name__}, not a QNetwork; set "
            "`self.q_network = QNetwork(envs.n_actions).to(device)`: evaluation plays with it",
            "invalid algorithm",
        )
    saved = copy.deepcopy(algorithm.state_dict())
    generators = random_state()
    try:
        check_network(q_network, envs.n_actions, obs, device)
        check_parameter_budget(algorithm, envs.n_actions, budget)
        for epsilon in (0.0, 1.0):
            check_actions(algorithm.select_action(obs, epsilon), envs.num_envs, envs.n_actions)
    finally:
        algorithm.load_state_dict(saved)
        set_random_state(generators)
    return q_network
