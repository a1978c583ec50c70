"""Replay exactness: every sampled transition is one the environments really produced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from cleanrl_utils.buffer import CompressedFrames, FramesInFlight, ReplayBuffer, blob_bytes, bytes_per_transition
from cleanrl_utils.envs import TrainEnvs

STACK, FRAME = 4, (5, 7)


class RandomStreams:
    """Several environments emitting random frames with random terminations, truncations and
    life losses, under next-step autoreset, with the ground truth of every transition. As in the
    training protocol, the step after a life loss is not a transition (the game presses FIRE) and
    returns a fresh stack."""

    def __init__(self, num_envs: int, seed: int, p_term=0.04, p_trunc=0.03, p_life=0.05):
        self.rng = np.random.default_rng(seed)
        self.num_envs = num_envs
        self.p = (p_term, p_trunc, p_life)
        self.obs = np.stack([self._reset_stack() for _ in range(num_envs)])
        self.pending = np.zeros(num_envs, dtype=bool)
        self.history: list[list[dict]] = [[] for _ in range(num_envs)]  # per env, in order

    def _reset_stack(self) -> np.ndarray:
        return self.rng.integers(0, 256, (STACK, *FRAME), dtype=np.uint8)

    def step(self, actions: np.ndarray):
        next_obs = np.empty_like(self.obs)
        rewards = self.rng.normal(size=self.num_envs).astype(np.float32)
        dones = np.zeros(self.num_envs, dtype=bool)
        ends = np.zeros(self.num_envs, dtype=bool)
        mask = ~self.pending
        for e in range(self.num_envs):
            if self.pending[e]:  # autoreset or forced step: a fresh stack, not a transition
                next_obs[e] = self._reset_stack()
                continue
            frame = self.rng.integers(0, 256, FRAME, dtype=np.uint8)
            next_obs[e] = np.concatenate([self.obs[e, 1:], frame[None]])
            u = self.rng.random()
            terminated = u < self.p[0]
            truncated = self.p[0] <= u < self.p[0] + self.p[1]
            life_lost = self.rng.random() < self.p[2]
            dones[e] = terminated or life_lost
            ends[e] = terminated or truncated
            self.history[e].append(
                {
                    "obs": self.obs[e].copy(),
                    "action": int(actions[e]),
                    "reward": float(rewards[e]),
                    "next_obs": next_obs[e].copy(),
                    "done": bool(dones[e]),
                    "end": bool(ends[e]),
                }
            )
        self.pending = ends | dones
        return next_obs, rewards, dones, ends, mask


def key(obs, action, reward, next_obs, done, end=None) -> tuple:
    return (obs.tobytes(), int(action), round(float(reward), 5), next_obs.tobytes(), bool(done))


def fill(buffer: ReplayBuffer, streams: RandomStreams, steps: int, actions_rng) -> None:
    for _ in range(steps):
        actions = actions_rng.integers(0, 6, streams.num_envs)
        obs = streams.obs
        next_obs, rewards, dones, ends, mask = streams.step(actions)
        buffer.add(obs, next_obs, actions, rewards, dones, ends, mask)
        streams.obs = next_obs


def sampled_keys(buffer: ReplayBuffer, draws: int, batch: int = 64) -> list[tuple]:
    keys = []
    for _ in range(draws):
        b = buffer.sample(batch)
        for i in range(batch):
            keys.append(
                key(
                    b.observations[i].numpy(),
                    b.actions[i].item(),
                    b.rewards[i].item(),
                    b.next_observations[i].numpy(),
                    b.dones[i].item() == 1.0,
                )
            )
    return keys


@pytest.mark.parametrize("compress", [True, False], ids=["compressed", "raw"])
@pytest.mark.parametrize("num_envs,buffer_size", [(1, 10_000), (3, 10_000), (4, 240), (5, 103)])
def test_random_streams_are_sampled_byte_exact(num_envs, buffer_size, compress):
    streams = RandomStreams(num_envs, seed=num_envs)
    buffer = ReplayBuffer(buffer_size, num_envs, (STACK, *FRAME), seed=0, compress=compress)
    rng = np.random.default_rng(1)
    truth: set[tuple] = set()
    for _ in range(6):
        fill(buffer, streams, 150, rng)
        truth = {key(**t) for h in streams.history for t in h}
        for k in sampled_keys(buffer, 20):
            # byte-equal obs and next obs, same action, reward and learning terminal
            assert k in truth
    if buffer_size >= 10_000:  # nothing evicted: every stored transition must be reachable
        seen = set(sampled_keys(buffer, 400))
        assert seen == truth
        assert len(buffer) == len(truth)
    else:  # the newest transitions of every env are still there after wrap-around: 4 of them take at
        # most 4 * (stack + 1) = 20 slots (each may start a new stack), and the rings have 21 or more
        seen = set(sampled_keys(buffer, 300))
        recent = {key(**t) for h in streams.history for t in h[-4:]}
        assert recent <= seen


def test_dones_are_learning_terminals_never_truncations():
    streams = RandomStreams(2, seed=7, p_term=0.0, p_trunc=0.1, p_life=0.0)
    buffer = ReplayBuffer(10_000, 2, (STACK, *FRAME), seed=0)
    fill(buffer, streams, 300, np.random.default_rng(0))
    batch = buffer.sample(2000)
    assert batch.dones.sum().item() == 0  # truncations only: nothing is terminal
    assert (batch.discounts == 0.99).all()  # and every transition bootstraps
    truncated = {key(**t) for h in streams.history for t in h if t["end"]}
    assert truncated  # truncated transitions bootstrap from their real final observation
    assert truncated <= set(sampled_keys(buffer, 200))


def naive_n_step(history: list[dict], n: int, gamma: float) -> dict[bytes, tuple]:
    """Loops in float64: n-step return, bootstrap observation, terminal and discount."""
    expected = {}
    for i, t in enumerate(history):
        ret, discount, last = 0.0, 1.0, None
        for k in range(n):
            if i + k >= len(history):
                last = None  # incomplete: the buffer must not sample it yet
                break
            step = history[i + k]
            ret += discount * step["reward"]
            discount *= gamma
            last = step
            if step["done"] or step["end"]:
                break
        if last is None:
            continue
        expected[t["obs"].tobytes() + bytes([t["action"]])] = (
            ret,
            last["next_obs"].tobytes(),
            last["done"],
            0.0 if last["done"] else discount,
        )
    return expected


@pytest.mark.parametrize("n_step", [1, 3])
def test_n_step_returns_match_a_naive_computation(n_step):
    gamma = 0.9
    streams = RandomStreams(3, seed=11, p_term=0.08, p_trunc=0.05, p_life=0.1)
    buffer = ReplayBuffer(10_000, 3, (STACK, *FRAME), n_step=n_step, gamma=gamma, seed=0)
    fill(buffer, streams, 200, np.random.default_rng(2))
    expected = {}
    for h in streams.history:
        expected.update(naive_n_step(h, n_step, gamma))
    seen = set()
    for _ in range(150):  # 9,600 draws of ~500 transitions: each one is missed with probability ~3e-9
        b = buffer.sample(64)
        for i in range(64):
            k = b.observations[i].numpy().tobytes() + bytes([b.actions[i].item()])
            assert k in expected
            ret, next_obs, done, discount = expected[k]
            assert b.rewards[i].item() == pytest.approx(ret, abs=1e-5)
            assert b.next_observations[i].numpy().tobytes() == next_obs
            assert bool(b.dones[i].item()) == done
            assert b.discounts[i].item() == pytest.approx(discount, abs=1e-6)
            seen.add(k)
    assert seen == set(expected)  # complete transitions are all reachable, incomplete ones never


def test_observations_that_are_not_frame_stacks_are_refused():
    buffer = ReplayBuffer(100, 1, (STACK, *FRAME))
    obs = np.zeros((1, STACK, *FRAME), dtype=np.uint8)
    with pytest.raises(ValueError, match="frame stacks"):
        buffer.add(obs, obs + 1, np.zeros(1), np.zeros(1), np.zeros(1, bool), np.zeros(1, bool))


def test_bytes_per_transition_for_atari_frames():
    buffer = ReplayBuffer(2_000, 2, compress=False)
    arrays = [buffer.frames, buffer.actions, buffer.rewards, buffer.dones, buffer.ends, buffer.valid]
    per_slot = sum(a.nbytes for a in arrays) / (buffer.capacity * buffer.num_envs)
    assert per_slot == bytes_per_transition() <= 7_100
    assert buffer.nbytes() == sum(a.nbytes for a in arrays)


def test_compressed_frames_count_the_memory_they_hold():
    """``nbytes`` follows the blobs as they are written and replaced, counted apart: the allocator's rounding of
    each bytes object, the shared blob of zeros and one reference per slot."""
    frames = CompressedFrames(6, (84, 84))
    rng = np.random.default_rng(0)
    flat = np.zeros((3, 84, 84), np.uint8)
    noisy = rng.integers(0, 256, (3, 84, 84), dtype=np.uint8)  # incompressible: each blob above 7,056 bytes
    frames.put(np.array([0, 1, 2]), flat)
    frames.put(np.array([1, 4, 5]), noisy)  # slot 1 replaced
    blobs = [frames.blobs[i] for i in range(6)]
    assert sum(len(b) > 7_056 for b in blobs) == 3 and blobs[3] is frames.zeros
    expected = 0
    for i in (0, 2, 1, 4, 5):
        size = 33 + len(blobs[i])  # CPython's bytes header, 33 bytes, and the data
        expected += (size + 15) // 16 * 16 + (8 if size > 512 else 0)
    expected += blob_bytes(frames.zeros) + 8 * 6
    assert frames.nbytes() == expected
    np.testing.assert_array_equal(frames.get(np.array([[0, 1], [5, 3]])), [[flat[0], noisy[0]], [noisy[2], flat[0]]])


@pytest.mark.parametrize("compress", [True, False], ids=["compressed", "raw"])
def test_real_ale_stream_is_sampled_byte_exact(compress):
    """Through ale-py's vector environment: life losses, game overs and autoreset steps."""
    envs = TrainEnvs("BreakoutNoFrameskip-v4", 3, seed=5)
    buffer = ReplayBuffer(1_800, 3, seed=0, compress=compress)  # wraps around during the stream
    rng = np.random.default_rng(0)
    truth = set()
    obs = envs.reset()
    saw_life_loss = saw_game_over = False
    for _ in range(1_000):
        actions = rng.integers(0, envs.n_actions, 3)
        step = envs.step(actions)
        buffer.add(obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        for e in np.flatnonzero(step.mask):
            truth.add(key(obs[e], actions[e], step.rewards[e], step.next_obs[e], step.dones[e]))
        saw_life_loss |= bool((step.dones & ~step.ends).any())
        saw_game_over |= bool(step.ends.any())
        obs = step.next_obs
    envs.close()
    assert saw_life_loss and saw_game_over
    keys = sampled_keys(buffer, 40)
    assert all(k in truth for k in keys)
    assert any(k[4] for k in keys)  # terminal transitions are sampled, with done set


# ---------------------------------------------------------------- state_dict: what a checkpoint holds


def filled(num_envs: int = 3, buffer_size: int = 90, n_step: int = 1, seed: int = 5, compress=True) -> ReplayBuffer:
    buffer = ReplayBuffer(
        buffer_size, num_envs, (STACK, *FRAME), n_step=n_step, gamma=0.9, seed=seed, compress=compress
    )
    fill(buffer, RandomStreams(num_envs, seed), 70, np.random.default_rng(seed))
    return buffer


@pytest.mark.parametrize("saved, loaded", [(True, True), (False, True), (True, False)])
def test_state_dict_round_trip_samples_the_same_batches_and_continues_alike(saved, loaded):
    """Between memories compressed or raw alike: a checkpoint of one restores into the other."""
    buffer = filled(n_step=3, compress=saved)
    copy = ReplayBuffer(90, 3, (STACK, *FRAME), n_step=3, gamma=0.9, seed=999, compress=loaded)  # another seed
    copy.load_state_dict(buffer.state_dict())
    for _ in range(3):
        a, b = buffer.sample(32), copy.sample(32)
        for field in a._fields:
            np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)), field)
    streams_a, streams_b = RandomStreams(3, 11), RandomStreams(3, 11)  # both go on with the same stream
    fill(buffer, streams_a, 20, np.random.default_rng(1))
    fill(copy, streams_b, 20, np.random.default_rng(1))
    state, state_copy = buffer.state_dict(), copy.state_dict()
    for name in ReplayBuffer.ARRAYS:
        np.testing.assert_array_equal(state[name], state_copy[name], name)


