# DrQ(epsilon) for Atari 100k: DQN with data augmentation (Kostrikov et al. 2020) and the epsilon settings of
# Agarwal et al. (2021), as Dopamine's labs/atari_100k/configs/DrQ_eps.gin runs it: a dueling head, Double DQN's
# target, 10-step returns, one update per agent step, the target network synced at every step, Huber loss, and
# random shifts (4-pixel edge padding, one offset per batch) plus intensity noise on s and s' of every sampled batch.
# By default the agent of Dopamine's code of 2021, which made the published DrQ(eps) runs: one shift per batch
# (--shift-per) and 0 to 30 no-op frames at a game's start (--noop-starts); --shift-per sample --noop-starts steps give
# Dopamine's code of today. The network and the games are Dopamine's too, each difference from the other scripts a
# flag: the Nature encoder's layers with SAME padding (--encoder), Xavier-uniform initialisation (--init), zero-filled
# first stacks of games and lives (--zero-stacks), nothing pressed for the agent (--forced-steps). Settings and
# sources in docs/algorithms.md.
import os
import sys
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.encoder import NatureCNN
from cleanrl_utils.envs import TrainEnvs
from cleanrl_utils.run import Run, RunFlags, parse_args


@dataclass
class Args(RunFlags):  # + the shared flags for running: threads, run folder, checkpoints, resume
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    device: Literal["auto", "cuda", "mps", "cpu"] = "auto"
    """auto (CUDA, then MPS, then CPU), cuda, mps or cpu"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "value-atari"
    """the wandb's project name"""
    wandb_entity: str | None = None
    """the entity (team) of wandb's project"""
    capture_video: bool = False
    """whether to record the evaluation games as MP4 in the run folder"""
    save_model: bool = False
    """whether to save the model into the run folder"""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """on a non-finite loss: stop the run (its checkpoints kept), or skip that update"""
    fast: bool = True
    """the fast update, same loss and gradients to float tolerance (benchmarks/RESULTS.md): Adam's fused kernel on
    CPU and CUDA, channels-last convolutions on CPU; --no-fast: the plain update"""

    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the environment"""
    total_timesteps: int = 100_000
    """total agent steps of the experiment, summed over environments (Atari 100k: 100,000, 400k frames)"""
    learning_rate: float = 1e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments"""
    buffer_size: int = 100_000
    """the replay memory buffer size (the reference's 1M stands for unbounded: 100k keeps every transition)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 1
    """the agent steps it takes to update the target network (1: after every update, as the reference)"""
    batch_size: int = 32
    """the batch size of sample from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.05
    """the fraction of `total-timesteps` it takes from start-e to go end-e, counted from `learning-starts`
    (epsilon is start-e until then; 0.05: the reference's 5,000 agent steps)"""
    learning_starts: int = 1_600
    """agent steps to start learning"""
    train_frequency: int = 1
    """agent steps per gradient update, whatever the number of environments"""
    eval_every: int = 0
    """agent steps between evaluations (0: only the final one, the score Atari 100k reports)"""
    eval_episodes: int = 100
    """whole games per evaluation"""
    eval_epsilon: float = 0.001
    """epsilon of the evaluation policy (0: greedy)"""
    adam_eps: float = 1.5e-4
    """the epsilon of the Adam optimizer (the reference's 1.5e-4)"""
    n_step: int = 10
    """the number of steps of the multi-step return (stops at episode ends); --n-step 1: the one-step target"""
    augmentation: bool = True
    """whether s and s' of each sampled batch are randomly shifted and scaled in intensity (DrQ); --no-augmentation:
    the same agent without it"""
    augmentation_pad: int = 4
    """the random shift's edge padding in pixels: each image moves by -pad to pad - 1 pixels on each axis"""
    intensity_scale: float = 0.05
    """each image is multiplied by 1 + scale * clip(N(0, 1), -2, 2) (0: shifts only)"""
    shift_per: Literal["sample", "batch"] = "batch"
    """the random shift: `batch`, one shift for all the stacks of s and another for those of s' (Dopamine's code in
    2021, when the published DrQ(eps) runs were made); `sample`, each sampled stack its own (Dopamine's code since
    February 2022, as DrQ's own); the intensity is drawn per stack in both"""
    forced_steps: bool = False
    """whether FIRE is pressed for the agent at a game's start and after a life loss (NOOP, FIRE, 2), as the other
    scripts' protocol (CleanRL's wrappers); off: the agent plays every step, as Dopamine's Atari 100k"""
    zero_stacks: bool = True
    """whether the first stack of a game and of a life is zero-filled (three black frames, then the first), in
    training, the replay memory and evaluation, as Dopamine's agent; off: the first frame four times at a game's
    start, the stack carried on across a life loss (the other scripts' without forced steps)"""
    noop_starts: Literal["steps", "frames"] = "frames"
    """frames: each game starts with 0 to 30 no-op frames, as the other scripts and nearest to Dopamine's runner of
    2021 (0 to 29 single frames); steps: 0 to 29 NOOP agent steps (4 frames each) pressed for the agent, as Dopamine's
    Atari 100k runner of today"""
    encoder: Literal["dopamine", "nature"] = "dopamine"
    """dopamine: the Nature encoder's layers with SAME padding, as Dopamine's network (7,744 features, 4,043,424
    parameters); nature: the fixed Nature encoder of every other script (3,136 features), for equal capacity"""
    init: Literal["xavier", "torch"] = "xavier"
    """xavier: Xavier-uniform weights and zero biases in every layer, as Dopamine's Flax layers; torch: PyTorch's
    default initialisation, as the other scripts"""


