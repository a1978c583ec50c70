"""DrQ(epsilon) (algos/drq.py): its augmentation, its n-step Double DQN target and Huber loss through that
augmentation, against independent float64 loops; its defaults against Dopamine's DrQ_eps.gin; its shared lines
against the family's; bad flags; and, end to end, learning the toy task and resuming bit for bit.

The augmentation is checked by searching, for every sample, the shift and the scale that turn the edge-padded input
into the output (small random images: exactly one shift fits). A planted bug in a copy of the script must fail the
checks: one shift for the whole batch, a range one pixel too wide, the clip of the noise left out, s and s' drawn
alike, the target network choosing a', the terminal mask left out."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, assert_stopped_early, mark_interrupted, read_json, run_cases, run_python, scalars, weights
from test_script_losses import float64_parameters, nature_features

from cleanrl_utils.buffer import ReplayBatch, ReplayBuffer
from cleanrl_utils.tools.evaluate import load_algorithm

SCRIPT = REPO / "algos" / "drq.py"
N_ACTIONS = 3


@pytest.fixture(scope="module")
def drq():
    return load_algorithm(SCRIPT)


def planted(tmp_path: Path, original: str, changed: str):
    source = SCRIPT.read_text()
    if source.count(original) != 1:  # not an AssertionError: the tests expecting one must not pass on a lost plant
        pytest.fail(f"the plant's text is not in the script once: {original}")
    mutant = tmp_path / "planted_drq.py"
    mutant.write_text(source.replace(original, changed))
    return load_algorithm(mutant)


# ---------------------------------------------------------------- the augmentation


def fitted_shifts(obs: np.ndarray, out: np.ndarray, pad: int) -> list[tuple[int, int, float]]:
    """for each sample: the one (row offset, column offset) in [0, 2 pad] x [0, 2 pad] of the edge-padded stack
    whose crop, times one number for the whole stack, gives the output; with that number"""
    n, c, h, w = obs.shape
    padded = np.pad(obs.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)), mode="edge")
    found = []
    for i in range(n):
        fits = []
        for dy in range(2 * pad + 1):
            for dx in range(2 * pad + 1):
                crop = padded[i, :, dy : dy + h, dx : dx + w]
                scale = out[i].sum() / crop.sum()
                if np.allclose(out[i], crop * scale, rtol=1e-5, atol=1e-3):
                    fits.append((dy, dx, float(scale)))
        assert len(fits) == 1, f"sample {i}: {len(fits)} shifts fit the output, not one"
        found += fits
    return found


def check_augment(module, pad: int = 4, scale: float = 0.05) -> None:
    """400 stacks of 4 small random frames (values 1 to 255): shapes and dtype kept, every output one shifted and
    scaled stack, every shift in [-pad, pad - 1] on each axis (offsets 0 to 2 pad - 1, Dopamine's), all 64 shifts
    drawn, each sample its own shift and scale, the scale within 1 +- 2 scale and spread as 1 + scale N(0, 1)"""
    generator = torch.Generator().manual_seed(3)
    obs = torch.randint(1, 256, (400, 4, 10, 10), dtype=torch.uint8, generator=generator)
    out = module.augment(obs, pad, scale, torch.Generator().manual_seed(5))
    assert out.shape == obs.shape and out.dtype == torch.float32 and obs.dtype == torch.uint8
    assert torch.equal(module.augment(obs.float(), pad, scale, torch.Generator().manual_seed(5)), out)
    fits = fitted_shifts(obs.numpy(), out.numpy(), pad)
    offsets = {(dy, dx) for dy, dx, _ in fits}
    assert offsets == {(dy, dx) for dy in range(2 * pad) for dx in range(2 * pad)}, sorted(offsets)
    scales = np.array([s for _, _, s in fits])
    assert np.all(scales >= 1 - 2 * scale - 1e-6) and np.all(scales <= 1 + 2 * scale + 1e-6)
    assert np.mean(np.abs(scales - 1) > 2 * scale - 1e-6) < 0.06  # about 4.6% clipped at +-2 sigma
    assert abs(scales.mean() - 1) < 0.01 and 0.8 * scale < scales.std() < 1.1 * scale


def test_augment_shifts_each_sample_within_the_padding_and_scales_its_intensity(drq):
    check_augment(drq)


def test_augment_without_padding_or_noise_is_the_identity_and_runs_on_atari_stacks(drq):
    obs = torch.randint(0, 256, (32, 4, 84, 84), dtype=torch.uint8)
    assert torch.equal(drq.augment(obs, 0, 0.0), obs.float())
    out = drq.augment(obs, 4, 0.05)
    assert out.shape == (32, 4, 84, 84) and out.dtype == torch.float32
    assert 0.0 <= out.min() and out.max() <= 255 * 1.1 + 1e-3


@pytest.mark.parametrize(
    "bug,original,changed",
    [
        ("one shift for the batch", 'draws = n if shift_per == "sample" else 1', "draws = 1"),
        ("offsets 0 to 2 pad", "torch.randint(0, 2 * pad,", "torch.randint(0, 2 * pad + 1,"),
        ("noise not clipped", ".clamp(-2.0, 2.0)", ""),
        ("one scale for the batch", "torch.randn(n, 1, 1, 1,", "torch.randn(1, 1, 1, 1,"),
        ("wrapped rows, not repeated edges", "rows = (torch.arange(h) + shifts[:, :1] - pad).clamp(0, h - 1)", "rows = (torch.arange(h) + shifts[:, :1] - pad) % h"),
    ],
)  # fmt: skip
def test_a_planted_bug_in_the_augmentation_fails_its_check(bug, original, changed, tmp_path):
    mutant = planted(tmp_path, original, changed)
    with pytest.raises(AssertionError):
        check_augment(mutant)


def check_one_shift_per_batch(module, pad: int = 4, scale: float = 0.05) -> None:
    """--shift-per batch, Dopamine's `_random_crop` of 2021 (one `randint(shape=())` offset for the whole batch, the
    intensity still `normal(shape=(batch, 1, 1, 1))`): 500 batches of 3 stacks, every stack of a batch shifted by the
    same offset and scaled by its own number; over the batches, all 64 offsets in [0, 2 pad) x [0, 2 pad)"""
    generator, draws = torch.Generator().manual_seed(3), torch.Generator().manual_seed(5)
    offsets = set()
    for _ in range(500):
        obs = torch.randint(1, 256, (3, 4, 10, 10), dtype=torch.uint8, generator=generator)
        fits = fitted_shifts(obs.numpy(), module.augment(obs, pad, scale, draws, "batch").numpy(), pad)
        assert len({(dy, dx) for dy, dx, _ in fits}) == 1, f"one batch, several shifts: {fits}"
        assert len({s for _, _, s in fits}) == 3, f"one batch, one scale for all its stacks: {fits}"
        offsets.add(fits[0][:2])
    assert offsets == {(dy, dx) for dy in range(2 * pad) for dx in range(2 * pad)}, sorted(offsets)


def test_shift_per_batch_gives_every_stack_of_a_batch_the_same_shift_and_its_own_scale(drq):
    check_one_shift_per_batch(drq)


@pytest.mark.parametrize(
    "bug,original,changed",
    [
        ("a shift per sample under --shift-per batch", 'draws = n if shift_per == "sample" else 1', "draws = n"),
        ("offsets 0 to 2 pad", "torch.randint(0, 2 * pad,", "torch.randint(0, 2 * pad + 1,"),
        ("one scale for the batch", "torch.randn(n, 1, 1, 1,", "torch.randn(1, 1, 1, 1,"),
    ],
)  # fmt: skip
def test_a_planted_bug_in_the_batch_shift_fails_its_check(bug, original, changed, tmp_path):
    mutant = planted(tmp_path, original, changed)
    with pytest.raises(AssertionError):
        check_one_shift_per_batch(mutant)


def test_shift_per_batch_draws_s_and_s_prime_apart_and_reaches_the_loop(drq):
    """s's batch and s''s batch each one shift, drawn apart (the reference's two keys: 1 in 64 alike); the flag is
    an Args field that the loop passes on (a typo in either would leave the default)"""
    obs = torch.randint(1, 256, (6, 4, 12, 12), dtype=torch.uint8)
    zeros = torch.zeros(6)
    batch = ReplayBatch(obs, torch.zeros(6, dtype=torch.long), zeros, obs.clone(), zeros, zeros)
    alike = 0
    for seed in range(64):
        out = drq.augment_batch(batch, 4, 0.0, torch.Generator().manual_seed(seed), shift_per="batch")
        s, s_next = (
            fitted_shifts(obs.numpy(), out.observations.numpy(), 4),
            fitted_shifts(obs.numpy(), out.next_observations.numpy(), 4),
        )
        assert len({f[:2] for f in s}) == 1 and len({f[:2] for f in s_next}) == 1
        alike += s[0][:2] == s_next[0][:2]
    assert alike <= 5, f"{alike} of 64 batches shifted s and s' alike"
    assert drq.Args(shift_per="batch").shift_per == "batch"
    assert "shift_per=args.shift_per" in SCRIPT.read_text()


def test_s_and_s_prime_get_independent_draws(drq):
    obs = torch.randint(1, 256, (64, 4, 12, 12), dtype=torch.uint8)
    zeros = torch.zeros(64)
    batch = ReplayBatch(obs, torch.zeros(64, dtype=torch.long), zeros, obs.clone(), zeros, zeros)
    out = drq.augment_batch(batch, 4, 0.05)
    same = [torch.equal(a, b) for a, b in zip(out.observations, out.next_observations, strict=True)]
    assert sum(same) <= 2, f"{sum(same)} of 64 samples got the same draw for s and s'"
    assert out.actions is batch.actions and out.rewards is batch.rewards and out.discounts is batch.discounts


# ---------------------------------------------------------------- the n-step target and the loss, through a real buffer


def trajectory(gamma: float, n_step: int, seed: int = 0):
    """Three episodes in one environment (7 steps ending at a terminal, 15 cut by a time limit, 20 still going) in a
    ReplayBuffer as the script builds it; each frame unique. Returns the buffer and, per step, the stack before it,
    the stack after it, its reward, and the naive n-step return and discount, a loop over the stored rewards."""
    rng = np.random.default_rng(seed)
    rb = ReplayBuffer(500, 1, device="cpu", n_step=n_step, gamma=gamma, seed=seed)
    steps = []
    for length, ending in ((7, "terminal"), (15, "truncation"), (20, None)):
        stack = np.repeat(rng.integers(1, 256, (1, 84, 84), dtype=np.uint8), 4, axis=0)
        episode = []
        for t in range(length):
            next_stack = np.concatenate([stack[1:], rng.integers(1, 256, (1, 84, 84), dtype=np.uint8)])
            last = t == length - 1
            done, end = last and ending == "terminal", last and ending is not None
            reward = float(rng.choice([-1.0, 0.0, 1.0]))
            action = int(rng.integers(N_ACTIONS))
            rb.add(stack[None], next_stack[None], [action], [reward], [done], [end], [True])
            episode.append({"obs": stack, "next": next_stack, "reward": reward, "action": action, "done": done})
            stack = next_stack
        for t, step in enumerate(episode):
            k = min(n_step, len(episode) - t)
            if ending is None and k < n_step:
                step["ready"] = False  # its n steps are not all stored yet
                continue
            step["ready"] = True
            step["return"] = sum(gamma**j * episode[t + j]["reward"] for j in range(k))
            terminal = episode[t + k - 1]["done"]
            step["discount"] = 0.0 if terminal else gamma**k
            step["bootstrap"] = episode[t + k - 1]["next"]
        steps += episode
    return rb, steps


def dopamine_features(p: dict[str, torch.Tensor], obs: torch.Tensor) -> torch.Tensor:
    """Dopamine's encoder (networks.py, FullRainbowNetwork lines 573-590) in float64: the Nature layers, each input
    zero-padded as XLA's SAME pads it, (before, after) = (total // 2, total - total // 2) for total = (ceil(size /
    stride) - 1) * stride + kernel - size: 84 -> 21 (2, 2), 21 -> 11 (1, 2), 11 -> 11 (1, 1)"""
    x = obs.double() / 255.0
    for name, stride, (before, after) in (("0", 4, (2, 2)), ("3", 2, (1, 2)), ("5", 1, (1, 1))):
        x = F.pad(x, (before, after, before, after))
        x = F.relu(F.conv2d(x, p[f"encoder.net.{name}.weight"], p[f"encoder.net.{name}.bias"], stride=stride))
    return F.relu(x.flatten(1) @ p["encoder.net.8.weight"].T + p["encoder.net.8.bias"])


def dueling_q64(p, obs, module) -> list[list[torch.Tensor]]:
    """Q(s, a) = v(s) + A(s, a) - mean_b A(s, b) in float64, [transition][action]"""
    features = dopamine_features(p, obs) if module.encoder.same_padding else nature_features(p, obs)
    value = features @ p["value.weight"].T + p["value.bias"]
    advantage = features @ p["advantage.weight"].T + p["advantage.bias"]
    return [
        [
            value[i, 0] + advantage[i, a] - sum(advantage[i, b] for b in range(N_ACTIONS)) / N_ACTIONS
            for a in range(N_ACTIONS)
        ]
        for i in range(len(obs))
    ]


def huber(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x**2 if abs(float(x.detach())) <= 1.0 else abs(x) - 0.5


def compare_loss(module, **network) -> tuple[float, float, float]:
    """The script's loss and gradients on an augmented batch of its own n-step buffer, against the naive loop:
    R + discount * Q_target(aug s', argmax_a' Q_online(aug s', a')) with R and discount summed here from the
    stored rewards, Huber against Q_online(aug s, a). Returns the relative gaps (loss, q_values, gradient)."""
    args = dataclasses.replace(module.Args(), gamma=0.9)  # the default --n-step 10
    rb, steps = trajectory(args.gamma, args.n_step)
    torch.manual_seed(0)
    q_network, target_network = module.QNetwork(N_ACTIONS, **network), module.QNetwork(N_ACTIONS, **network)
    with torch.no_grad():  # spread the fresh heads' Q-values apart, and make the target network another one
        for net, scale in ((q_network, 20.0), (target_network, 15.0)):
            net.advantage.weight.mul_(scale)
            net.value.weight.mul_(scale)
        # whose choice differs from the online network's in every state (fresh networks on random images each
        # prefer one action everywhere, the same one by chance): its advantages are the online's, rolled by one
        target_network.advantage.weight.copy_(q_network.advantage.weight.roll(1, 0) * 0.75)
        target_network.advantage.bias.copy_(q_network.advantage.bias.roll(1, 0))
    raw = rb.sample(16)
    found = []
    for i in range(16):
        [step] = [s for s in steps if np.array_equal(s["obs"], raw.observations[i].numpy())]
        assert step["ready"] and np.array_equal(step["bootstrap"], raw.next_observations[i].numpy())
        found.append(step)
    assert len({s["discount"] for s in found}) > 1  # several kinds in the batch (a fixed seed)
    data = module.augment_batch(raw, args.augmentation_pad, args.intensity_scale, torch.Generator().manual_seed(1))
    for raw_frames, frames in ((raw.observations, data.observations), (raw.next_observations, data.next_observations)):
        fitted_shifts(raw_frames[:2].numpy(), frames[:2].numpy(), args.augmentation_pad)  # augmented from these
    loss, metrics = module.compute_loss(q_network, target_network, data, args)
    loss.backward()
    assert all(p.grad is None for p in target_network.parameters()), "a gradient reached the target network"
    online, target = float64_parameters(q_network, True), float64_parameters(target_network, False)
    q_s = dueling_q64(online, data.observations, q_network)
    q_next_online = dueling_q64(online, data.next_observations, q_network)
    q_next_target = dueling_q64(target, data.next_observations, target_network)
    losses, chosen = [], []
    for i, step in enumerate(found):
        a_star = max(range(N_ACTIONS), key=lambda a: float(q_next_online[i][a].detach()))
        y = step["return"] + step["discount"] * q_next_target[i][a_star].detach()
        chosen.append(q_s[i][int(raw.actions[i])])
        assert int(raw.actions[i]) == step["action"]
        losses.append(huber(y - chosen[-1]))
    expected = sum(losses) / len(losses)
    expected.backward()
    expected_q = float(sum(chosen).detach() / len(chosen))
    loss_gap = abs(loss.item() - expected.item()) / max(1.0, abs(expected.item()))
    q_gap = abs(metrics["q_values"].item() - expected_q) / max(1.0, abs(expected_q))
    top = max(online[k].grad.abs().max().item() for k in online)
    grad_gap = max((p.grad.double() - online[k].grad).abs().max().item() / top for k, p in q_network.named_parameters())
    return loss_gap, q_gap, grad_gap


@pytest.mark.parametrize("same_padding", [True, False])  # --encoder dopamine (the default), --encoder nature
def test_the_loss_through_augmentation_and_n_step_returns_matches_the_float64_loop(drq, same_padding):
    loss_gap, q_gap, grad_gap = compare_loss(drq, same_padding=same_padding)
    assert loss_gap < 1e-5 and q_gap < 1e-5 and grad_gap < 1e-4, (loss_gap, q_gap, grad_gap)


def test_the_online_network_as_its_own_target_gives_the_synced_targets_bit_for_bit(drq):
    """the loop passes the online network as the target while the target is synced after every update (one game,
    period 1, tau 1): its single forward of s' must give what a separate, synced target network gives"""
    args = drq.Args()
    rb, _ = trajectory(args.gamma, args.n_step)
    torch.manual_seed(0)
    q_network, synced = drq.QNetwork(N_ACTIONS), drq.QNetwork(N_ACTIONS)
    synced.load_state_dict(q_network.state_dict())
    data = drq.augment_batch(
        rb.sample(16), args.augmentation_pad, args.intensity_scale, torch.Generator().manual_seed(1)
    )
    assert torch.equal(
        drq.compute_td_target(q_network, q_network, data), drq.compute_td_target(q_network, synced, data)
    )
    source = SCRIPT.read_text()
    assert (
        "q_network if (args.num_envs, args.target_network_frequency, args.tau) == (1, 1, 1.0) else target_network"
        in " ".join(source.split())
    )


