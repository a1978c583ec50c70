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

The frames live in host memory, raw in a NumPy array, or with ``compress=True`` each compressed on its own
(``CompressedFrames``: zstandard level 1, 0.2-1.2 KB an Atari frame instead of 7 KB, decompressed at sampling into
exactly the frames stored; not the default: it cost 4-10% of the scripts' speed on a 2-core CPU), unless ``storage_device`` is given: then they are a raw torch tensor on that device (e.g.
``cuda``, 7 GB per 1M transitions of GPU memory), written there at each ``add`` and gathered there at each
``sample``, so batches never cross the bus. The small per-transition metadata and the bookkeeping stay in host memory
either way. Host-to-GPU copies go through pinned memory without blocking the host.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
import zstandard

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
    """A transition's bytes with its frame raw (``compress=False``, or on a GPU)."""
    return int(np.prod(frame_shape)) + METADATA_BYTES


def blob_bytes(blob: bytes) -> int:
    """The memory a compressed frame takes: the bytes object (header and data, ``sys.getsizeof``) as Python's and
    the C library's allocators round it (to 16 bytes; 8 more of the C allocator's header past pymalloc's 512)."""
    size = sys.getsizeof(blob)
    return -(-size // 16) * 16 + (8 if size > 512 else 0)


class CompressedFrames:
    """Frames held in host memory, each compressed on its own with zstandard at level 1, indexed as the raw
    array's flat view ``(count, *frame_shape)``. An Atari frame is mostly flat: 84x84 bytes take about 170 on Pong,
    300 on Breakout, 530 on Seaquest and 1,200 on MsPacman (benchmarks/RESULTS.md). ``get`` gives back exactly the
    frames ``put`` stored. Slots never written hold zeros (one shared compressed blob)."""

    POINTER_BYTES = 8  # each slot's reference in the object array

    def __init__(self, count: int, frame_shape: tuple[int, ...]) -> None:
        self.frame_shape = tuple(frame_shape)
        self.compressor = zstandard.ZstdCompressor(level=1)
        self.decompressor = zstandard.ZstdDecompressor()
        self.zeros = self.compressor.compress(bytes(int(np.prod(frame_shape))))
        self.blobs = np.empty(count, dtype=object)
        self.blobs.fill(self.zeros)  # one object shared (np.full would copy it)
        self.written_bytes = 0  # what the blobs written take (``blob_bytes``), kept as they are replaced

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.blobs), *self.frame_shape)

    dtype = np.dtype(np.uint8)

    def put(self, index: np.ndarray, frames: np.ndarray) -> None:
        """Store ``frames[i]`` at flat slot ``index[i]`` (distinct slots)."""
        frames = np.ascontiguousarray(frames, dtype=np.uint8)
        for i, frame in zip(np.asarray(index).ravel(), frames.reshape(-1, *self.frame_shape), strict=True):
            old = self.blobs[i]
            if old is not self.zeros:
                self.written_bytes -= blob_bytes(old)
            # an exact-size copy: the compressor's buffer, allocated for 7 KB and shrunk, would leave a hole of
            # the rest behind each blob in the heap (5.7 KB a frame resident instead of 0.3 on Breakout)
            blob = bytes(memoryview(self.compressor.compress(frame.data)))
            self.blobs[i] = blob
            self.written_bytes += blob_bytes(blob)

    def get(self, index: np.ndarray, decompressor: zstandard.ZstdDecompressor | None = None) -> np.ndarray:
        """The frames at flat slots ``index`` (any shape), as a uint8 array of shape ``index.shape + frame_shape``.
        ``decompressor``: another thread's own (one must not be used by two threads at once)."""
        index = np.asarray(index)
        data = b"".join(map((decompressor or self.decompressor).decompress, self.blobs[index.ravel()]))
        return np.frombuffer(data, dtype=np.uint8).reshape(*index.shape, *self.frame_shape)

    def nbytes(self) -> int:
        """The memory the frames take: the blobs written, the shared blob of zeros and the slots' references."""
        return self.written_bytes + blob_bytes(self.zeros) + self.POINTER_BYTES * len(self.blobs)

    # A game's later frames may hold more than random play's first ones show (a trained agent gets further).
    ESTIMATE_MARGIN = 1.25

    @classmethod
    def estimate(cls, frames: np.ndarray) -> int:
        """Bytes a transition, for a memory check before the memory exists: the largest of these sample frames
        (e.g. ``envs.random_play_frames``) compressed, with a margin, its reference and the transition's metadata."""
        compressor = zstandard.ZstdCompressor(level=1)
        largest = max(blob_bytes(compressor.compress(np.ascontiguousarray(frame).data)) for frame in frames)
        return int(largest * cls.ESTIMATE_MARGIN) + cls.POINTER_BYTES + METADATA_BYTES