class QNetwork(nn.Module):
    def __init__(self, n_actions: int, same_padding: bool = True, xavier: bool = True):
        super().__init__()
        self.encoder = NatureCNN(same_padding=same_padding)  # SAME padding: Dopamine's, a declared variant
        self.value = nn.Linear(512, 1)  # dueling (Wang et al. 2016): a value stream
        self.advantage = nn.Linear(512, n_actions)  # and an advantage stream
        if xavier:
            xavier_init(self)

    def forward(self, x):
        features = self.encoder(x)
        advantage = self.advantage(features)
        return self.value(features) + advantage - advantage.mean(dim=1, keepdim=True)


def xavier_init(network: nn.Module) -> None:
    """Dopamine's initialisation (Flax's nn.Conv and nn.Dense with kernel_init=xavier_uniform(), zero biases): each
    weight uniform in +-sqrt(6 / (fan_in + fan_out)), a convolution's fans counting its kernel's area"""
    for layer in network.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)


def augment(obs, pad: int, intensity_scale: float, generator=None, shift_per: str = "sample"):
    """DrQ's augmentation as Dopamine's drq_image_augmentation: each stack (all its frames alike) padded by `pad`
    pixels repeating its edges, cropped back to its size at a random offset in [0, 2 pad) on each axis (a shift
    by -pad to pad - 1 pixels), then multiplied by 1 + intensity_scale * clip(N(0, 1), -2, 2); each sample its
    own draw (`shift_per="batch"`: one offset for the whole batch, the scales still per sample). uint8 or float
    (batch, stack, H, W) -> float32 on the 0-255 scale (the encoder divides by 255), in channels-last memory order,
    which the CPU's convolutions read faster (benchmarks/RESULTS.md)"""
    n, stack, h, w = obs.shape
    # drawn on the CPU (torch's generator there, or `generator`): no read back from an accelerator
    draws = n if shift_per == "sample" else 1  # "batch": one offset for every stack, as Dopamine's code in 2021
    shifts = torch.randint(0, 2 * pad, (draws, 2), generator=generator) if pad > 0 else torch.full((draws, 2), pad)
    shifts = shifts.expand(n, 2)
    noise = torch.randn(n, 1, 1, 1, generator=generator).clamp(-2.0, 2.0).to(obs.device)
    # padding by repeated edges, then cropping at (y, x), reads row clamp(r + y - pad) and column clamp(c + x - pad)
    # of the image: those pixels are gathered directly, on uint8, without building the padded copy
    rows = (torch.arange(h) + shifts[:, :1] - pad).clamp(0, h - 1)
    cols = (torch.arange(w) + shifts[:, 1:] - pad).clamp(0, w - 1)
    pixels = (rows[:, :, None] * w + cols[:, None, :]).reshape(n, 1, h * w).expand(n, stack, h * w).to(obs.device)
    cropped = obs.reshape(n, stack, h * w).gather(2, pixels).view(n, stack, h, w)
    # the scaled floats written straight into channels-last memory: one pass, not a reordered copy first
    out = torch.empty(n, stack, h, w, device=obs.device, memory_format=torch.channels_last)
    return torch.mul(cropped.float(), 1.0 + intensity_scale * noise, out=out)


def augment_batch(data, pad: int, intensity_scale: float, generator=None, shift_per: str = "sample"):
    """s and s' augmented with independent draws (the reference's two keys); the rest of the batch as it is"""
    observations = augment(data.observations, pad, intensity_scale, generator, shift_per)
    next_observations = augment(data.next_observations, pad, intensity_scale, generator, shift_per)
    return data._replace(observations=observations, next_observations=next_observations)


def compute_td_target(q_network, target_network, data):
    """Double DQN's n-step target: R + gamma^k * Q_target(s', argmax_a' Q_online(s', a')), R the n-step discounted
    reward sum, s' the state k <= n steps later, gamma^k the batch's `discounts` (0 after a terminal)"""
    with torch.no_grad():
        online_next = q_network(data.next_observations)
        next_actions = online_next.argmax(dim=1, keepdim=True)
        # the target synced after every update holds the online weights: the script passes the online network, and
        # its forward of s' serves both (the same numbers, one forward fewer; benchmarks/RESULTS.md)
        target_next = online_next if target_network is q_network else target_network(data.next_observations)
        next_q = target_next.gather(1, next_actions).squeeze(1)
        td_target = data.rewards + data.discounts * next_q
    return td_target