def test_state_dict_declares_every_array_the_buffer_holds():
    """A new array attribute must be declared (ARRAYS) or it would silently miss checkpoints."""
    buffer = filled()
    arrays = {name for name, value in vars(buffer).items() if isinstance(value, (np.ndarray, CompressedFrames))}
    assert arrays == set(ReplayBuffer.ARRAYS)
    state = buffer.state_dict()
    assert set(state) == {*ReplayBuffer.SETTINGS, *ReplayBuffer.ARRAYS, "rng"}
    state["frames"][...] = 0  # a copy, not a view: saving never aliases the live memory
    assert buffer.state_dict()["frames"].any()


@pytest.mark.parametrize(
    "other, words",
    [
        (dict(buffer_size=120), "capacity is 30 in the checkpoint but 40"),
        (dict(n_step=2), "n_step is 1 in the checkpoint but 2"),
        (dict(num_envs=2, buffer_size=60), "num_envs is 3 in the checkpoint but 2"),
    ],
)
def test_state_dict_of_other_settings_is_refused_with_the_reason(other, words):
    state = filled().state_dict()
    kwargs = dict(buffer_size=90, num_envs=3, n_step=1) | other
    target = ReplayBuffer(
        kwargs["buffer_size"], kwargs["num_envs"], (STACK, *FRAME), n_step=kwargs["n_step"], gamma=0.9
    )
    before = target.state_dict()
    with pytest.raises(ValueError, match=words):
        target.load_state_dict(state)
    after = target.state_dict()
    for name in ReplayBuffer.ARRAYS:
        np.testing.assert_array_equal(after[name], before[name], name)  # nothing half-loaded
    state.pop("open")
    with pytest.raises(ValueError, match="lacks \\['open'\\]"):
        ReplayBuffer(90, 3, (STACK, *FRAME), gamma=0.9).load_state_dict(state)


