# Double DQN (van Hasselt et al. 2016): DQN with the online network choosing the next action
# and the target network evaluating it; CleanRL's dqn_atari.py defaults; docs in README.md
import os
import random
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tyro

from cleanrl_utils.buffer import ReplayBuffer, bytes_per_transition
from cleanrl_utils.checkpoint import Checkpointer, continue_run
from cleanrl_utils.checks import CpuThreads, check_memory, fail, pick_buffer_device, pick_device, validate_common_args
from cleanrl_utils.encoder import NatureCNN, check_encoder
from cleanrl_utils.envs import EnvIdError, TrainEnvs, check_env_id
from cleanrl_utils.evaluation import evaluate
from cleanrl_utils.fast import FastSettings, prepare
from cleanrl_utils.noisy import NoisyLinear, reset_noise
from cleanrl_utils.prioritized import PRIORITY_BYTES, PrioritizedReplayBuffer
from cleanrl_utils.run import Run


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    device: str = "auto"
    """auto (CUDA, then MPS, then CPU), cuda, mps or cpu"""
    torch_threads: int = 0
    """torch's CPU threads (0: automatic, printed at start; see README, "Throughput")"""
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
    run_dir: str = "runs"
    """the folder that receives the run folder"""
    checkpoint_every: int = 250_000
    """agent steps between checkpoints (0: only on SIGINT/SIGTERM); shorter runs write none"""
    checkpoint_buffer: bool = False
    """whether checkpoints hold the replay memory too (exact resume; ~7 GB per 1M transitions)"""
    checkpoint_keep: int = 3
    """how many of the newest checkpoints to keep"""
    resume: str | None = None
    """a run folder (its newest checkpoint) or one checkpoint folder to continue, in the same run folder"""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """on a non-finite loss: stop the run (its checkpoints kept), or skip that update"""
    fast: bool = True
    """the fast update (same loss and gradients to float tolerance; benchmarks/RESULTS.md): channels-last
    convolutions and the fused Adam kernel on CPU, the fused Adam kernel on CUDA; --no-fast: the plain update"""
    buffer_device: Literal["host", "cuda"] = "host"
    """where the replay frames live: host memory, or the training GPU (about 7.1 GB per 1M transitions)"""

    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the environment"""
    total_timesteps: int = 10_000_000
    """total agent steps of the experiment, summed over environments"""
    learning_rate: float = 1e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 1000
    """the agent steps it takes to update the target network"""
    batch_size: int = 32
    """the batch size of sample from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    learning_starts: int = 80_000
    """agent steps to start learning"""
    train_frequency: int = 4
    """agent steps per gradient update, whatever the number of environments"""
    eval_every: int = 500_000
    """agent steps between evaluations (0: only the final one)"""
    eval_episodes: int = 10
    """whole games per evaluation"""
    eval_epsilon: float = 0.01
    """epsilon of the evaluation policy (0: greedy)"""
    n_step: int = 1
    """the number of steps of the multi-step return (stops at episode ends); 1: the one-step target"""
    prioritized: bool = False
    """whether to sample the replay memory in proportion to |TD error| (prioritized replay, Schaul et al. 2016)"""
    prioritized_alpha: float = 0.5
    """with --prioritized: the priority exponent, p = (|TD error| + eps) ** alpha (0: uniform sampling)"""
    prioritized_beta: float = 0.4
    """with --prioritized: the importance-sampling exponent at the start, annealed linearly to 1 over the run"""
    prioritized_eps: float = 1e-6
    """with --prioritized: added to |TD error| before the exponent, so that no transition's priority is 0"""
    dueling: bool = False
    """whether the head is dueling: a value stream plus the advantages less their mean (Wang et al. 2016)"""
    noisy: bool = False
    """whether the head's layers are noisy (Fortunato et al. 2018), redrawn at each update; epsilon-greedy stays:
    add --start-e 0 --end-e 0 to explore by the noise alone"""
    noisy_sigma: float = 0.5
    """with --noisy: sigma_0 of the factorised Gaussian noise"""


class QNetwork(nn.Module):
    def __init__(self, n_actions: int, dueling: bool = False, noisy: bool = False, noisy_sigma: float = 0.5):
        super().__init__()
        self.encoder = NatureCNN()
        linear = partial(NoisyLinear, sigma_0=noisy_sigma) if noisy else nn.Linear  # --noisy: noisy head layers
        self.head = linear(512, n_actions)  # the Q-values; with --dueling, the advantages
        self.value = linear(512, 1) if dueling else None  # --dueling: the state's value

    def forward(self, x):
        features = self.encoder(x)
        if self.value is None:
            return self.head(features)
        return dueling_q_values(self.value(features), self.head(features))


def dueling_q_values(value, advantage):
    """Wang et al. (2016): Q(s, a) = V(s) + A(s, a) - mean_a' A(s, a'); (batch, 1), (batch, n_actions)"""
    return value + advantage - advantage.mean(dim=1, keepdim=True)