@pytest.mark.parametrize(
    "bug,original,changed",
    [
        ("the target network chooses a'", "next_actions = online_next.argmax(", "next_actions = target_network(data.next_observations).argmax("),
        ("the online network evaluates", "else target_network(data.next_observations)", "else q_network(data.next_observations)"),
        ("the online forward of s' read for another target", "if target_network is q_network else", "if True else"),
        ("one step, not the batch's discounts", "data.rewards + data.discounts * next_q", "data.rewards + 0.9 * next_q"),
        ("squared error, not Huber", "F.smooth_l1_loss(old_val, td_target)", "F.mse_loss(old_val, td_target)"),
        ("no dueling mean", " - advantage.mean(dim=1, keepdim=True)", ""),
        ("s' augmented as s", "next_observations = augment(data.next_observations,", "next_observations = augment(data.observations,"),
    ],
)  # fmt: skip
def test_a_planted_bug_in_the_target_or_the_loss_fails_the_comparison(bug, original, changed, tmp_path):
    mutant = planted(tmp_path, original, changed)
    try:
        loss_gap, _, grad_gap = compare_loss(mutant)
    except AssertionError:
        return  # caught before the numbers (s' is no longer the stored n-step successor)
    assert loss_gap > 1e-3 or grad_gap > 1e-2, f"'{bug}' went unnoticed ({loss_gap:.1e}, {grad_gap:.1e})"