@pytest.mark.parametrize("n_step, zero_stacks", [(1, False), (10, True)], ids=["dqn", "drq-n10-zero-stacks"])
def test_compressed_memory_gives_the_raw_memorys_batches_bit_for_bit(n_step, zero_stacks):
    """One real game's stream into a compressed and a raw memory, alike seeded: every batch equal bit for bit,
    through life losses, game overs, autoreset steps, wrap-around, n-step returns and the zero-filled stacks
    DrQ(eps) starts each life with; the frames a checkpoint reads (``frames_written``) equal too."""
    envs = TrainEnvs("BreakoutNoFrameskip-v4", 2, seed=3, zero_stacks=zero_stacks)
    compressed, raw = (ReplayBuffer(1_200, 2, n_step=n_step, seed=7, compress=c) for c in (True, False))
    assert isinstance(compressed.frames, CompressedFrames) and isinstance(raw.frames, np.ndarray)
    rng = np.random.default_rng(0)
    obs = envs.reset()
    seen = {"life losses": 0, "game overs": 0, "zero frames sampled": 0, "batches": 0}
    for t in range(1_500):  # 750 agent steps a ring of 600 slots: it wraps around
        actions = rng.integers(0, envs.n_actions, 2)
        step = envs.step(actions)
        for memory in (compressed, raw):
            memory.add(obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        seen["life losses"] += int((step.dones & ~step.ends).sum())
        seen["game overs"] += int(step.ends.sum())
        obs = step.next_obs
        # a cadence that settles (so batches are prepared ahead and taken) and breaks (so some are discarded)
        for _ in range(0 if t < 100 else 2 if t % 20 == 0 else 1 if t % 20 == 10 or t % 97 == 0 else 0):
            a, b = compressed.sample(32), raw.sample(32)
            for field in a._fields:
                x, y = getattr(a, field), getattr(b, field)
                assert x.dtype == y.dtype and torch.equal(x, y), field
            seen["zero frames sampled"] += int((a.observations.flatten(2).amax(2) == 0).sum())
            seen["batches"] += 1
    envs.close()
    assert seen["life losses"] > 0 and seen["game overs"] > 0 and seen["batches"] > 200, seen
    taken, discarded = compressed.prepared_count["taken"], compressed.prepared_count["discarded"]
    assert taken > 50 and discarded > 5, compressed.prepared_count
    assert (seen["zero frames sampled"] > 0) == zero_stacks, seen
    for env in range(2):
        written = int(raw.written[env])
        np.testing.assert_array_equal(
            compressed.frames_written(env, written - raw.capacity, written),
            raw.frames_written(env, written - raw.capacity, written),
        )


def test_frames_in_flight_are_finished_by_the_thread_that_needs_them():
    """``sample`` never waits on the background thread: what that thread has not taken, and what it took but has
    not finished (it may be slow to get a core), the sampling thread decompresses itself, the same bytes."""
    frames = CompressedFrames(10, (84, 84))
    raw = np.random.default_rng(0).integers(0, 4, (10, 84, 84), dtype=np.uint8)
    frames.put(np.arange(10), raw)
    index = np.array([[3, 4, 5], [9, 0, 3]])
    untouched = FramesInFlight(frames, index)
    np.testing.assert_array_equal(untouched.result(frames.decompressor), raw[index])
    half_done = FramesInFlight(frames, index)
    next(half_done.todo)  # the background thread took frame 0 and was descheduled before decompressing it
    half_done.parts[1] = zstandard.ZstdDecompressor().decompress(half_done.blobs[1])  # it finished frame 1
    next(half_done.todo)
    np.testing.assert_array_equal(half_done.result(frames.decompressor), raw[index])
    frames.put(np.array([3]), raw[[0]])  # a later store changes nothing already in flight
    np.testing.assert_array_equal(FramesInFlight(frames, index).result(frames.decompressor)[0, 0], raw[0])
