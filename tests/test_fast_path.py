"""The fast path's storage and stepping keep the replay exact and the environments' stream unchanged:
frames kept in a torch tensor (on the GPU with ``--buffer-device cuda``; on the CPU here) are sampled
byte-equal, the vectorised ``add`` leaves the buffer exactly as adding environment by environment does,
and ``send``/``recv`` give exactly what ``step`` gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_buffer import FRAME, STACK, RandomStreams, fill, key, naive_n_step, sampled_keys

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.envs import TrainEnvs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STORAGES = [
    pytest.param("cpu", "cpu", id="torch-frames-cpu"),
    pytest.param("cuda", "cuda", id="frames-on-gpu", marks=needs_cuda),
    pytest.param(None, "cuda", id="host-frames-to-gpu", marks=needs_cuda),
]


@pytest.mark.parametrize("storage,device", STORAGES)
@pytest.mark.parametrize("num_envs,buffer_size", [(3, 10_000), (4, 240)])
def test_frames_in_a_torch_tensor_are_sampled_byte_exact(storage, device, num_envs, buffer_size):
    streams = RandomStreams(num_envs, seed=num_envs)
    buffer = ReplayBuffer(buffer_size, num_envs, (STACK, *FRAME), device=device, seed=0, storage_device=storage)
    assert isinstance(buffer.frames, torch.Tensor) or storage is None
    rng = np.random.default_rng(1)
    for _ in range(4):
        fill(buffer, streams, 150, rng)
        truth = {key(**t) for h in streams.history for t in h}
        keys = sampled_keys_on(buffer, 20)
        assert all(k in truth for k in keys)
    if buffer_size >= 10_000:  # nothing evicted: every stored transition is reachable
        assert set(sampled_keys_on(buffer, 300)) == truth
    else:  # after wrap-around the newest transitions of every env are still there
        recent = {key(**t) for h in streams.history for t in h[-8:]}
        assert recent <= set(sampled_keys_on(buffer, 300))


def sampled_keys_on(buffer: ReplayBuffer, draws: int, batch: int = 64) -> list[tuple]:
    if buffer.device.type == "cpu":
        return sampled_keys(buffer, draws, batch)
    keys = []
    for _ in range(draws):
        b = buffer.sample(batch)
        assert b.observations.device.type == buffer.device.type and b.observations.dtype == torch.uint8
        b = type(b)(*(t.cpu() for t in b))
        for i in range(batch):
            keys.append(
                key(b.observations[i].numpy(), b.actions[i].item(), b.rewards[i].item(),
                    b.next_observations[i].numpy(), b.dones[i].item() == 1.0)
            )  # fmt: skip
    return keys


@pytest.mark.parametrize("storage,device", STORAGES)
def test_n_step_returns_from_a_torch_tensor_match_a_naive_computation(storage, device):
    gamma = 0.9
    streams = RandomStreams(3, seed=11, p_term=0.08, p_trunc=0.05, p_life=0.1)
    buffer = ReplayBuffer(10_000, 3, (STACK, *FRAME), device=device, n_step=3, gamma=gamma, seed=0,
                          storage_device=storage)  # fmt: skip
    fill(buffer, streams, 200, np.random.default_rng(2))
    expected = {}
    for h in streams.history:
        expected.update(naive_n_step(h, 3, gamma))
    seen = set()
    for _ in range(150):  # 9,600 draws of ~500 transitions: each one is missed with probability ~3e-9
        b = buffer.sample(64)
        b = type(b)(*(t.cpu() for t in b))
        for i in range(64):
            k = b.observations[i].numpy().tobytes() + bytes([b.actions[i].item()])
            ret, next_obs, done, discount = expected[k]
            assert b.rewards[i].item() == pytest.approx(ret, abs=1e-5)
            assert b.next_observations[i].numpy().tobytes() == next_obs
            assert bool(b.dones[i].item()) == done
            assert b.discounts[i].item() == pytest.approx(discount, abs=1e-6)
            seen.add(k)
    assert seen == set(expected)


def test_vectorised_add_equals_adding_env_by_env():
    """One ``add`` over all environments leaves every array exactly as one ``add`` per environment
    (masking the others) does, through episode starts, autoreset steps and wrap-around."""
    streams = RandomStreams(4, seed=3, p_term=0.1, p_trunc=0.05, p_life=0.1)
    together = ReplayBuffer(120, 4, (STACK, *FRAME), seed=0)
    one_by_one = ReplayBuffer(120, 4, (STACK, *FRAME), seed=0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        actions = rng.integers(0, 6, 4)
        obs = streams.obs
        next_obs, rewards, dones, ends, mask = streams.step(actions)
        together.add(obs, next_obs, actions, rewards, dones, ends, mask)
        for env in range(4):
            alone = np.zeros(4, dtype=bool)
            alone[env] = mask[env]
            one_by_one.add(obs, next_obs, actions, rewards, dones, ends, alone)
        streams.obs = next_obs
    state, alone_state = together.state_dict(), one_by_one.state_dict()
    for name in ("frames", "actions", "rewards", "dones", "ends", "valid", "cursor", "written", "open"):
        assert np.array_equal(state[name], alone_state[name]), name
    assert together.written.min() > together.capacity  # the rings wrapped around


def test_torch_storage_holds_the_same_frames_as_host_storage():
    streams_a, streams_b = RandomStreams(2, seed=5), RandomStreams(2, seed=5)
    host = ReplayBuffer(300, 2, (STACK, *FRAME), seed=0)
    tensor = ReplayBuffer(300, 2, (STACK, *FRAME), seed=0, storage_device="cpu")
    fill(host, streams_a, 250, np.random.default_rng(4))
    fill(tensor, streams_b, 250, np.random.default_rng(4))
    assert np.array_equal(tensor.frames.numpy(), host.state_dict()["frames"])
    assert np.array_equal(tensor.valid, host.valid)
    a, b = host.sample(50), tensor.sample(50)  # same seed, same draws
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def step_stream(envs: TrainEnvs, asynchronous: bool, steps: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    obs = envs.reset()
    out = [obs.tobytes()]
    for _ in range(steps):
        actions = rng.integers(0, envs.n_actions, envs.num_envs)
        if asynchronous:
            envs.send(actions)
            actions[:] = 0  # the caller reusing its array must not change what was sent
            step = envs.recv()
        else:
            step = envs.step(actions)
        out.append(
            (step.next_obs.tobytes(), step.rewards.tobytes(), step.raw_rewards.tobytes(), step.dones.tobytes(),
             step.ends.tobytes(), step.mask.tobytes(), tuple(step.episode_returns))
        )  # fmt: skip
    envs.close()
    return out


@pytest.mark.parametrize("env_id,steps", [("BreakoutNoFrameskip-v4", 400), ("tests.toy_envs:DelayedImage-v0", 60)])
def test_send_then_recv_is_exactly_step(env_id, steps):
    """Same seeds, same actions: the asynchronous pair gives the synchronous stream, byte for byte,
    life losses and game ends included (Breakout under random play loses lives in 400 steps)."""
    sync = step_stream(TrainEnvs(env_id, 3, seed=7), False, steps, seed=1)
    asynchronous = step_stream(TrainEnvs(env_id, 3, seed=7), True, steps, seed=1)
    assert sync == asynchronous
    dones = [np.frombuffer(s[3], dtype=bool) for s in sync[1:]]
    assert any(d.any() for d in dones)  # the stream holds learning terminals


def test_send_and_recv_out_of_turn_are_refused():
    envs = TrainEnvs("tests.toy_envs:ImageBandit-v0", 2, seed=0)
    envs.reset()
    with pytest.raises(RuntimeError, match="without a step sent"):
        envs.recv()
    envs.send(np.zeros(2, dtype=np.int64))
    with pytest.raises(RuntimeError, match="twice"):
        envs.send(np.zeros(2, dtype=np.int64))
    envs.close()  # the step in flight is finished first
    other = TrainEnvs("tests.toy_envs:ImageBandit-v0", 2, seed=0)
    other.reset()
    with pytest.raises(ValueError, match="expected 2 actions"):
        other.send(np.zeros(3, dtype=np.int64))
    other.close()