def compute_td_target(q_network, target_network, data, gamma: float, n_step: int = 1):
    """r + gamma * Q_target(s', argmax_a' Q(s', a')), no bootstrap after a terminal; with
    --n-step, r is the discounted n-step reward sum and gamma^k the batch's `discounts`"""
    next_observations = data.next_observations
    with torch.no_grad():
        next_actions = q_network(next_observations).argmax(dim=1, keepdim=True)
        target_max = target_network(next_observations).gather(1, next_actions).squeeze(1)
    if n_step > 1:  # --n-step: the n-step reward sum, then gamma^k (k <= n; 0 after a terminal) from the batch
        return data.rewards + data.discounts * target_max
    return data.rewards + gamma * target_max * (1 - data.dones)


def weighted_mse_loss(td_target, old_val, weights):
    """--prioritized: each squared TD error scaled by its importance-sampling weight, averaged over the batch"""
    return (weights * (td_target - old_val) ** 2).mean()


def compute_loss(q_network, target_network, data, args):
    """the loss on a sampled batch, the metrics the loop logs, and the TD errors (the priorities' source)"""
    td_target = compute_td_target(q_network, target_network, data, args.gamma, args.n_step)
    old_val = q_network(data.observations).gather(1, data.actions.unsqueeze(1)).squeeze(1)
    if args.prioritized:  # the weights correct the bias of prioritized sampling
        loss = weighted_mse_loss(td_target, old_val, data.weights)
    else:
        loss = F.mse_loss(td_target, old_val)
    return loss, {"td_loss": loss, "q_values": old_val.mean()}, td_target - old_val


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def beta_schedule(beta_0: float, duration: int, t: int):
    """the importance-sampling exponent, from beta_0 at step 0 linearly to 1 at step `duration`"""
    return beta_0 + (1.0 - beta_0) * min(1.0, t / duration)


