# PQN (Gallici et al. 2024), CleanRL's pqn_atari_envpool.py defaults; docs in docs/algorithms.md
import os
import sys
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

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
    """whether to record the first game of each evaluation as MP4 in the run folder"""
    save_model: bool = False
    """whether to save the model into the run folder"""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """on a non-finite loss: stop the run (its checkpoints kept), or skip that update"""

    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the environment"""
    total_timesteps: int = 10_000_000
    """total agent steps of the experiment, summed over environments (whole rollouts: up to one more)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per rollout"""
    anneal_lr: bool = True
    """whether the learning rate decays linearly to 0 over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    num_minibatches: int = 4
    """the number of minibatches each epoch splits a rollout into"""
    update_epochs: int = 4
    """the passes over each rollout"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    q_lambda: float = 0.65
    """the lambda of the Q(lambda) returns (0: one-step Q-learning targets)"""
    layer_norm: bool = True
    """LayerNorm before each ReLU of the encoder, as CleanRL's PQN; --no-layer-norm: the plain Nature CNN"""
    eval_every: int = 500_000
    """agent steps between evaluations (0: only the final one)"""
    eval_episodes: int = 10
    """whole games per evaluation"""
    eval_epsilon: float = 0.01
    """epsilon of the evaluation policy (0: greedy)"""


class QNetwork(nn.Module):
    def __init__(self, n_actions: int, layer_norm: bool = True):
        super().__init__()
        self.encoder = NatureCNN(layer_norm=layer_norm)
        self.head = nn.Linear(512, n_actions)
        for layer in self.modules():  # CleanRL's layer_init: orthogonal weights with gain sqrt(2), zero biases
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                nn.init.orthogonal_(layer.weight, np.sqrt(2))
                nn.init.zeros_(layer.bias)

    def forward(self, x):
        return self.head(self.encoder(x))


def q_lambda_returns(rewards, dones, continues, values, next_value, gamma: float, q_lambda: float):
    """Peng's Q(lambda) returns of a rollout, shape (num_steps, num_envs), computed backwards:
    G_t = r_t + gamma * (1 - done_t) * (lambda' * G_{t+1} + (1 - lambda') * max_a Q(s_{t+1}, a)),
    where values[t] = max_a Q(s_t, a) as acting saw it, next_value that of the observation after the rollout, and
    lambda' = q_lambda where step t + 1 continues step t's game as a transition (``continues[t + 1]``), else 0:
    after a time limit or before a forced step the return bootstraps from s_{t+1} alone."""
    returns = torch.zeros_like(rewards)
    for t in reversed(range(len(rewards))):
        if t == len(rewards) - 1:
            bootstrap = next_value
        else:
            mix = q_lambda * continues[t + 1]
            bootstrap = mix * returns[t + 1] + (1 - mix) * values[t + 1]
        returns[t] = rewards[t] + gamma * (1 - dones[t]) * bootstrap
    return returns


def compute_loss(q_network, observations, actions, returns):
    """the loss on a minibatch of the rollout and the metrics the loop logs"""
    old_val = q_network(observations).gather(1, actions.unsqueeze(1)).squeeze(1)
    loss = F.mse_loss(returns, old_val)
    return loss, {"td_loss": loss, "q_values": old_val.mean()}


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def check_args(args: Args) -> str | None:
    """this script's own flags (the shared ones are checked by the run): what is wrong, or None"""
    for name in ("num_steps", "num_minibatches", "update_epochs"):
        if getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')} {getattr(args, name)} must be a positive integer"
    if (args.num_envs * args.num_steps) % args.num_minibatches:
        return (
            f"--num-minibatches {args.num_minibatches} does not divide a rollout of --num-envs {args.num_envs} x "
            f"--num-steps {args.num_steps} = {args.num_envs * args.num_steps} steps; pick a divisor"
        )
    if not 0.0 <= args.q_lambda <= 1.0:
        return f"--q-lambda {args.q_lambda} must be in [0, 1] (0: one-step targets, 1: Monte Carlo returns)"
    if not (np.isfinite(args.max_grad_norm) and args.max_grad_norm > 0):
        return f"--max-grad-norm {args.max_grad_norm} must be > 0 and finite (this script's default: 10)"
    return None