# ---------------------------------------------------------------- settings, shared lines, bad flags

# Dopamine's dopamine/labs/atari_100k/configs/DrQ_eps.gin (and its agent's defaults), as our flags
REFERENCE = {
    "total_timesteps": 100_000,  # Runner.num_iterations 10 x Runner.training_steps 10_000
    "gamma": 0.99,
    "n_step": 10,  # JaxDQNAgent.update_horizon
    "learning_starts": 1_600,  # JaxDQNAgent.min_replay_history
    "train_frequency": 1,  # JaxDQNAgent.update_period
    "target_network_frequency": 1,  # JaxDQNAgent.target_update_period
    "tau": 1.0,
    "start_e": 1.0,
    "end_e": 0.01,  # JaxDQNAgent.epsilon_train
    "eval_epsilon": 0.001,  # JaxDQNAgent.epsilon_eval
    "eval_episodes": 100,  # DataEfficientAtariRunner.num_eval_episodes
    "learning_rate": 1e-4,  # create_optimizer.learning_rate
    "adam_eps": 1.5e-4,  # create_optimizer.eps
    "batch_size": 32,
    "augmentation": True,  # Atari100kRainbowAgent.data_augmentation
    "augmentation_pad": 4,  # drq_image_augmentation(img_pad=4)
    "intensity_scale": 0.05,  # _intensity_aug(scale=0.05)
    # the 2021 code, which made the published runs: _random_crop's randint(shape=()), one offset for the batch, until
    # 1bb064b (2022-02-04; today _per_image_random_crop: --shift-per sample)
    "shift_per": "batch",
    "forced_steps": False,  # atari_lib.AtariPreprocessing presses nothing for the agent (no FireResetEnv)
    "zero_stacks": True,  # atari_100k_rainbow_agent.py _reset_state (zeros) at every begin_episode
    # the 2021 code: eval_run_experiment.py _run_no_ops at 8de9df0, 0 to 29 single ale.act(0) frames (our nearest: 0 to
    # 30 no-op frames); today atari_100k_runner.py lines 204-212, 0 to 29 agent steps: --noop-starts steps
    "noop_starts": "frames",
    "encoder": "dopamine",  # networks.py FullRainbowNetwork: Flax nn.Conv, SAME padding
    "init": "xavier",  # kernel_init=nn.initializers.xavier_uniform(), Flax's zero bias_init
}