if __name__ == "__main__":
    setup_start = time.perf_counter()
    args = tyro.cli(Args)
    args, resumed = continue_run(args, __file__)  # --resume: the run's own settings; a bad checkpoint stops here
    validate_common_args(args)
    cpu_threads = CpuThreads(args.torch_threads)  # fewer torch threads while other processes hold cores
    torch.set_num_threads(cpu_threads.choose())
    if args.n_step < 1:
        fail(f"--n-step {args.n_step} must be a positive integer (1: one-step returns; Rainbow uses 3)")
    slots = -(-args.buffer_size // args.num_envs)
    if slots < 4 + args.n_step + 1:
        fail(
            f"--buffer-size {args.buffer_size} gives {slots} replay slots per environment with --num-envs "
            f"{args.num_envs}; --n-step {args.n_step} needs at least {4 + args.n_step + 1}: raise --buffer-size "
            f"to at least {(4 + args.n_step + 1) * args.num_envs} or lower --n-step"
        )
    if not (np.isfinite(args.prioritized_alpha) and args.prioritized_alpha >= 0):
        fail(f"--prioritized-alpha {args.prioritized_alpha} must be >= 0 (0: uniform sampling; Rainbow uses 0.5)")
    if not 0.0 <= args.prioritized_beta <= 1.0:
        fail(f"--prioritized-beta {args.prioritized_beta} must be in [0, 1] (annealed to 1; Rainbow starts at 0.4)")
    if not (np.isfinite(args.prioritized_eps) and args.prioritized_eps > 0):
        fail(f"--prioritized-eps {args.prioritized_eps} must be > 0 and finite; use e.g. --prioritized-eps 1e-6")
    if not (np.isfinite(args.noisy_sigma) and args.noisy_sigma >= 0):
        fail(f"--noisy-sigma {args.noisy_sigma} must be >= 0 and finite (0: no noise; Rainbow uses 0.5)")
    try:
        check_env_id(args.env_id)
    except EnvIdError as error:
        fail(str(error))
    device = pick_device(args.device)
    buffer_device = pick_buffer_device(args.buffer_device, device)  # --buffer-device cuda: frames on the GPU
    check_memory(args.buffer_size, bytes_per_transition() + (PRIORITY_BYTES if args.prioritized else 0), buffer_device)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    try:
        envs = TrainEnvs(args.env_id, args.num_envs, seed=args.seed)
    except EnvIdError as error:
        fail(str(error))
    network_kwargs = dict(dueling=args.dueling, noisy=args.noisy, noisy_sigma=args.noisy_sigma)
    q_network = QNetwork(envs.n_actions, **network_kwargs).to(device)
    check_encoder(q_network.encoder)
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(envs.n_actions, **network_kwargs).to(device)
    target_network.load_state_dict(q_network.state_dict())
    buffer_kwargs = dict(
        device=device, n_step=args.n_step, gamma=args.gamma, seed=args.seed, storage_device=buffer_device
    )
    if args.prioritized:  # --prioritized: sampled in proportion to (|TD error| + eps) ** alpha
        alpha, eps = args.prioritized_alpha, args.prioritized_eps
        rb = PrioritizedReplayBuffer(args.buffer_size, args.num_envs, **buffer_kwargs, alpha=alpha, eps=eps)
    else:
        rb = ReplayBuffer(args.buffer_size, args.num_envs, **buffer_kwargs)
    rng = np.random.default_rng(args.seed)
    run = Run(args, __file__, device, resumed)  # the run folder appears once everything is allocated
    checkpointer = Checkpointer(
        run,
        resumed,
        q_network=q_network,
        target_network=target_network,
        optimizer=optimizer,
        replay=rb,
        envs=envs,
        rng=rng,
    )
    # the loss, its backward pass and the optimizer step, run as --fast says (cleanrl_utils/fast.py)
    settings = FastSettings.for_device(device) if args.fast else FastSettings()
    loss_fn = partial(compute_loss, q_network, target_network, args=args)
    update = prepare([q_network, target_network], optimizer, loss_fn, settings, args.on_nonfinite == "skip")
    run.timings["setup"] += time.perf_counter() - setup_start

    obs, global_step, update_credit, start_time = checkpointer.start()  # a fresh start, or where the checkpoint left
    metrics = None  # the latest update's metrics (tensors), read when logged
    while global_step < args.total_timesteps:
        previous_step = global_step
        epsilon = linear_schedule(
            args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step
        )
        with run.timed("acting"):
            if args.noisy and global_step <= checkpointer.learning_starts:  # --noisy: a new draw per step until
                reset_noise(q_network)  # learning starts, then one per update
            actions = rng.integers(0, envs.n_actions, args.num_envs)
            greedy = rng.random(args.num_envs) >= epsilon
            if greedy.any():
                with torch.no_grad():
                    q_values = q_network(torch.as_tensor(obs[greedy], device=device))
                actions[greedy] = q_values.argmax(dim=1).cpu().numpy()
        with run.timed("environment"):
            envs.send(actions)  # the games step in their own threads while the learner updates, below
        global_step += args.num_envs
        run.counts["env_steps"] = global_step

        if global_step > checkpointer.learning_starts:
            update_credit += args.num_envs
            while update_credit >= args.train_frequency:  # one update per train_frequency agent steps
                update_credit -= args.train_frequency
                with run.timed("learning"):
                    if args.noisy:  # a new noise draw per update, independent for the two networks;
                        reset_noise(q_network)  # acting uses the online one's until the next update
                        reset_noise(target_network)
                    if args.prioritized:  # plus importance-sampling weights (beta annealed to 1) and indices
                        beta = beta_schedule(args.prioritized_beta, args.total_timesteps, global_step)
                        data = rb.sample(args.batch_size, beta)
                    else:
                        data = rb.sample(args.batch_size)
                    _, metrics, td_errors = update(data)  # compute_loss, its backward pass, the optimizer step
                    if update.last_skipped:  # --on-nonfinite skip: a non-finite loss, no optimizer step
                        run.counts["skipped_updates"] += 1
                        continue
                    if args.prioritized:  # new priorities from each transition's |TD error|
                        rb.update_priorities(data.indices, td_errors)
                run.counts["gradient_updates"] += 1

            if global_step // 1000 > previous_step // 1000 and metrics is not None:
                # the only host synchronisation of the loop; a non-finite value stops the run here
                run.train_metrics(global_step, metrics, q_network)

            # update target network
            if global_step // args.target_network_frequency > previous_step // args.target_network_frequency:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters(), strict=True):
                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)

        with run.timed("environment"):
            step = envs.recv()
        for _, episodic_return, length in step.episode_returns:
            run.episode(global_step, episodic_return, length)
        # the step after a game ends returns the reset observation: not a transition (mask)
        rb.add(obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        run.counts["transitions_stored"] += int(step.mask.sum())
        obs = step.next_obs

        if global_step // 100 > previous_step // 100:
            sps = run.recent_sps(global_step)  # steps/s over the last minute, this process's steps only
            torch.set_num_threads(cpu_threads.choose())  # re-read every 5 s
            run.scalar("charts/SPS", int(sps), global_step)
            run.scalar("charts/epsilon", epsilon, global_step)
            run.show_progress(global_step, args.total_timesteps, sps)

        if (
            args.eval_every
            and global_step // args.eval_every > previous_step // args.eval_every
            and global_step < args.total_timesteps
        ):
            with run.timed("evaluation"):
                result = evaluate(
                    q_network,
                    args.env_id,
                    envs.n_actions,
                    device,
                    args.eval_episodes,
                    args.eval_epsilon,
                    seed=args.seed + 10_000 + 100 * run.counts["evaluations"],
                    video_path=run.video_path(global_step),
                )
            run.evaluation(global_step, result)
            run.write_receipt()

        if checkpointer.due(global_step, previous_step):  # periodic, or after SIGINT/SIGTERM (then exits 0)
            checkpointer.save(global_step, obs, update_credit, start_time)

    with run.timed("evaluation"):
        result = evaluate(
            q_network,
            args.env_id,
            envs.n_actions,
            device,
            args.eval_episodes,
            args.eval_epsilon,
            seed=args.seed + 10_000 + 100 * run.counts["evaluations"],
            video_path=run.video_path(global_step),
        )
    run.evaluation(global_step, result, final=True)
    if args.save_model:
        run.save_model(q_network, envs.n_actions, **network_kwargs)
    envs.close()
    run.close()