def compute_loss(q_network, target_network, data, args):
    """the loss on a sampled batch and the metrics the loop logs: Huber (delta 1), as the reference"""
    td_target = compute_td_target(q_network, target_network, data)
    old_val = q_network(data.observations).gather(1, data.actions.unsqueeze(1)).squeeze(1)
    loss = F.smooth_l1_loss(old_val, td_target)
    return loss, {"td_loss": loss, "q_values": old_val.mean()}


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def check_args(args: Args) -> str | None:
    """this script's own flags (the shared ones are checked by the run): what is wrong, or None"""
    if args.n_step < 1:
        return f"--n-step {args.n_step} must be a positive integer (1: one-step returns; DrQ(eps) uses 10)"
    if args.augmentation_pad < 0:
        return f"--augmentation-pad {args.augmentation_pad} must be >= 0 (0: no shift; DrQ uses 4)"
    if not (np.isfinite(args.intensity_scale) and 0 <= args.intensity_scale < 0.5):
        return (
            f"--intensity-scale {args.intensity_scale} must be in [0, 0.5), so that 1 + scale * clip(N(0, 1), -2, 2) "
            "stays positive (0: no intensity noise; DrQ uses 0.05)"
        )
    return None


if __name__ == "__main__":
    args = parse_args(Args)  # tyro.cli(Args): the algorithm's flags, then the run flags
    run = Run(args, __file__, check_args)  # --resume, the checks, device, threads, seeding, signals
    device = run.device

    # the games as Dopamine's Atari 100k runner of 2021 played them (the defaults): no FIRE pressed for the agent,
    # zero-filled first stacks, no-op frames at a game's start; the evaluations play them so too
    protocol = dict(forced_steps=args.forced_steps, zero_stacks=args.zero_stacks, noop_starts=args.noop_starts)
    envs = TrainEnvs(args.env_id, args.num_envs, seed=args.seed, **protocol)
    network = dict(same_padding=args.encoder == "dopamine", xavier=args.init == "xavier")
    q_network = QNetwork(envs.n_actions, **network).to(device)
    target_network = QNetwork(envs.n_actions, **network).to(device)
    target_network.load_state_dict(q_network.state_dict())
    run.fast(q_network, target_network)  # --fast: channels-last convolutions on CPU
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate, eps=args.adam_eps, fused=run.fused)
    buffer_kwargs = dict(
        device=device,
        n_step=args.n_step,
        gamma=args.gamma,
        seed=args.seed,
        storage_device=run.buffer_device,
        compress=args.compress_replay,
    )
    rb = ReplayBuffer(args.buffer_size, args.num_envs, **buffer_kwargs)
    rng = np.random.default_rng(args.seed)
    # what the run owns, declared once: a checkpoint saves it and --resume puts it back
    obs, global_step = run.own(
        envs, rb, policy=q_network, q_network=q_network, target_network=target_network, optimizer=optimizer, rng=rng
    )
    # synced after every update (one game, the period 1, tau 1: the reference's), the target equals the online network
    target_now = (
        q_network if (args.num_envs, args.target_network_frequency, args.tau) == (1, 1, 1.0) else target_network
    )

    metrics = None  # the latest update's metrics (tensors), read every 1000 steps
    while global_step < args.total_timesteps:
        previous_step = global_step
        epsilon = linear_schedule(  # start-e until learning starts, as the reference
            args.start_e,
            args.end_e,
            args.exploration_fraction * args.total_timesteps,
            max(global_step - args.learning_starts, 0),
        )
        with run.timed("acting"):
            actions = rng.integers(0, envs.n_actions, args.num_envs)
            greedy = rng.random(args.num_envs) >= epsilon
            if greedy.any():
                with torch.no_grad():
                    q_values = q_network(torch.as_tensor(obs[greedy], device=device))
                actions[greedy] = q_values.argmax(dim=1).cpu().numpy()
        envs.send(actions)  # the games step in their own threads while the learner updates, below
        global_step += args.num_envs

        if global_step > run.learning_starts:
            # one update per train_frequency agent steps, whatever the number of environments
            for _ in range(global_step // args.train_frequency - previous_step // args.train_frequency):
                with run.timed("learning"):
                    data = rb.sample(args.batch_size)
                    if args.augmentation:  # DrQ: torch's CPU generator draws the shifts and scales (checkpointed)
                        data = augment_batch(
                            data, args.augmentation_pad, args.intensity_scale, shift_per=args.shift_per
                        )
                    loss, metrics = compute_loss(q_network, target_now, data, args)
                    if run.skip(loss):  # --on-nonfinite skip: a non-finite loss is not applied
                        continue
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()

            # update target network (not while the online network is its own target: copying its 4M weights after
            # every update would add 40% to the step, benchmarks/RESULTS.md)
            crossed = global_step // args.target_network_frequency > previous_step // args.target_network_frequency
            if crossed and target_now is target_network:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters(), strict=True):
                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)

        step = envs.recv()
        # the step after a game ends returns the reset observation: not a transition (mask)
        rb.add(obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        obs = step.next_obs
        if run.step(global_step, obs, step, epsilon, metrics):  # log, evaluate, checkpoint when due; True: stop
            break

    sys.exit(run.finish(**network))  # the final evaluation, the saved model, the closed record (or the stop's message)