def check_xavier(network: torch.nn.Module) -> int:
    """every convolution and dense layer as Flax's xavier_uniform draws it (jax.nn.initializers.variance_scaling(1,
    "fan_avg", "uniform"): a kernel (kh, kw, in, out) has fans in * kh * kw and out * kh * kw, its weights uniform
    in +-sqrt(3 / fan_avg)), biases zero; returns the layers checked"""
    layers = [m for m in network.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    for layer in layers:
        weight = layer.weight.detach().double()
        area = math.prod(weight.shape[2:])
        fan_in, fan_out = weight.shape[1] * area, weight.shape[0] * area
        bound = math.sqrt(3.0 / ((fan_in + fan_out) / 2))
        assert weight.abs().max() <= bound and torch.count_nonzero(layer.bias) == 0
        if weight.numel() >= 1_000:  # uniform in +-bound: std bound / sqrt(3), and the bound nearly reached
            assert abs(weight.std().item() / (bound / math.sqrt(3)) - 1) < 0.05 and weight.abs().max() > 0.95 * bound
    return len(layers)


def test_the_network_is_dopamines_by_default_and_the_flags_give_the_other_scripts_back(drq):
    """QNetwork's defaults (what --encoder dopamine --init xavier build): the SAME-padded encoder, its checked count,
    Xavier-uniform weights and zero biases in all 6 layers; QNetwork(n, same_padding=False, xavier=False): the fixed
    Nature encoder with PyTorch's initialisation, as every other script"""
    from cleanrl_utils.encoder import NATURE_CNN_PARAMETERS, NATURE_CNN_SAME_PADDING_PARAMETERS, count_parameters

    torch.manual_seed(0)
    network = drq.QNetwork(18)
    assert network.encoder.same_padding and count_parameters(network.encoder) == NATURE_CNN_SAME_PADDING_PARAMETERS
    assert check_xavier(network) == 6
    plain = drq.QNetwork(18, same_padding=False, xavier=False)
    assert not plain.encoder.same_padding and count_parameters(plain.encoder) == NATURE_CNN_PARAMETERS
    assert torch.count_nonzero(plain.value.bias) == 1  # PyTorch's default draws biases
    with pytest.raises(AssertionError):
        check_xavier(plain)
    source = " ".join(SCRIPT.read_text().split())
    assert 'network = dict(same_padding=args.encoder == "dopamine", xavier=args.init == "xavier")' in source
    assert "sys.exit(run.finish(**network))" in source  # the saved model rebuilds the same network


@pytest.mark.parametrize(
    "bug,original,changed",
    [
        ("He's bound, not Xavier's", "nn.init.xavier_uniform_(layer.weight)", "nn.init.kaiming_uniform_(layer.weight)"),
        ("biases left as drawn", "nn.init.zeros_(layer.bias)", "pass"),
        ("the head left out", "if isinstance(layer, (nn.Conv2d, nn.Linear)):", "if isinstance(layer, nn.Conv2d):"),
    ],
)  # fmt: skip
def test_a_planted_bug_in_the_initialisation_fails_its_check(bug, original, changed, tmp_path):
    mutant = planted(tmp_path, original, changed)
    torch.manual_seed(0)
    with pytest.raises(AssertionError):
        check_xavier(mutant.QNetwork(18))


def test_the_defaults_are_the_published_drq_eps_agent(drq):
    args = drq.Args()
    assert {k: getattr(args, k) for k in REFERENCE} == REFERENCE
    assert args.exploration_fraction * args.total_timesteps == 5_000  # JaxDQNAgent.epsilon_decay_period
    assert args.buffer_size >= args.total_timesteps  # every transition kept (the reference's 1M)


def test_epsilon_is_start_e_until_learning_starts_then_decays_over_the_fraction(drq):
    def epsilon(t):  # as the loop calls it
        return drq.linear_schedule(1.0, 0.01, 5_000, max(t - 1_600, 0))

    assert epsilon(0) == epsilon(1_600) == 1.0
    assert epsilon(1_600 + 2_500) == pytest.approx(0.505) and epsilon(6_600) == pytest.approx(0.01)
    assert "max(global_step - args.learning_starts, 0)" in SCRIPT.read_text()


def test_drq_shares_the_familys_lines_byte_for_byte():
    """what tests/test_drift.py checks of every script (linear_schedule, --fast and Adam lines, the --adam-eps check,
    the update, start-or-restore, resume, signals, non-finite stop, checkpoint, training done), with drq added"""
    import test_drift

    scripts = {**test_drift.sources(), "drq": SCRIPT.read_text()}
    functions = {name: test_drift.top_level(source) for name, source in scripts.items()}
    assert functions["drq"]["linear_schedule"] == functions["dqn"]["linear_schedule"]
    assert [d for d in test_drift.all_drift(scripts) if "drq" in d] == []
    call, rest = test_drift.update_lines(scripts["drq"])
    assert call == "loss, metrics = compute_loss(q_network, target_now, data, args)"
    assert rest == test_drift.update_lines(scripts["dqn"])[1]


BAD = [
    (["--n-step", "0"], ["--n-step 0", "positive"]),
    (["--augmentation-pad", "-1"], ["--augmentation-pad -1", ">= 0"]),
    (["--intensity-scale", "0.5"], ["--intensity-scale 0.5", "[0, 0.5)"]),
    (["--intensity-scale", "nan"], ["--intensity-scale nan"]),
    (["--adam-eps", "0"], ["--adam-eps 0.0", "default: 0.00015"]),
    (["--n-step", "70", "--buffer-size", "64", "--learning-starts", "32"], ["--n-step 70", "--buffer-size 64", "75"]),
    (["--exploration-fraction", "0"], ["--exploration-fraction 0.0"]),
    (["--learning-starts", "10"], ["--learning-starts 10", "--batch-size 32"]),
]


def test_bad_flags_stop_early_with_a_message(tmp_path):
    for result, (_, words) in zip(run_cases("drq", [f for f, _ in BAD], tmp_path, timeout=300), BAD, strict=True):
        assert_stopped_early(result, words)


# ---------------------------------------------------------------- end to end: the toy task, and an exact resume


def test_learns_the_delayed_reward_task_with_the_logged_epsilon_held_until_learning(toy_run):
    stdout, run_dir = toy_run("drq")
    mean = read_json(run_dir / "evaluations.json")[-1]["mean"]
    assert mean >= 0.95, f"drq on DelayedImage: evaluation mean {mean}, optimum 1, random 0.5"
    last_q = [float(line.rsplit("q_values=", 1)[1].split()[0]) for line in stdout.splitlines() if "q_values=" in line]
    assert 0.0 < last_q[-1] < 1.3
    args = read_json(run_dir / "receipt.json")["args"]
    duration = args["exploration_fraction"] * args["total_timesteps"]
    for event in scalars(run_dir)["charts/epsilon"]:  # chosen at step - 1 (one game)
        t = max(event.step - 1 - args["learning_starts"], 0)
        assert event.value == pytest.approx(max(1.0 - 0.99 * t / duration, 0.01), rel=1e-6)


def test_resumed_from_a_checkpoint_ends_bit_identical(toy_run, tmp_path):
    """the toy run, continued from its step-900 checkpoint (the augmentation's draws come from torch's generator,
    which the checkpoint keeps), ends with its weights"""
    straight = toy_run("drq").dir
    copy = tmp_path / straight.name
    subprocess.run(["cp", "-r", str(straight), str(copy)], check=True)
    for model in copy.glob("*.cleanrl_model"):
        model.unlink()
    mark_interrupted(copy)  # as if stopped after that checkpoint: a finished run refuses an older checkpoint
    again = run_python("algos/drq.py", "--resume", str(copy / "checkpoints" / "step_000000000900"), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "games continued" in again.stdout, again.stdout[-2000:]
    a, b = weights(straight), weights(copy)
    assert a.keys() == b.keys() and {"value.weight", "advantage.weight"} <= set(a)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after resume (max {(a[key] - b[key]).abs().max()})"
    assert not math.isnan(read_json(copy / "evaluations.json")[-1]["mean"])


# ---------------------------------------------------------------- the Atari 100k table beside the published means

PUBLISHED = REPO / "benchmarks" / "atari100k_published.json"


def test_the_published_file_has_the_26_games_and_the_papers_iqm():
    from cleanrl_utils.tools.results import load_published

    published = load_published(PUBLISHED)
    assert len(published["games"]) == 26 and published["runs_per_game"] == 100
    assert published["games"]["Breakout"] == pytest.approx(19.8, abs=0.05)  # DESIGN.md's figures
    assert published["games"]["Pong"] == pytest.approx(-9.1, abs=0.05)
    assert published["games"]["Boxing"] == pytest.approx(9.0, abs=0.05)
    assert published["games"]["Seaquest"] == pytest.approx(352.3, abs=0.05)
    assert published["iqm"] == pytest.approx(0.280, abs=0.0005)


def test_the_results_table_lists_the_published_means_beside_ours(tmp_path, capsys):
    from cleanrl_utils.scores import human_normalized_score
    from cleanrl_utils.tools.results import main

    for seed, score in ((1, 10.0), (2, 20.0)):
        folder = tmp_path / f"BreakoutNoFrameskip-v4__drq__{seed}__{1_700_000_000 + seed}"
        folder.mkdir()
        receipt = {"status": "finished", "algo": "drq", "seed": seed, "counts": {"env_steps": 100_000}}
        receipt["args"] = {"env_id": "BreakoutNoFrameskip-v4", "exp_name": "drq"}
        (folder / "receipt.json").write_text(json.dumps(receipt))
        (folder / "evaluations.json").write_text(json.dumps([{"step": 100_000, "final": True, "mean": score}]))
    assert main([str(tmp_path)]) == 0
    plain = capsys.readouterr().out
    assert "published" not in plain  # without --published, the table as before
    assert main([str(tmp_path), "--published", str(PUBLISHED)]) == 0
    out = capsys.readouterr().out
    assert "| drq | 2 | 100000 | 15.00 +- 5.00 |" in out
    hns = human_normalized_score("BreakoutNoFrameskip-v4", 19.76)
    assert f"| published DrQ(eps) | 100 | 100000 | 19.76 (mean) | {hns:.3f} |" in out
    assert f"| 26 games of --published | drq | 1 | {human_normalized_score('Breakout', 15.0):.3f} |" in out
    assert "| 26 games of --published | published DrQ(eps) (100 runs per game) | 26 | 0.280 | [0.271, 0.288] |" in out
    assert "Published: Agarwal et al. 2021" in out
    assert main([str(tmp_path), "--published", str(tmp_path / "none.json")]) == 2


def test_the_published_runs_iqm_over_the_games_we_ran_beside_ours(tmp_path, capsys):
    """with runs of Breakout and Pong only, the published runs' IQM over those two games (200 runs), computed here
    with scipy's 25% trimmed mean of human-normalised scores from DESIGN.md's random and human scores, sits beside
    ours; and the published per-run scores average to the per-game means the file states"""
    from scipy import stats

    from cleanrl_utils.tools.results import main

    published = json.loads(PUBLISHED.read_text())
    assert sorted(published["runs"]) == sorted(published["games"])
    for game, runs in published["runs"].items():
        assert len(runs) == 100 and np.mean(runs) == pytest.approx(published["games"][game], abs=0.006), game
    for game, score in (("Breakout", 12.0), ("Pong", -5.0)):
        folder = tmp_path / f"{game}NoFrameskip-v4__drq__1__1700000000"
        folder.mkdir()
        receipt = {"status": "finished", "algo": "drq", "seed": 1, "counts": {"env_steps": 100_000}}
        receipt["args"] = {"env_id": f"{game}NoFrameskip-v4", "exp_name": "drq"}
        (folder / "receipt.json").write_text(json.dumps(receipt))
        (folder / "evaluations.json").write_text(json.dumps([{"step": 100_000, "final": True, "mean": score}]))
    assert main([str(tmp_path), "--published", str(PUBLISHED)]) == 0
    out = capsys.readouterr().out
    random_human = {"Breakout": (1.7, 30.5), "Pong": (-20.7, 14.6)}
    hns = [(s - r) / (h - r) for game, (r, h) in random_human.items() for s in published["runs"][game]]
    expected = stats.trim_mean(hns, 0.25)
    [line] = [line for line in out.splitlines() if line.startswith("| the 2 games of drq |")]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[1:3] == ["published DrQ(eps), 100 runs per game", "2"]
    assert float(cells[3]) == pytest.approx(expected, abs=0.0005), (line, expected)
    low, high = (float(x) for x in cells[4].strip("[]").split(","))
    assert low < float(cells[3]) < high and high - low < 0.2


def test_the_saved_model_records_no_forced_steps_and_the_evaluation_command_plays_so(toy_run, drq, tmp_path):
    """the model file says which protocol its run played (Dopamine's: nothing pressed for the agent); the evaluation
    command replays it so: on Breakout, every step of the game is counted as the agent's own action"""
    saved = torch.load(toy_run("drq").dir / "drq.cleanrl_model", map_location="cpu", weights_only=True)
    assert (
        saved["protocol"] == {"forced_steps": False, "zero_stacks": True, "noop_starts": "frames"}
        and saved["algo"] == "drq"
    )
    model = tmp_path / "drq.cleanrl_model"
    # no-op frames (the default; no-op steps are pressed for the agent too), so the forced steps alone are counted
    protocol = saved["protocol"]
    breakout = {"env_id": "BreakoutNoFrameskip-v4", "n_actions": 4, "protocol": protocol}
    torch.save({**saved, "state_dict": drq.QNetwork(4).state_dict(), **breakout}, model)
    for flags, forced in (([], False), (["--forced-steps"], True)):
        done = run_python(
            "-m", "cleanrl_utils.tools.evaluate", str(model), "--episodes", "1", "--epsilon", "1", "--json", *flags
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
        assert result["protocol"] == {**protocol, "forced_steps": forced}
        [length] = result["episodic_lengths"]
        # a random agent's Breakout: 5 lives; with forced steps FIRE, 2 at the start and NOOP, FIRE, 2 after 4 losses
        assert sum(result["action_histogram"]) == length - (2 + 3 * 4 if forced else 0)


def test_the_evaluation_command_refuses_a_model_that_does_not_record_its_protocol(toy_run, drq, tmp_path):
    """no guess for a model file without its protocol: a clear error naming both flags, and a flag plays it; a file
    that records ``forced_steps`` alone (the versions before zero stacks) is played so, with the defaults beside"""
    saved = torch.load(toy_run("drq").dir / "drq.cleanrl_model", map_location="cpu", weights_only=True)
    saved = {k: v for k, v in saved.items() if k != "protocol"}  # as an earlier version saved it
    model = tmp_path / "drq.cleanrl_model"
    old = {**saved, "state_dict": drq.QNetwork(4).state_dict(), "env_id": "BreakoutNoFrameskip-v4", "n_actions": 4}
    torch.save({**old, "forced_steps": False}, model)
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(model), "--episodes", "1", "--epsilon", "1", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["protocol"] == {"forced_steps": False}, done.stderr[-3000:]
    torch.save(old, model)
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(model), "--episodes", "1", "--epsilon", "1")
    assert done.returncode == 2 and "--forced-steps" in done.stderr and "--no-forced-steps" in done.stderr, done.stderr
    assert "does not record its protocol" in done.stderr and "Traceback" not in done.stderr
    done = run_python(
        "-m",
        "cleanrl_utils.tools.evaluate",
        str(model),
        "--episodes",
        "1",
        "--epsilon",
        "1",
        "--no-forced-steps",
        "--json",
    )  # random play (epsilon 1) presses FIRE: an untrained greedy agent may not, and play to the 27,000-step cap
    assert done.returncode == 0 and json.loads(done.stdout)["protocol"] == {"forced_steps": False}, done.stderr[-3000:]
