"""A uint8 replay buffer that stores each frame once and rebuilds frame stacks at sample time.

Each parallel environment writes into its own ring of frames. Slot ``j`` of a ring holds one
84x84 frame; when slot ``j`` was written by a step, it also holds that step's transition:
``obs = frames[j-stack .. j-1]``, ``next_obs = frames[j-stack+1 .. j]``, with the action, the
clipped reward, ``done`` (the learning terminal) and ``end`` (the episode ended here: game over
or time limit). After a ``done`` or an ``end`` the next observation starts a new stack (the
training protocol starts the frame stack afresh after every life loss too), so the new episode
first writes all the frames of its first stack, which are not transitions: a stack never mixes
two episodes (nor two lives).
Writing slot ``j`` invalidates the older transitions at ``j+1 .. j+stack`` whose stacks used it.

The frames live in host memory (a NumPy array) unless ``storage_device`` is given: then they are a
torch tensor on that device (e.g. ``cuda``, 7 GB per 1M transitions of GPU memory), written there
at each ``add`` and gathered there at each ``sample``, so batches never cross the bus. The small
per-transition metadata and the bookkeeping stay in host memory either way. Host-to-GPU copies
go through pinned memory without blocking the host.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
        storage_device: torch.device | str | None = None,
    ) -> None:
        self.stack = observation_shape[0]
        self.frame_shape = tuple(observation_shape[1:])
        self.num_envs = num_envs
        self.capacity = -(-buffer_size // num_envs)  # slots per environment ring
        if self.capacity < self.slots_needed(n_step, self.stack):
            raise ValueError(
                f"--buffer-size {buffer_size} gives {self.capacity} slots per environment with "
                f"--num-envs {num_envs}; need at least {self.slots_needed(n_step, self.stack)}: raise --buffer-size"
            )
        self.device = torch.device(device)
        self.n_step = n_step
        self.gamma = gamma
        self.rng = np.random.default_rng(seed)
        shape = (num_envs, self.capacity)
        self.storage_device = None if storage_device is None else torch.device(storage_device)
        if self.storage_device is None:
            self.frames = np.zeros(shape + self.frame_shape, dtype=np.uint8)  # pages arrive as they are written
        else:
            self.frames = torch.zeros(shape + self.frame_shape, dtype=torch.uint8, device=self.storage_device)
        self.actions = np.zeros(shape, dtype=np.int32)
        self.rewards = np.zeros(shape, dtype=np.float32)
        self.dones = np.zeros(shape, dtype=bool)
        self.ends = np.zeros(shape, dtype=bool)
        self.valid = np.zeros(shape, dtype=bool)
        self.cursor = np.zeros(num_envs, dtype=np.int64)  # next slot to write, per ring
        self.written = np.zeros(num_envs, dtype=np.int64)  # slots ever written, per ring
        self.open = np.zeros(num_envs, dtype=bool)  # the ring's last frames continue an episode

    @staticmethod
    def slots_needed(n_step: int = 1, stack: int = 4) -> int:
        """The fewest slots an environment's ring works with: a frame stack, n steps and the next observation."""
        return stack + n_step + 1

    def __len__(self) -> int:
        return int(self.valid.sum())

    # What a checkpoint holds: the settings (checked on load, never overwritten) and the contents.
    SETTINGS = ("stack", "num_envs", "capacity", "n_step", "gamma")
    ARRAYS = ("frames", "actions", "rewards", "dones", "ends", "valid", "cursor", "written", "open")

    def state_dict(self, frames: bool = True) -> dict[str, Any]:
        """The replay memory as plain data: its settings, its arrays (``frames`` copied to host memory
        where it lives on a GPU; left out with ``frames=False``, for ``frames_written``) and its sampling
        generator's state."""
        state: dict[str, Any] = {name: getattr(self, name) for name in self.SETTINGS}
        for name in self.ARRAYS if frames else [a for a in self.ARRAYS if a != "frames"]:
            value = getattr(self, name)
            state[name] = value.cpu().numpy() if isinstance(value, torch.Tensor) else value.copy()
        state["rng"] = self.rng.bit_generator.state
        return state

    def load_state_dict(self, state: dict[str, Any], frames: bool = True) -> None:
        """Put a ``state_dict`` back (``frames=False``: one without its frames, which ``load_frames_written``
        then puts back); a memory of other settings, shapes or fields is refused (ValueError)."""
        arrays = self.ARRAYS if frames else tuple(a for a in self.ARRAYS if a != "frames")
        expected = {*self.SETTINGS, *arrays, "rng"}
        if set(state) != expected:
            raise ValueError(
                f"replay state has fields {sorted(set(state) - expected)} this buffer lacks and lacks "
                f"{sorted(expected - set(state))}"
            )
        for name in self.SETTINGS:
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"replay {name} is {state[name]} in the checkpoint but {getattr(self, name)} in this run "
                    "(different --buffer-size, --num-envs, --n-step or --gamma?)"
                )
        for name in arrays:
            current, saved = getattr(self, name), np.asarray(state[name])
            if tuple(current.shape) != saved.shape or str(current.dtype).removeprefix("torch.") != str(saved.dtype):
                raise ValueError(
                    f"replay {name} is {saved.dtype}{list(saved.shape)} in the checkpoint but "
                    f"{current.dtype}{list(current.shape)} in this run"
                )
        for name in arrays:
            current = getattr(self, name)
            if isinstance(current, torch.Tensor):
                current.copy_(torch.from_numpy(np.asarray(state[name])))
            else:
                current[...] = state[name]
        self.rng.bit_generator.state = state["rng"]

    def frames_written(self, env: int, start: int, stop: int) -> np.ndarray:
        """Ring ``env``'s frames of written indices ``[start, stop)`` (the ``written``-th frame sits at slot
        ``written % capacity``; the range within the last ``capacity``), as a host array."""
        if not self.written[env] - self.capacity <= start <= stop <= self.written[env]:
            raise ValueError(f"frames {start}..{stop} of ring {env} are not in it (written: {self.written[env]})")
        slots = np.arange(start, stop) % self.capacity
        frames = self.frames[env, self.to_device(slots, self.frames.device) if self.storage_device else slots]
        return frames.cpu().numpy() if isinstance(frames, torch.Tensor) else frames

    def load_frames_written(self, env: int, start: int, frames: np.ndarray) -> None:
        """Put back ``frames_written(env, start, start + len(frames))``; the frames older than the ring's last
        ``capacity`` are skipped (overwritten since)."""
        first = max(start, int(self.written[env]) - self.capacity)
        stop = min(start + len(frames), int(self.written[env]))
        if first >= stop:
            return
        slots = np.arange(first, stop) % self.capacity
        chunk = np.asarray(frames[first - start : stop - start])
        if self.storage_device is None:
            self.frames[env, slots] = chunk
        else:
            self.frames[env, self.to_device(slots, self.storage_device)] = torch.from_numpy(chunk).to(
                self.storage_device
            )

    def cut_episodes(self) -> None:
        """The games in progress are gone (a resumed run starts new ones): their last stored
        transitions become episode ends, which bootstrap like a time limit, and the next ``add``
        starts a new stack."""
        for env in np.flatnonzero(self.open):
            last = (self.cursor[env] - 1) % self.capacity
            self.ends[env, last] = self.valid[env, last]
        self.open[:] = False

    def _write(self, envs: np.ndarray, frames: np.ndarray, transition: tuple | None) -> None:
        """Write ``frames[i]`` at the cursor of ring ``envs[i]`` (distinct rings), with the transition
        arrays (actions, rewards, dones, ends) aligned with ``envs``, or None for a stack's first frames."""
        if len(envs) == 0:
            return
        j = self.cursor[envs]
        cap = self.capacity
        if self.storage_device is None:
            self.frames[envs, j] = frames
        else:
            flat = self.frames.view(-1, *self.frame_shape)
            flat[self.to_device(envs * cap + j, self.storage_device)] = self.to_device(frames, self.storage_device)
        # Older transitions whose stacks included the overwritten slot are gone.
        self.valid[envs[:, None], (j[:, None] + np.arange(1, self.stack + 1)) % cap] = False
        if transition is None:
            self.valid[envs, j] = False
            self.ends[envs, j] = False
            self.dones[envs, j] = False
        else:
            actions, rewards, dones, ends = transition
            self.actions[envs, j] = actions
            self.rewards[envs, j] = rewards
            self.dones[envs, j] = dones
            self.ends[envs, j] = ends
            self.valid[envs, j] = True
        self.cursor[envs] = (j + 1) % cap
        self.written[envs] += 1

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
        episode ended (game over or time limit). After either, the next ``obs`` of that env starts anew:
        its frames are all stored, whatever they are (the first frame repeated, or zeros before it).
        ``mask``: which envs made a real transition (False on an autoreset step)."""
        envs = np.arange(self.num_envs) if mask is None else np.flatnonzero(mask)
        if len(envs) == 0:
            return
        obs, next_obs = np.asarray(obs), np.asarray(next_obs)
        # a terminal's next observation may already start the next life's stack (zero-filled, as Dopamine's agent
        # starts it): only its newest frame is stored, and the next add writes the new stack's frames
        continuing = envs[~np.asarray(dones, dtype=bool)[envs]]
        if not np.array_equal(obs[continuing, 1:], next_obs[continuing, :-1]):
            raise ValueError(
                "observations are not frame stacks (next_obs[1:] must continue obs); "
                "the replay buffer stores each frame once and needs stacked frames"
            )
        ends = np.asarray(ends, dtype=bool)[envs]
        starting = envs[~self.open[envs]]  # a new episode: its first stack's frames come first
        for k in range(self.stack):
            self._write(starting, obs[starting, k], None)
        transition = (np.asarray(actions)[envs], np.asarray(rewards)[envs], np.asarray(dones, dtype=bool)[envs], ends)
        self._write(envs, next_obs[envs, -1], transition)
        self.open[envs] = ~(ends | transition[2])

    def complete(self, env: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """Which of the transitions at (env, slot) have a complete n-step return (an episode boundary or n steps
        stored): the ones a sampler may draw (``sample``'s, or a prioritized one's over this buffer)."""
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
            keep = self.complete(e, s)
            envs = np.concatenate([envs, e[keep]])
            slots = np.concatenate([slots, s[keep]])
            if len(envs) >= batch_size:
                break
        else:
            raise ValueError("the replay buffer holds no complete transition to sample yet")
        envs, slots = envs[:batch_size], slots[:batch_size]
        return self.gather(envs, slots)

    def gather(self, envs: np.ndarray, slots: np.ndarray) -> ReplayBatch:
        """The batch of the transitions at (envs, slots), drawn by ``sample`` or by another sampler."""
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
        if self.n_step == 1:  # obs and next_obs share all frames but one: gather stack + 1 once
            window = (slots[:, None] + np.arange(-stack, 1)) % cap
            split = (slice(0, stack), slice(1, stack + 1))
        else:
            window = np.concatenate(
                [(slots[:, None] + np.arange(-stack, 0)) % cap, (last[:, None] + np.arange(-stack + 1, 1)) % cap], 1
            )
            split = (slice(0, stack), slice(stack, 2 * stack))
        actions = self.actions[envs, slots].astype(np.int64)
        if self.storage_device is None and self.device.type == "cpu":
            frames = self.frames.reshape(-1, *self.frame_shape)[envs[:, None] * cap + window]
            return ReplayBatch(
                observations=torch.from_numpy(np.ascontiguousarray(frames[:, split[0]])),
                actions=torch.from_numpy(actions),
                rewards=torch.from_numpy(rewards),
                next_observations=torch.from_numpy(np.ascontiguousarray(frames[:, split[1]])),
                dones=torch.from_numpy(dones.astype(np.float32)),
                discounts=torch.from_numpy(discounts),
            )
        if self.storage_device is None:  # host frames to the device: one pinned copy of the stack + 1 frames
            frames = self.to_device(
                self.frames.reshape(-1, *self.frame_shape)[envs[:, None] * cap + window], self.device
            )
        else:  # gathered where they live
            index = self.to_device(envs[:, None] * cap + window, self.storage_device)
            frames = self.frames.view(-1, *self.frame_shape)[index].to(self.device)
        metadata = np.stack([actions, rewards, dones, discounts]).astype(np.float32)  # one copy; actions are small
        metadata = self.to_device(metadata, self.device)
        return ReplayBatch(
            observations=frames[:, split[0]].contiguous(),
            actions=metadata[0].long(),
            rewards=metadata[1],
            next_observations=frames[:, split[1]].contiguous(),
            dones=metadata[2],
            discounts=metadata[3],
        )

    @staticmethod
    def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
        """``array`` as a tensor on ``device``; to a GPU through pinned memory, without blocking the host"""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if device.type == "cuda":
            return tensor.pin_memory().to(device, non_blocking=True)
        return tensor.to(device)