if __name__ == "__main__":
    args = parse_args(Args)  # tyro.cli(Args): the algorithm's flags, then the run flags
    run = Run(args, __file__, check_args)  # --resume, the checks, device, threads, seeding, signals
    device = run.device

    envs = TrainEnvs(args.env_id, args.num_envs, seed=args.seed)
    q_network = QNetwork(envs.n_actions, args.layer_norm).to(device)  # LayerNorm: PQN's declared encoder variant
    optimizer = optim.RAdam(q_network.parameters(), lr=args.learning_rate)
    # the rollout: observations as uint8 bytes (the network scales them), the rest as float
    rollout_obs = torch.zeros((args.num_steps, args.num_envs, 4, 84, 84), dtype=torch.uint8, device=device)
    rollout_actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long, device=device)
    rollout_rewards = torch.zeros((args.num_steps, args.num_envs), device=device)
    rollout_dones = torch.zeros((args.num_steps, args.num_envs), device=device)
    rollout_masks = torch.zeros((args.num_steps, args.num_envs), device=device)  # 1: a transition, learned from
    rollout_values = torch.zeros((args.num_steps, args.num_envs), device=device)  # max_a Q(s_t, a) when acting
    rng = np.random.default_rng(args.seed)
    # what the run owns, declared once: a checkpoint (at a rollout's end) saves it and --resume puts it back
    obs, global_step = run.own(envs, policy=q_network, q_network=q_network, optimizer=optimizer, rng=rng)

    metrics = None  # the latest update's metrics (tensors), read every 1000 steps
    while global_step < args.total_timesteps:
        if args.anneal_lr:  # linearly to 0 at --total-timesteps, set at each rollout's start
            optimizer.param_groups[0]["lr"] = (1.0 - global_step / args.total_timesteps) * args.learning_rate
        for t in range(args.num_steps):
            epsilon = linear_schedule(
                args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step
            )
            with run.timed("acting"):
                actions = rng.integers(0, envs.n_actions, args.num_envs)
                greedy = rng.random(args.num_envs) >= epsilon
                rollout_obs[t] = torch.as_tensor(obs, device=device)
                with torch.no_grad():  # every game's values: the Q(lambda) returns bootstrap from them
                    q_values = q_network(rollout_obs[t])
                actions[greedy] = q_values.argmax(dim=1).cpu().numpy()[greedy]
            envs.send(actions)  # the games step in their own threads while the rollout is stored
            rollout_actions[t] = torch.as_tensor(actions, device=device)
            rollout_values[t] = q_values.max(dim=1).values
            global_step += args.num_envs

            step = envs.recv()
            # the step after a game ends returns the reset observation, and a forced step is not the agent's:
            # neither is a transition (mask)
            rollout_rewards[t] = torch.as_tensor(step.rewards, device=device)
            rollout_dones[t] = torch.as_tensor(step.dones, device=device)
            rollout_masks[t] = torch.as_tensor(step.mask, device=device)
            obs = step.next_obs
            run.log_step(global_step, step, epsilon)  # finished games, SPS and progress

        with run.timed("learning"):
            with torch.no_grad():
                next_value = q_network(torch.as_tensor(obs, device=device)).max(dim=1).values
                returns = q_lambda_returns(
                    rollout_rewards,
                    rollout_dones,
                    rollout_masks,
                    rollout_values,
                    next_value,
                    args.gamma,
                    args.q_lambda,
                )
            transitions = torch.nonzero(rollout_masks.flatten()).squeeze(1).cpu().numpy()  # the rest: not learned
            b_obs, b_actions = rollout_obs.flatten(0, 1), rollout_actions.flatten()
            b_returns = returns.flatten()
            for _epoch in range(args.update_epochs):
                for batch in np.array_split(rng.permutation(transitions), args.num_minibatches):
                    batch = torch.as_tensor(batch, device=device)
                    loss, metrics = compute_loss(q_network, b_obs[batch], b_actions[batch], b_returns[batch])
                    if run.skip(loss):  # --on-nonfinite skip: a non-finite loss is not applied
                        continue
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
                    optimizer.step()

        if run.due(global_step, obs, metrics):  # at a rollout's end: log, evaluate, checkpoint when due; True: stop
            break

    # the final evaluation, the saved model, the closed record (or the stop's message)
    sys.exit(run.finish(layer_norm=args.layer_norm))
