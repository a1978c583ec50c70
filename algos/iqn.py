# IQN (Dabney et al. 2018, implicit quantile networks): the network takes a quantile fraction tau as input and
# returns the tau-quantile of the returns, learned on sampled fractions with the quantile Huber loss; the paper's
# N = N' = 64, K = 32, 64 cosines, kappa 1; other settings as qrdqn.py (sb3-contrib with the zoo's Atari settings),
# target every 10k steps; docs in docs/algorithms.md.
# Departure from the paper: it multiplies the embedding of tau into the 3136 convolution features, before the
# 512-unit layer; our encoder is fixed and ends with that layer, so the embedding (64 cosines -> 512) multiplies
# its 512 features instead, and a head 512 -> 512 -> n_actions follows, as the paper's after the product.
import math
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
    n_tau_samples: int = 64
    """N: the sampled quantile fractions tau of the online network, per transition, for the loss"""
    n_tau_prime_samples: int = 64
    """N': the sampled quantile fractions tau' of the target network, per transition, for the target"""
    n_quantile_samples: int = 32
    """K: the sampled quantile fractions whose mean quantile is the Q-value, to act and to pick a*"""
    n_cos: int = 64
    """the number of cosines cos(pi * i * tau), i = 0..n-1, embedding tau"""
    kappa: float = 1.0
    """the threshold of the quantile Huber loss (quadratic below, linear above)"""


class QNetwork(nn.Module):
    def __init__(self, n_actions: int, n_cos: int = 64, n_quantile_samples: int = 32):
        super().__init__()
        self.encoder = NatureCNN()
        self.n_actions, self.n_quantile_samples = n_actions, n_quantile_samples
        self.register_buffer("cos_frequencies", math.pi * torch.arange(n_cos, dtype=torch.float32))  # pi * i
        self.phi = nn.Linear(n_cos, 512)  # the embedding of tau
        self.head = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, n_actions))

    def quantiles(self, x, taus):
        """Z_tau(x, a), the returns' tau-quantiles, for the fractions taus (batch, N): psi(x) * phi(tau), with
        phi_j(tau) = ReLU(sum_i cos(pi * i * tau) w_ij + b_j) (eq. 4), then the head; (batch, n_actions, N)"""
        features = self.encoder(x)  # psi(x), (batch, 512)
        embedding = F.relu(self.phi(torch.cos(taus.unsqueeze(2) * self.cos_frequencies)))  # (batch, N, 512)
        return self.head(features.unsqueeze(1) * embedding).transpose(1, 2)

    def forward(self, x):
        """the Q-values, the mean of K quantiles at fractions drawn uniformly in [0, 1], (batch, n_actions)"""
        taus = torch.rand(x.shape[0], self.n_quantile_samples, device=x.device)
        return self.quantiles(x, taus).mean(dim=2)


def compute_target_quantiles(target_network, data, gamma: float, n_target: int, k: int):
    """r + gamma * Z_tau'_j(s', a*) for N' fractions tau'_j drawn uniformly, a* = argmax_a' of the mean of K
    quantiles of the target network at other uniform fractions, no bootstrap after a terminal; one pass of the
    encoder serves both. Returns (batch, N')"""
    with torch.no_grad():
        taus = torch.rand(len(data.rewards), k + n_target, device=data.rewards.device)
        next_quantiles = target_network.quantiles(data.next_observations, taus)  # (batch, n_actions, K + N')
        next_actions = next_quantiles[:, :, :k].mean(dim=2).argmax(dim=1)
        next_quantiles = next_quantiles[torch.arange(len(next_actions), device=next_actions.device), next_actions, k:]
        return data.rewards.unsqueeze(1) + gamma * next_quantiles * (1 - data.dones.unsqueeze(1))


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


def compute_loss(q_network, target_network, data, args):
    """the loss on a sampled batch and the metrics the loop logs"""
    target_quantiles = compute_target_quantiles(
        target_network, data, args.gamma, args.n_tau_prime_samples, args.n_quantile_samples
    )
    taus = torch.rand(len(data.actions), args.n_tau_samples, device=data.actions.device)  # N fractions per transition
    rows = torch.arange(len(data.actions), device=data.actions.device)
    quantiles = q_network.quantiles(data.observations, taus)[rows, data.actions]  # the taken actions'
    loss = quantile_huber_loss(quantiles, taus, target_quantiles, args.kappa)
    old_val = quantiles.detach().mean(dim=1)  # Q(s, a)
    return loss, {"td_loss": loss, "q_values": old_val.mean()}


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def check_args(args: Args) -> str | None:
    """this script's own flags (the shared ones are checked by the run): what is wrong, or None"""
    for name, paper in (("n_tau_samples", 64), ("n_tau_prime_samples", 64), ("n_quantile_samples", 32), ("n_cos", 64)):
        flag = "--" + name.replace("_", "-")
        if getattr(args, name) < 1:
            return f"{flag} {getattr(args, name)} must be a positive integer; the paper uses {flag} {paper}"
    if not args.kappa > 0:
        return f"--kappa {args.kappa} must be > 0 (the Huber threshold of the quantile loss); use e.g. --kappa 1"
    return None


if __name__ == "__main__":
    args = parse_args(Args)  # tyro.cli(Args): the algorithm's flags, then the run flags
    run = Run(args, __file__, check_args)  # --resume, the checks, device, threads, seeding, signals
    device = run.device

    envs = TrainEnvs(args.env_id, args.num_envs, seed=args.seed)
    network_kwargs = dict(n_cos=args.n_cos, n_quantile_samples=args.n_quantile_samples)
    q_network = QNetwork(envs.n_actions, **network_kwargs).to(device)
    target_network = QNetwork(envs.n_actions, **network_kwargs).to(device)
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
    sys.exit(run.finish(**network_kwargs))
