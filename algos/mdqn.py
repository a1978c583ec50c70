# Munchausen DQN (Vieillard, Pietquin and Geist, NeurIPS 2020): DQN with a soft target under the softmax policy
# pi = softmax(q / tau) and the scaled log-policy of the taken action added to the reward; the paper's Atari settings
# (its Dopamine configuration: google-research/munchausen_rl configs/atari.gin); docs in docs/algorithms.md
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
    total_timesteps: int = 10_000_000
    """total agent steps of the experiment, summed over environments"""
    learning_rate: float = 5e-5
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 8000
    """the agent steps it takes to update the target network"""
    batch_size: int = 32
    """the batch size of sample from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.025
    """the fraction of `total-timesteps` it takes from start-e to go end-e (0.025 of 10M: the paper's 250k steps)"""
    learning_starts: int = 20_000
    """agent steps to start learning"""
    train_frequency: int = 4
    """agent steps per gradient update, whatever the number of environments"""
    eval_every: int = 500_000
    """agent steps between evaluations (0: only the final one)"""
    eval_episodes: int = 10
    """whole games per evaluation"""
    eval_epsilon: float = 0.01
    """epsilon of the evaluation policy (0: greedy)"""
    adam_eps: float = 3.125e-4
    """the epsilon of the Adam optimizer (the paper's 0.01 / 32)"""
    m_alpha: float = 0.9
    """Munchausen scaling alpha of the log-policy bonus, in [0, 1] (0: soft DQN without the bonus)"""
    m_tau: float = 0.03
    """entropy temperature tau of the policy pi = softmax(q / tau), > 0 (not --tau, the target update rate)"""
    m_l0: float = -1.0
    """lower clipping bound l0 of the bonus term tau * log pi(a|s), < 0"""


class QNetwork(nn.Module):
    def __init__(self, n_actions: int):
        super().__init__()
        self.encoder = NatureCNN()
        self.head = nn.Linear(512, n_actions)

    def forward(self, x):
        return self.head(self.encoder(x))


def scaled_log_policy(q_values, m_tau: float):
    """tau * log softmax(q / tau) over the actions, computed stably around the row's max (log-sum-exp)"""
    shifted = q_values - q_values.max(dim=1, keepdim=True).values
    return shifted - m_tau * torch.logsumexp(shifted / m_tau, dim=1, keepdim=True)


def policy_entropy(q_values, m_tau: float):
    """entropy of pi = softmax(q / tau), per row"""
    log_pi = scaled_log_policy(q_values, m_tau) / m_tau
    return -(log_pi.exp() * log_pi).sum(dim=1)


def munchausen_target(target_q, target_next_q, actions, rewards, dones, gamma, m_alpha, m_tau, m_l0):
    """r + alpha * clip(tau log pi(a|s), l0, 0) + gamma * sum_a' pi(a'|s') (q(s', a') - tau log pi(a'|s')),
    pi = softmax(q / tau) of the target network's q; no bootstrap after a terminal. Also returns the bonus."""
    tau_log_pi = scaled_log_policy(target_q, m_tau).gather(1, actions.unsqueeze(1)).squeeze(1)
    bonus = m_alpha * tau_log_pi.clamp(min=m_l0, max=0.0)
    next_tau_log_pi = scaled_log_policy(target_next_q, m_tau)
    next_pi = (next_tau_log_pi / m_tau).exp()
    soft_value = (next_pi * (target_next_q - next_tau_log_pi)).sum(dim=1)
    return rewards + bonus + gamma * soft_value * (1 - dones), bonus


def compute_loss(q_network, target_network, data, args):
    """the loss on a sampled batch and the metrics the loop logs"""
    with torch.no_grad():
        target_q = target_network(data.observations)  # pi(.|s) for the bonus
        target_next_q = target_network(data.next_observations)
        td_target, bonus = munchausen_target(
            target_q, target_next_q, data.actions, data.rewards, data.dones,
            args.gamma, args.m_alpha, args.m_tau, args.m_l0,
        )  # fmt: skip
    old_val = q_network(data.observations).gather(1, data.actions.unsqueeze(1)).squeeze(1)
    loss = F.smooth_l1_loss(td_target, old_val)  # Huber loss, as the paper's Dopamine agent
    entropy = policy_entropy(target_q, args.m_tau).mean()
    return loss, {
        "td_loss": loss,
        "q_values": old_val.mean(),
        "munchausen_bonus": bonus.mean(),
        "policy_entropy": entropy,
    }


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def check_args(args: Args) -> str | None:
    """this script's own flags (the shared ones are checked by the run): what is wrong, or None"""
    if not args.m_tau > 0.0:
        return f"--m-tau {args.m_tau} must be > 0 (the softmax temperature; the paper uses 0.03)"
    if not 0.0 <= args.m_alpha <= 1.0:
        return f"--m-alpha {args.m_alpha} must be in [0, 1] (0 turns the bonus off; the paper uses 0.9)"
    if not args.m_l0 < 0.0:
        return f"--m-l0 {args.m_l0} must be < 0 (it clips tau * log pi <= 0; the paper uses -1; --m-alpha 0: no bonus)"
    return None


if __name__ == "__main__":
    args = parse_args(Args)  # tyro.cli(Args): the algorithm's flags, then the run flags
    run = Run(args, __file__, check_args)  # --resume, the checks, device, threads, seeding, signals
    device = run.device

    envs = TrainEnvs(args.env_id, args.num_envs, seed=args.seed)
    q_network = QNetwork(envs.n_actions).to(device)
    target_network = QNetwork(envs.n_actions).to(device)
    target_network.load_state_dict(q_network.state_dict())
    run.fast(q_network, target_network)  # --fast: channels-last convolutions on CPU
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate, eps=args.adam_eps, fused=run.fused)
    rb = ReplayBuffer(
        args.buffer_size,
        args.num_envs,
        device=device,
        seed=args.seed,
        storage_device=run.buffer_device,
        compress=args.compress_replay,
    )
    rng = np.random.default_rng(args.seed)
    # what the run owns, declared once: a checkpoint saves it and --resume puts it back
    obs, global_step = run.own(
        envs, rb, policy=q_network, q_network=q_network, target_network=target_network, optimizer=optimizer, rng=rng
    )

    metrics = None  # the latest update's metrics (tensors), read every 1000 steps
    while global_step < args.total_timesteps:
        previous_step = global_step
        epsilon = linear_schedule(
            args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step
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
                    loss, metrics = compute_loss(q_network, target_network, data, args)
                    if run.skip(loss):  # --on-nonfinite skip: a non-finite loss is not applied
                        continue
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()

            # update target network
            if global_step // args.target_network_frequency > previous_step // args.target_network_frequency:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters(), strict=True):
                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)

        step = envs.recv()
        # the step after a game ends returns the reset observation: not a transition (mask)
        rb.add(obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        obs = step.next_obs
        if run.step(global_step, obs, step, epsilon, metrics):  # log, evaluate, checkpoint when due; True: stop
            break

    sys.exit(run.finish())  # the final evaluation, the saved model, the closed record (or the stop's message)
