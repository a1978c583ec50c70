# Non-crossing QR-DQN (Zhou, Wang and Feng, NeurIPS 2020): QR-DQN (Dabney et al. 2018) whose head makes the
# quantiles non-decreasing by construction (softmax increments, cumulative sum, a non-negative range and a free
# location per action); QR-DQN's Atari settings from sb3-contrib and rl-baselines3-zoo; docs in docs/algorithms.md
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
    target_network_frequency: int = 10_000
    """the agent steps it takes to update the target network"""
    batch_size: int = 32
    """the batch size of sample from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.025
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    learning_starts: int = 50_000
    """agent steps to start learning"""
    train_frequency: int = 4
    """agent steps per gradient update, whatever the number of environments"""
    eval_every: int = 500_000
    """agent steps between evaluations (0: only the final one)"""
    eval_episodes: int = 10
    """whole games per evaluation"""
    eval_epsilon: float = 0.01
    """epsilon of the evaluation policy (0: greedy)"""
    adam_eps: float = 0.01 / 32
    """the epsilon of the Adam optimizer (QR-DQN's 0.01 / batch size 32)"""
    n_quantiles: int = 200
    """the number of quantiles per action, tau_i = (2i + 1) / (2N)"""
    kappa: float = 1.0
    """the threshold of the quantile Huber loss"""


class QNetwork(nn.Module):
    def __init__(self, n_actions: int, n_quantiles: int = 200):
        super().__init__()
        self.encoder = NatureCNN()
        self.n_actions, self.n_quantiles = n_actions, n_quantiles
        self.logits = nn.Linear(512, n_actions * n_quantiles)  # the quantile logit network
        self.scale = nn.Linear(512, n_actions * 2)  # the scale factor network: range alpha, location beta

    def quantiles(self, x):
        """(B, n_actions, n_quantiles), non-decreasing along the last axis"""
        features = self.encoder(x)
        logits = self.logits(features).view(-1, self.n_actions, self.n_quantiles)
        scale = self.scale(features).view(-1, self.n_actions, 2)
        return non_crossing_quantiles(logits, scale)

    def forward(self, x):
        return self.quantiles(x).mean(dim=2)  # Q-values: the mean of the quantiles


def non_crossing_quantiles(logits, scale):
    """q_i = alpha * sum_{j <= i} softmax(logits)_j + beta, alpha = ReLU(scale[..., 0]) >= 0, beta = scale[..., 1]"""
    psi = torch.softmax(logits, dim=-1).cumsum(dim=-1)
    psi = psi.cummax(dim=-1).values  # exact; guards a parallel (GPU) scan's 1-ulp rounding, a no-op otherwise
    return F.relu(scale[..., :1]) * psi + scale[..., 1:]


def quantile_td_target(next_quantiles, rewards, dones, gamma: float):
    """r + gamma * theta_j(s', a*), a* = argmax_a' mean_j theta_j(s', a') of the target network's quantiles
    (B, A, N); no bootstrap after a terminal"""
    next_actions = next_quantiles.mean(dim=2).argmax(dim=1)
    next_best = next_quantiles[torch.arange(len(next_actions), device=next_quantiles.device), next_actions]
    return rewards.unsqueeze(1) + gamma * next_best * (1 - dones.unsqueeze(1))


def quantile_fractions(n: int, device=None):
    """tau_i = (2i + 1) / (2N), i = 0..N-1: the midpoints of N equal slices of [0, 1], the fractions whose
    quantiles the N outputs estimate (Dabney et al. 2018, lemma 2); (N,)"""
    return (torch.arange(n, device=device) + 0.5) / n


def quantile_huber_loss(quantiles, taus, target_quantiles, kappa: float):
    """The quantile Huber loss of Dabney et al. (QR-DQN, AAAI 2018, eq. 10; IQN, ICML 2018, eq. 3):
    rho(u) = |tau_i - 1{u < 0}| * L_kappa(u) / kappa, u = T_j - theta_i, with the Huber loss L_kappa(u) = u^2 / 2
    if |u| <= kappa else kappa * (|u| - kappa / 2), at the quantile fractions tau_i; summed over the online
    quantiles i, averaged over the target quantiles j and the batch. quantiles (batch, N), taus (batch, N) or (N,),
    target_quantiles (batch, N') -> scalar"""
    u = target_quantiles.unsqueeze(1) - quantiles.unsqueeze(2)  # (batch, i, j)
    huber = torch.where(u.abs() <= kappa, 0.5 * u**2, kappa * (u.abs() - 0.5 * kappa))
    weight = (taus.unsqueeze(-1) - (u.detach() < 0).float()).abs()
    return (weight * huber / kappa).sum(dim=1).mean()


def crossing_rate(quantiles):
    """the fraction of adjacent quantile pairs (i, i + 1) with q_{i+1} < q_i, over (B, N) quantiles"""
    return (quantiles.diff(dim=-1) < 0).float().mean()


def compute_loss(q_network, target_network, data, args):
    """the loss on a sampled batch and the metrics the loop logs"""
    with torch.no_grad():
        next_quantiles = target_network.quantiles(data.next_observations)
        td_target = quantile_td_target(next_quantiles, data.rewards, data.dones, args.gamma)
    rows = torch.arange(len(data.actions), device=data.actions.device)
    quantiles = q_network.quantiles(data.observations)[rows, data.actions]  # the taken actions'
    taus = quantile_fractions(args.n_quantiles, quantiles.device)  # fixed, tau_i = (2i + 1) / (2N)
    loss = quantile_huber_loss(quantiles, taus, td_target, args.kappa)
    return loss, {"td_loss": loss, "q_values": quantiles.mean(), "crossing_rate": crossing_rate(quantiles)}


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def check_args(args: Args) -> str | None:
    """this script's own flags (the shared ones are checked by the run): what is wrong, or None"""
    if args.n_quantiles < 2:
        return f"--n-quantiles {args.n_quantiles} must be >= 2 (a distribution needs two quantiles; QR-DQN uses 200)"
    if not args.kappa > 0.0:
        return f"--kappa {args.kappa} must be > 0 (the quantile Huber threshold; QR-DQN uses 1)"
    return None


if __name__ == "__main__":
    args = parse_args(Args)  # tyro.cli(Args): the algorithm's flags, then the run flags
    run = Run(args, __file__, check_args)  # --resume, the checks, device, threads, seeding, signals
    device = run.device

    envs = TrainEnvs(args.env_id, args.num_envs, seed=args.seed)
    q_network = QNetwork(envs.n_actions, args.n_quantiles).to(device)
    target_network = QNetwork(envs.n_actions, args.n_quantiles).to(device)
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

    # the final evaluation, the saved model, the closed record (or the stop's message)
    sys.exit(run.finish(n_quantiles=args.n_quantiles))