class FramesInFlight:
    """Compressed frames being decompressed by a background thread, which the thread that needs them helps finish:
    ``result`` decompresses the ones not yet taken (and again any the background thread took but has not finished),
    so it never waits on that thread, which may be slow to get a core."""

    def __init__(self, frames: CompressedFrames, index: np.ndarray) -> None:
        self.blobs = list(frames.blobs[index.ravel()])  # taken now: bytes objects, which nothing changes
        self.shape = (*index.shape, *frames.frame_shape)
        self.parts: list[bytes | None] = [None] * len(self.blobs)
        self.todo = iter(range(len(self.blobs)))  # shared by both threads: next() is atomic under the GIL

    def work(self, decompressor: zstandard.ZstdDecompressor) -> None:
        for k in self.todo:
            self.parts[k] = decompressor.decompress(self.blobs[k])

    def result(self, decompressor: zstandard.ZstdDecompressor) -> np.ndarray:
        self.work(decompressor)
        for k, part in enumerate(self.parts):
            if part is None:  # taken by the background thread, not finished: the same bytes, here
                self.parts[k] = decompressor.decompress(self.blobs[k])
        return np.frombuffer(b"".join(self.parts), dtype=np.uint8).reshape(self.shape)


def lower_this_threads_priority() -> None:
    """Linux: this thread runs at the lowest priority (nice 19), on the cores the loop leaves idle; elsewhere,
    where nice is per process, nothing."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class PreparedBatch(NamedTuple):
    """A batch drawn ahead of ``sample`` with a copy of the sampling generator, its frames being decompressed in
    the background: ``sample`` takes it, and the generator's state after its draws, if nothing was stored since."""

    version: int
    batch_size: int
    rng: np.random.Generator
    parts: tuple
    frames: FramesInFlight


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
        compress: bool = False,
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
        self.frames: CompressedFrames | np.ndarray | torch.Tensor  # (num_envs, capacity, H, W) or its flat view
        if self.storage_device is not None:
            self.frames = torch.zeros(shape + self.frame_shape, dtype=torch.uint8, device=self.storage_device)
        elif compress:
            self.frames = CompressedFrames(num_envs * self.capacity, self.frame_shape)
        else:
            self.frames = np.zeros(shape + self.frame_shape, dtype=np.uint8)  # pages arrive as they are written
        self.actions = np.zeros(shape, dtype=np.int32)
        self.rewards = np.zeros(shape, dtype=np.float32)
        self.dones = np.zeros(shape, dtype=bool)
        self.ends = np.zeros(shape, dtype=bool)
        self.valid = np.zeros(shape, dtype=bool)
        self.cursor = np.zeros(num_envs, dtype=np.int64)  # next slot to write, per ring
        self.written = np.zeros(num_envs, dtype=np.int64)  # slots ever written, per ring
        self.open = np.zeros(num_envs, dtype=bool)  # the ring's last frames continue an episode
        # Drawing the next batch ahead (compressed frames only): its frames decompress in a thread while the loop
        # acts and updates. Only when the next call is foreseen to be ``sample``: the loop's cadence of adds and
        # samples, as last seen. Whatever is prepared, the batches are those ``sample`` would draw then.
        self.version = 0  # bumped by every change of the contents: a prepared batch belongs to one version
        self.prepared: PreparedBatch | None = None
        self.adds_since_sample, self.samples_since_add = 0, 0
        self.adds_between_samples: int | None = None  # the loop's cadence, as last seen
        self.samples_in_a_row: int | None = None
        self.prepared_size = 32  # the batch size to prepare, as the last sample asked
        self.prepared_count = {"taken": 0, "discarded": 0}  # batches prepared ahead: how the cadence's guesses went
        self.background: ThreadPoolExecutor | None = None

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
            if isinstance(value, CompressedFrames):  # raw, as every storage gives them
                value = value.get(np.arange(len(value.blobs))).reshape(self.frames_shape)
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
            shape = self.frames_shape if name == "frames" else tuple(current.shape)
            if shape != saved.shape or str(current.dtype).removeprefix("torch.") != str(saved.dtype):
                raise ValueError(
                    f"replay {name} is {saved.dtype}{list(saved.shape)} in the checkpoint but "
                    f"{current.dtype}{list(shape)} in this run"
                )
        for name in arrays:
            current = getattr(self, name)
            if isinstance(current, CompressedFrames):
                current.put(np.arange(len(current.blobs)), np.asarray(state[name]))
            elif isinstance(current, torch.Tensor):
                current.copy_(torch.from_numpy(np.asarray(state[name])))
            else:
                current[...] = state[name]
        self.rng.bit_generator.state = state["rng"]
        self.version += 1

    def frames_written(self, env: int, start: int, stop: int) -> np.ndarray:
        """Ring ``env``'s frames of written indices ``[start, stop)`` (the ``written``-th frame sits at slot
        ``written % capacity``; the range within the last ``capacity``), as a host array."""
        if not self.written[env] - self.capacity <= start <= stop <= self.written[env]:
            raise ValueError(f"frames {start}..{stop} of ring {env} are not in it (written: {self.written[env]})")
        slots = np.arange(start, stop) % self.capacity
        return self.host_frames(env * self.capacity + slots)

    def load_frames_written(self, env: int, start: int, frames: np.ndarray) -> None:
        """Put back ``frames_written(env, start, start + len(frames))``; the frames older than the ring's last
        ``capacity`` are skipped (overwritten since)."""
        first = max(start, int(self.written[env]) - self.capacity)
        stop = min(start + len(frames), int(self.written[env]))
        if first >= stop:
            return
        slots = np.arange(first, stop) % self.capacity
        self.put_frames(env * self.capacity + slots, np.asarray(frames[first - start : stop - start]))
        self.version += 1

    @property
    def frames_shape(self) -> tuple[int, ...]:
        return (self.num_envs, self.capacity, *self.frame_shape)

    def put_frames(self, index: np.ndarray, frames: np.ndarray) -> None:
        """Store ``frames[i]`` at flat slot ``index[i]`` (ring ``env``'s slot ``j`` is ``env * capacity + j``)."""
        if isinstance(self.frames, CompressedFrames):
            self.frames.put(index, frames)
        elif isinstance(self.frames, torch.Tensor):
            flat = self.frames.view(-1, *self.frame_shape)
            flat[self.to_device(index, self.storage_device)] = self.to_device(frames, self.storage_device)
        else:
            self.frames.reshape(-1, *self.frame_shape)[index] = frames

    def host_frames(self, index: np.ndarray) -> np.ndarray:
        """The frames at flat slots ``index`` (any shape) as a host array of shape ``index.shape + frame_shape``."""
        if isinstance(self.frames, CompressedFrames):
            return self.frames.get(index)
        if isinstance(self.frames, torch.Tensor):
            return self.frames.view(-1, *self.frame_shape)[self.to_device(index, self.storage_device)].cpu().numpy()
        return self.frames.reshape(-1, *self.frame_shape)[index]

    def nbytes(self) -> int:
        """The memory the stored transitions take where their frames live: frames and per-transition metadata."""
        frames = self.frames.nbytes() if isinstance(self.frames, CompressedFrames) else self.frames.nbytes
        return int(frames) + METADATA_BYTES * self.num_envs * self.capacity

    def memory(self) -> dict[str, Any]:
        """What the memory takes now, measured on the frames it holds: bytes per filled slot (each slot holds a
        frame and, but for a stack's first frames, a transition: its frame, reference where compressed, metadata),
        and that figure for the whole memory once full."""
        filled = int(np.minimum(self.written, self.capacity).sum())
        if isinstance(self.frames, CompressedFrames):
            where, frame_bytes = "host, compressed", self.frames.written_bytes + CompressedFrames.POINTER_BYTES * filled
        else:
            where = "host, raw" if self.storage_device is None else f"{self.storage_device}, raw"
            frame_bytes = int(np.prod(self.frame_shape)) * filled
        per_slot = (frame_bytes + METADATA_BYTES * filled) / filled if filled else None
        return {
            "frames": where,
            "slots_filled": filled,
            "bytes_per_transition": None if per_slot is None else round(per_slot, 1),
            "full_memory_bytes": None if per_slot is None else round(per_slot * self.num_envs * self.capacity),
        }

    def cut_episodes(self) -> None:
        """The games in progress are gone (a resumed run starts new ones): their last stored
        transitions become episode ends, which bootstrap like a time limit, and the next ``add``
        starts a new stack."""
        for env in np.flatnonzero(self.open):
            last = (self.cursor[env] - 1) % self.capacity
            self.ends[env, last] = self.valid[env, last]
        self.open[:] = False
        self.version += 1

    def _write(self, envs: np.ndarray, frames: np.ndarray, transition: tuple | None) -> None:
        """Write ``frames[i]`` at the cursor of ring ``envs[i]`` (distinct rings), with the transition
        arrays (actions, rewards, dones, ends) aligned with ``envs``, or None for a stack's first frames."""
        if len(envs) == 0:
            return
        j = self.cursor[envs]
        cap = self.capacity
        self.version += 1
        self.put_frames(envs * cap + j, frames)
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
        if self.samples_since_add:
            self.samples_in_a_row, self.adds_since_sample, self.samples_since_add = self.samples_since_add, 0, 0
        self.adds_since_sample += 1
        if self.adds_since_sample == self.adds_between_samples:  # a sample comes next
            self.prepare(self.prepared_size)

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
        """A batch of ``batch_size`` transitions drawn uniformly among the complete ones."""
        if self.samples_since_add == 0:
            self.adds_between_samples = self.adds_since_sample
        self.samples_since_add += 1
        self.prepared_size = batch_size
        prepared, self.prepared = self.prepared, None
        if prepared is not None and prepared.version == self.version and prepared.batch_size == batch_size:
            self.rng = prepared.rng  # the generator as these draws left it
            batch = self.assemble(*prepared.parts, frames=prepared.frames.result(self.frames.decompressor))
            self.prepared_count["taken"] += 1
        else:
            self.prepared_count["discarded"] += prepared is not None
            batch = self.gather(*self.draw(batch_size, self.rng))
        if self.samples_in_a_row is not None and self.samples_since_add < self.samples_in_a_row:
            self.prepare(batch_size)  # another sample comes next: its frames decompress during this update
        return batch

    def prepare(self, batch_size: int) -> None:
        """Draw the next ``sample(batch_size)``'s batch now, with a copy of the generator, and start decompressing
        its frames in a background thread (compressed frames only; nothing to draw from yet: nothing)."""
        if not isinstance(self.frames, CompressedFrames) or len(self) == 0:
            return
        rng = copy.deepcopy(self.rng)
        try:
            parts = self.locate(*self.draw(batch_size, rng))
        except ValueError:  # no complete transition yet
            return
        if self.background is None:  # one thread, at the lowest priority: it uses idle cores, never the loop's
            self.background = ThreadPoolExecutor(1, "replay", initializer=lower_this_threads_priority)
            self.background_decompressor = zstandard.ZstdDecompressor()  # that thread's own
        frames = FramesInFlight(self.frames, parts[0])
        self.background.submit(frames.work, self.background_decompressor)
        if self.prepared is not None:
            self.prepared_count["discarded"] += 1
        self.prepared = PreparedBatch(self.version, batch_size, rng, parts, frames)

    def draw(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """The (env, slot) of ``batch_size`` complete transitions drawn uniformly with ``rng``."""
        filled = np.minimum(self.written, self.capacity)
        if len(self) == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        probabilities = filled / filled.sum()
        envs = np.empty(0, dtype=np.int64)
        slots = np.empty(0, dtype=np.int64)
        for _ in range(1000):
            count = 2 * batch_size
            e = rng.choice(self.num_envs, size=count, p=probabilities)
            s = (rng.random(count) * filled[e]).astype(np.int64)
            keep = self.complete(e, s)
            envs = np.concatenate([envs, e[keep]])
            slots = np.concatenate([slots, s[keep]])
            if len(envs) >= batch_size:
                break
        else:
            raise ValueError("the replay buffer holds no complete transition to sample yet")
        return envs[:batch_size], slots[:batch_size]

    def gather(self, envs: np.ndarray, slots: np.ndarray) -> ReplayBatch:
        """The batch of the transitions at (envs, slots), drawn by ``sample`` or by another sampler."""
        return self.assemble(*self.locate(envs, slots))

    def locate(self, envs: np.ndarray, slots: np.ndarray) -> tuple:
        """Where the frames of the transitions at (envs, slots) are (flat slots of each one's window of frames, and
        how observation and next observation split it), with their actions, n-step rewards, dones and discounts."""
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
        return envs[:, None] * cap + window, split, actions, rewards, dones, discounts

    def assemble(
        self,
        index: np.ndarray,
        split: tuple[slice, slice],
        actions: np.ndarray,
        rewards: np.ndarray,
        dones: np.ndarray,
        discounts: np.ndarray,
        frames: np.ndarray | None = None,
    ) -> ReplayBatch:
        """The batch ``locate`` describes, on the training device (``frames``: the host frames at ``index``, already
        read)."""
        if self.storage_device is None and self.device.type == "cpu":
            frames = self.host_frames(index) if frames is None else frames
            return ReplayBatch(
                observations=torch.from_numpy(np.ascontiguousarray(frames[:, split[0]])),
                actions=torch.from_numpy(actions),
                rewards=torch.from_numpy(rewards),
                next_observations=torch.from_numpy(np.ascontiguousarray(frames[:, split[1]])),
                dones=torch.from_numpy(dones.astype(np.float32)),
                discounts=torch.from_numpy(discounts),
            )
        if self.storage_device is None:  # host frames to the device: one pinned copy of the stack + 1 frames
            frames = self.to_device(self.host_frames(index) if frames is None else frames, self.device)
        else:  # gathered where they live
            frames = self.frames.view(-1, *self.frame_shape)[self.to_device(index, self.storage_device)].to(self.device)
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
