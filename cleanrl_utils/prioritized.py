"""Prioritized experience replay (Schaul et al. 2016), proportional variant, over the frame-deduplicated buffer.

Transition ``i`` is sampled with probability ``P(i) = p_i / sum_k p_k``, its priority being
``p_i = (|delta_i| + eps) ** alpha`` (``delta_i`` its last TD error, or its distributional loss); a new
transition gets the largest priority seen so far, so it is sampled at least once soon. The bias this brings
is corrected by importance-sampling weights ``w_i = (N * P(i)) ** -beta``, normalised by the largest weight
over the buffer, ``w_i / max_k w_k = (p_min / p_i) ** beta``, so they only ever scale an update down; beta
is annealed to 1 by the scripts.

Priorities live in a sum tree (``SumTree``): sampling, by a prefix-sum search, and updating both take
O(log n) per item, vectorised over the batch with numpy. The storage is ``ReplayBuffer``'s own (frames
stored once, one ring per environment); a slot that holds no complete transition (a stack's first frames,
a transition whose stack was overwritten, or whose n-step return is not complete yet) has priority 0, so it
is never sampled.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from cleanrl_utils.buffer import ReplayBatch, ReplayBuffer

# the sum tree's memory per transition, at most: two float64 arrays of 2 * (leaves rounded up to a power of two)
PRIORITY_BYTES = 2 * 8 * 2 * 2


class SumTree:
    """Non-negative priorities of ``size`` leaves, with their sum and their smallest positive value.

    A complete binary tree in an array: node ``k`` has children ``2k`` and ``2k + 1``, the root is node 1,
    and leaf ``i`` is node ``leaves + i`` (``leaves``: ``size`` rounded up to a power of two; the padding
    leaves stay 0). Each inner node holds the sum of its children (and, in a second array, their minimum
    positive value, +inf where there is none).
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a sum tree needs at least one leaf, got size {size}")
        self.size = size
        self.depth = max(0, (size - 1).bit_length())
        self.leaves = 1 << self.depth
        self.sums = np.zeros(2 * self.leaves, dtype=np.float64)
        self.mins = np.full(2 * self.leaves, np.inf, dtype=np.float64)

    def total(self) -> float:
        return float(self.sums[1])

    def min(self) -> float:
        """the smallest positive priority (+inf when every priority is 0)"""
        return float(self.mins[1])

    def get(self, indices: np.ndarray) -> np.ndarray:
        return self.sums[np.asarray(indices, dtype=np.int64) + self.leaves]

    def update(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Set leaves ``indices`` to ``priorities`` (where an index repeats, its last priority wins) and
        recompute their ancestors level by level, each as the exact sum of its two children (no drift)."""
        indices = np.asarray(indices, dtype=np.int64).ravel()
        priorities = np.asarray(priorities, dtype=np.float64).ravel()
        if len(indices) != len(priorities):
            raise ValueError(f"{len(indices)} indices but {len(priorities)} priorities")
        if len(indices) == 0:
            return
        if indices.min() < 0 or indices.max() >= self.size:
            raise IndexError(f"leaf indices must lie in [0, {self.size}), got [{indices.min()}, {indices.max()}]")
        if not (np.isfinite(priorities).all() and (priorities >= 0).all()):
            raise ValueError("priorities must be finite and >= 0")
        reversed_unique, last = np.unique(indices[::-1], return_index=True)
        nodes = reversed_unique + self.leaves
        values = priorities[::-1][last]
        self.sums[nodes] = values
        self.mins[nodes] = np.where(values > 0, values, np.inf)
        for _ in range(self.depth):  # a node listed twice gets the same value twice: no need to deduplicate
            nodes = nodes >> 1
            left, right = 2 * nodes, 2 * nodes + 1
            self.sums[nodes] = self.sums[left] + self.sums[right]
            self.mins[nodes] = np.minimum(self.mins[left], self.mins[right])

    def find(self, values: np.ndarray) -> np.ndarray:
        """For each value in [0, total), the leaf ``i`` with ``sum(p[:i]) <= value < sum(p[:i + 1])``, a
        descent from the root for the whole batch at once. The descent never enters a subtree of sum 0
        (it goes right only where the right child holds some priority), so even a value at or past the
        total through rounding lands on a leaf of positive priority."""
        values = np.array(values, dtype=np.float64).ravel()
        nodes = np.ones(len(values), dtype=np.int64)
        for _ in range(self.depth):
            left = self.sums[2 * nodes]
            go_right = (values >= left) & (self.sums[2 * nodes + 1] > 0)
            values = np.where(go_right, values - left, values)
            nodes = 2 * nodes + go_right
        return nodes - self.leaves


# the uniform buffer's batch plus the importance-sampling weights and where the transitions lie
PrioritizedReplayBatch = NamedTuple(
    "PrioritizedReplayBatch",
    [
        *ReplayBatch.__annotations__.items(),
        ("weights", torch.Tensor),  # float32 (B,) on the device, w_i / max_k w_k, in (0, 1]
        ("indices", np.ndarray),  # int64 (B,), env * capacity + slot: give them back to update_priorities
    ],
)


class PrioritizedReplayBuffer(ReplayBuffer):
    """``ReplayBuffer`` (same storage, same ``add``) sampled in proportion to priorities.

    ``sample(batch_size, beta)`` draws one transition in each of ``batch_size`` equal segments of the
    priorities' total (stratified, as Schaul et al.) and returns the usual fields plus ``weights`` and
    ``indices``; ``update_priorities(indices, errors)`` sets ``p = (|error| + eps) ** alpha``.
    Leaf ``env * capacity + slot`` of the sum tree is slot ``slot`` of environment ``env``'s ring.
    """

    def __init__(
        self,
        buffer_size: int,
        num_envs: int,
        observation_shape: tuple[int, ...] = (4, 84, 84),
        device: torch.device | str = "cpu",
        n_step: int = 1,
        gamma: float = 0.99,
        seed: int | None = None,
        storage_device: torch.device | str | None = None,
        alpha: float = 0.6,
        eps: float = 1e-6,
    ) -> None:
        if not alpha >= 0:
            raise ValueError(f"alpha {alpha} must be >= 0 (0 samples uniformly)")
        if not eps > 0:
            raise ValueError(f"eps {eps} must be > 0 (so that no transition's priority is 0)")
        super().__init__(buffer_size, num_envs, observation_shape, device, n_step, gamma, seed, storage_device)
        self.alpha, self.eps = alpha, eps
        self.tree = SumTree(self.num_envs * self.capacity)
        self.max_priority = 1.0  # new transitions get the largest priority seen so far

    SETTINGS = (*ReplayBuffer.SETTINGS, "alpha", "eps")

    def state_dict(self) -> dict[str, Any]:
        """``ReplayBuffer.state_dict`` plus the sum tree's sums and minima and the largest priority seen."""
        return {
            **super().state_dict(),
            "tree.sums": self.tree.sums.copy(),
            "tree.mins": self.tree.mins.copy(),
            "max_priority": self.max_priority,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = ("tree.sums", "tree.mins", "max_priority")
        missing = [name for name in own if name not in state]
        if missing:
            raise ValueError(f"replay state lacks {missing}: not a prioritized replay memory")
        for name in ("tree.sums", "tree.mins"):
            if np.shape(state[name]) != self.tree.sums.shape:
                raise ValueError(f"replay {name} has shape {np.shape(state[name])}, not {self.tree.sums.shape}")
        super().load_state_dict({k: v for k, v in state.items() if k not in own})
        self.tree.sums[...] = state["tree.sums"]
        self.tree.mins[...] = state["tree.mins"]
        self.max_priority = float(state["max_priority"])

    def add(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        actions: np.ndarray,
        rewards: np.ndarray,
        dones: np.ndarray,
        ends: np.ndarray,
        mask: np.ndarray | None = None,
    ) -> None:
        start, written = self.cursor.copy(), self.written.copy()
        super().add(obs, next_obs, actions, rewards, dones, ends, mask)
        count = self.written - written
        self._refresh_priorities(np.flatnonzero(count), start, count)  # the rings that were written

    def cut_episodes(self) -> None:
        """As ``ReplayBuffer.cut_episodes``; the transitions whose n-step return the cut completes become
        sampleable."""
        super().cut_episodes()
        self._refresh_priorities(np.arange(self.num_envs), self.cursor.copy(), np.zeros(self.num_envs, np.int64))

    def _refresh_priorities(self, rings: np.ndarray, start: np.ndarray, count: np.ndarray) -> None:
        """After ``count[env]`` slots of each env of ``rings`` were written from ``start[env]`` on, re-derive
        which slots nearby hold a complete transition: the written slots themselves, the ``n_step - 1`` before
        them (whose n-step return may now be complete) and the ``stack`` after them (whose stacks lost a frame).
        A complete one keeps its priority, or gets the largest seen if it is new; every other slot gets 0."""
        cap, back, ahead = self.capacity, self.n_step - 1, self.stack
        envs, slots, new = [], [], []
        for env in rings:
            span = back + count[env] + ahead
            window = np.arange(cap) if span >= cap else (start[env] - back + np.arange(span)) % cap
            envs.append(np.full(len(window), env))
            slots.append(window)
            new.append((window - start[env]) % cap < min(count[env], cap))  # slots written by this add
        if not envs:
            return
        envs, slots, new = np.concatenate(envs), np.concatenate(slots), np.concatenate(new)
        leaves = envs * cap + slots
        old = self.tree.get(leaves)
        current = np.where(new, 0.0, old)  # a rewritten slot's old priority is void
        priorities = np.where(self._ready(envs, slots), np.where(current > 0, current, self.max_priority), 0.0)
        changed = priorities != old
        if changed.any():
            self.tree.update(leaves[changed], priorities[changed])

    def sample(self, batch_size: int, beta: float = 0.4) -> PrioritizedReplayBatch:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta {beta} must be in [0, 1]")
        total = self.tree.total()
        if not total > 0:
            raise ValueError("the replay buffer holds no complete transition to sample yet")
        values = (np.arange(batch_size) + self.rng.random(batch_size)) * (total / batch_size)
        indices = self.tree.find(values)
        weights = (self.tree.min() / self.tree.get(indices)) ** beta
        envs, slots = np.divmod(indices, self.capacity)
        batch = self._gather(envs, slots)
        return PrioritizedReplayBatch(
            **batch._asdict(), weights=self._to(weights.astype(np.float32), self.device), indices=indices
        )

    def update_priorities(self, indices: np.ndarray, errors: np.ndarray | torch.Tensor) -> None:
        """``p = (|error| + eps) ** alpha`` for the sampled ``indices``. A transition that has left the buffer
        since it was sampled (its leaf is 0 now) stays out; a non-finite error leaves its transition's priority
        as it was (the scripts' own check of the loss stops the run, or skips the update)."""
        if isinstance(errors, torch.Tensor):
            errors = errors.detach().cpu().numpy()  # with a GPU, a host synchronisation: the tree is in host memory
        errors = np.asarray(errors, dtype=np.float64).ravel()
        indices = np.asarray(indices, dtype=np.int64).ravel()
        if len(errors) != len(indices):
            raise ValueError(f"{len(indices)} indices but {len(errors)} errors")
        keep = np.isfinite(errors) & (self.tree.get(indices) > 0)
        priorities = (np.abs(errors[keep]) + self.eps) ** self.alpha
        self.tree.update(indices[keep], priorities)
        if len(priorities):
            self.max_priority = max(self.max_priority, float(priorities.max()))
