"""A uint8 replay buffer that stores each frame once and rebuilds frame stacks at sample time.

Each parallel environment writes into its own ring of frames. Slot ``j`` of a ring holds one
84x84 frame; when slot ``j`` was written by a step, it also holds that step's transition:
``obs = frames[j-stack .. j-1]``, ``next_obs = frames[j-stack+1 .. j]``, with the action, the
clipped reward, ``done`` (the learning terminal) and ``end`` (the episode ended here: game over
or time limit, so the next observation starts a new stack). A new episode first writes all the
frames of its first stack, which are not transitions, so a stack never mixes two episodes.
Writing slot ``j`` invalidates the older transitions at ``j+1 .. j+stack`` whose stacks used it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

# Per stored transition besides the frame: action (int32), reward (float32), done, end, valid.
METADATA_BYTES = 4 + 4 + 1 + 1 + 1


class ReplayBatch(NamedTuple):
    observations: torch.Tensor  # uint8 (B, stack, H, W)
    actions: torch.Tensor  # int64 (B,)
    rewards: torch.Tensor  # float32 (B,), n-step discounted sum when n_step > 1
    next_observations: torch.Tensor  # uint8 (B, stack, H, W)
    dones: torch.Tensor  # float32 (B,), 1.0 where the return ended at a learning terminal
    discounts: torch.Tensor  # float32 (B,), gamma ** steps used to bootstrap, 0 after a terminal


def bytes_per_transition(frame_shape: tuple[int, ...] = (84, 84)) -> int:
    return int(np.prod(frame_shape)) + METADATA_BYTES


class ReplayBuffer:
    def __init__(
        self,
        buffer_size: int,
        num_envs: int,
        observation_shape: tuple[int, ...] = (4, 84, 84),
        device: torch.device | str = "cpu",
        n_step: int = 1,
        gamma: float = 0.99,
        seed: int | None = None,
    ) -> None:
        self.stack = observation_shape[0]
        self.frame_shape = tuple(observation_shape[1:])
        self.num_envs = num_envs
        self.capacity = -(-buffer_size // num_envs)  # slots per environment ring
        if self.capacity < self.stack + n_step + 1:
            raise ValueError(
                f"--buffer-size {buffer_size} gives {self.capacity} slots per environment with "
                f"--num-envs {num_envs}; need at least {self.stack + n_step + 1}: raise --buffer-size"
            )
        self.device = torch.device(device)
        self.n_step = n_step
        self.gamma = gamma
        self.rng = np.random.default_rng(seed)
        shape = (num_envs, self.capacity)
        self.frames = np.zeros(shape + self.frame_shape, dtype=np.uint8)
        self.actions = np.zeros(shape, dtype=np.int32)
        self.rewards = np.zeros(shape, dtype=np.float32)
        self.dones = np.zeros(shape, dtype=bool)
        self.ends = np.zeros(shape, dtype=bool)
        self.valid = np.zeros(shape, dtype=bool)
        self.cursor = np.zeros(num_envs, dtype=np.int64)  # next slot to write, per ring
        self.written = np.zeros(num_envs, dtype=np.int64)  # slots ever written, per ring
        self.open = np.zeros(num_envs, dtype=bool)  # the ring's last frames continue an episode
        self.pin = self.device.type == "cuda"

    def __len__(self) -> int:
        return int(self.valid.sum())

    def cut_episodes(self) -> None:
        """The games in progress are gone (a resumed run starts new ones): their last stored
        transitions become episode ends, which bootstrap like a time limit, and the next ``add``
        starts a new stack."""
        for env in np.flatnonzero(self.open):
            last = (self.cursor[env] - 1) % self.capacity
            self.ends[env, last] = self.valid[env, last]
        self.open[:] = False

    def _write(self, env: int, frame: np.ndarray, transition: tuple | None) -> None:
        j = self.cursor[env]
        cap = self.capacity
        self.frames[env, j] = frame
        # Older transitions whose stacks included the overwritten slot are gone.
        self.valid[env, (j + np.arange(1, self.stack + 1)) % cap] = False
        if transition is None:
            self.valid[env, j] = False
            self.ends[env, j] = False
            self.dones[env, j] = False
        else:
            action, reward, done, end = transition
            self.actions[env, j] = action
            self.rewards[env, j] = reward
            self.dones[env, j] = done
            self.ends[env, j] = end
            self.valid[env, j] = True
        self.cursor[env] = (j + 1) % cap
        self.written[env] += 1

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
        """Store one vector step. ``dones``: learning terminal (never a time limit). ``ends``: the
        episode ended (game over or time limit), so the next ``obs`` of that env starts anew.
        ``mask``: which envs made a real transition (False on an autoreset step)."""
        envs = range(self.num_envs) if mask is None else np.flatnonzero(mask)
        for env in envs:
            if not np.array_equal(obs[env, 1:], next_obs[env, :-1]):
                raise ValueError(
                    "observations are not frame stacks (next_obs[1:] must continue obs); "
                    "the replay buffer stores each frame once and needs stacked frames"
                )
            if not self.open[env]:
                for frame in obs[env]:
                    self._write(env, frame, None)
            self._write(
                env,
                next_obs[env, -1],
                (actions[env], rewards[env], bool(dones[env]), bool(ends[env])),
            )
            self.open[env] = not ends[env]

    def _ready(self, env: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """Transitions whose n-step return is complete: an episode boundary or n steps stored."""
        if self.n_step == 1:
            return self.valid[env, slot]
        ok = self.valid[env, slot].copy()
        stopped = self.dones[env, slot] | self.ends[env, slot]
        for k in range(1, self.n_step):
            later = (slot + k) % self.capacity
            # The k-th next slot must be newer than the transition and already written.
            age = (self.cursor[env] - 1 - slot) % self.capacity
            ok &= stopped | (age >= k)
            stopped = stopped | self.dones[env, later] | self.ends[env, later]
        return ok

    def sample(self, batch_size: int) -> ReplayBatch:
        filled = np.minimum(self.written, self.capacity)
        if len(self) == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        probabilities = filled / filled.sum()
        envs = np.empty(0, dtype=np.int64)
        slots = np.empty(0, dtype=np.int64)
        for _ in range(1000):
            count = 2 * batch_size
            e = self.rng.choice(self.num_envs, size=count, p=probabilities)
            s = (self.rng.random(count) * filled[e]).astype(np.int64)
            keep = self._ready(e, s)
            envs = np.concatenate([envs, e[keep]])
            slots = np.concatenate([slots, s[keep]])
            if len(envs) >= batch_size:
                break
        else:
            raise ValueError("the replay buffer holds no complete transition to sample yet")
        envs, slots = envs[:batch_size], slots[:batch_size]
        return self._gather(envs, slots)

    def _gather(self, envs: np.ndarray, slots: np.ndarray) -> ReplayBatch:
        cap, stack = self.capacity, self.stack
        rewards = self.rewards[envs, slots].astype(np.float32)
        dones = self.dones[envs, slots].copy()
        last = slots.copy()  # slot of the newest frame of next_obs
        discounts = np.full(len(slots), self.gamma, dtype=np.float32)
        stopped = dones | self.ends[envs, slots]
        for k in range(1, self.n_step):
            later = (slots + k) % cap
            go = ~stopped
            rewards[go] += self.gamma**k * self.rewards[envs[go], later[go]]
            dones[go] = self.dones[envs[go], later[go]]
            last[go] = later[go]
            discounts[go] *= self.gamma
            stopped = stopped | self.dones[envs, later] | self.ends[envs, later]
        discounts[dones] = 0.0
        if self.n_step == 1:
            window = self.frames[envs[:, None], (slots[:, None] + np.arange(-stack, 1)) % cap]
            obs, next_obs = window[:, :-1], window[:, 1:]
        else:
            obs = self.frames[envs[:, None], (slots[:, None] + np.arange(-stack, 0)) % cap]
            next_obs = self.frames[envs[:, None], (last[:, None] + np.arange(-stack + 1, 1)) % cap]
        return ReplayBatch(
            observations=self._to_device(np.ascontiguousarray(obs)),
            actions=self._to_device(self.actions[envs, slots].astype(np.int64)),
            rewards=self._to_device(rewards),
            next_observations=self._to_device(np.ascontiguousarray(next_obs)),
            dones=self._to_device(dones.astype(np.float32)),
            discounts=self._to_device(discounts),
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.pin:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)
