# Your value-based algorithm, compared fairly with the reference scripts; docs in docs/custom_algorithms.md.
# Copy this file (e.g. to algos/my_algo.py) and edit ONLY the EDITABLE block: a QNetwork (a head over the
# fixed Nature encoder) and a ValueAlgorithm (networks, optimizer, select_action, update). Everything marked
# FIXED (arguments, environments, replay, exploration schedule, loop, logging, evaluation) is what every
# algorithm shares, and cleanrl_utils.tools.template_rules checks the rules at start-up. As shipped: DQN, as
# algos/dqn.py.
import os
import sys
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: F401 (the shipped DQN uses it; your block may not)
import torch.optim as optim

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.encoder import NatureCNN
from cleanrl_utils.envs import OBSERVATION_SHAPE, TrainEnvs
from cleanrl_utils.run import Run, RunFlags, parse_args
from cleanrl_utils.tools.template_rules import (
    TemplateRuleError,
    ValueAlgorithmBase,
    check_actions,
    check_algorithm,
    check_metrics,
)


# FIXED: the arguments every algorithm shares (CleanRL's dqn_atari.py defaults)
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
    fast: bool = True
    """the fast update, same loss and gradients to float tolerance (benchmarks/RESULTS.md): Adam's fused kernel on
    CPU and CUDA, channels-last convolutions on CPU; --no-fast: the plain update"""

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
    adam_eps: float = 1e-8
    """the epsilon of the Adam optimizer (Adam's default, as CleanRL)"""
    parameter_budget: int | None = None
    """trainable parameters allowed (default: the Nature encoder + the largest head among the reference
    algorithms for the game's action count, printed at start-up); another value is not a fair comparison"""


# ======================= EDITABLE: your algorithm (everything else is FIXED) =======================
# QNetwork(n_actions): a head over the fixed Nature encoder (512 features); forward(x) -> (batch, n_actions)
# Q-values, which evaluation acts on greedily. ValueAlgorithm(envs, run, args): owns the networks
# (freeze target networks with .requires_grad_(False): every parameter that requires gradients counts
# against the budget) and the optimizer; select_action(obs, epsilon) -> one integer action per
# environment; update(batch, global_step) -> dict of metrics with at least td_loss and q_values (floats or
# one-element tensors: loss.detach() spares the GPU a wait at every update); update_target_network(tau), which
# the loop calls each time the step passes a multiple of --target-network-frequency (a pass if you have none).
# batch: observations, actions, rewards, next_observations, dones (tensors on the device). run.device is the
# training device; run.fast(networks) and fused=run.fused are --fast's speed-ups.
class QNetwork(nn.Module):
    def __init__(self, n_actions: int):
        super().__init__()
        self.encoder = NatureCNN()
        self.head = nn.Linear(512, n_actions)

    def forward(self, x):
        return self.head(self.encoder(x))


class ValueAlgorithm(ValueAlgorithmBase):
    """DQN (Mnih et al. 2015): MSE TD loss towards r + gamma * max_a' Q_target(s', a')."""

    def __init__(self, envs, run, args):
        self.args, self.device = args, run.device
        self.n_actions = envs.n_actions
        self.q_network = QNetwork(envs.n_actions).to(self.device)
        self.target_network = QNetwork(envs.n_actions).to(self.device).requires_grad_(False)
        self.target_network.load_state_dict(self.q_network.state_dict())
        run.fast(self.q_network, self.target_network)  # --fast: channels-last convolutions on CPU
        self.optimizer = optim.Adam(
            self.q_network.parameters(), lr=args.learning_rate, eps=args.adam_eps, fused=run.fused
        )
        self.rng = np.random.default_rng(args.seed)  # the acting generator, seeded as algos/dqn.py's loop's

    def select_action(self, obs, epsilon):
        actions = self.rng.integers(0, self.n_actions, len(obs))
        greedy = self.rng.random(len(obs)) >= epsilon
        if greedy.any():
            with torch.no_grad():
                q_values = self.q_network(torch.as_tensor(obs[greedy], device=self.device))
            actions[greedy] = q_values.argmax(dim=1).cpu().numpy()
        return actions

    def update(self, data, global_step):
        with torch.no_grad():
            target_max, _ = self.target_network(data.next_observations).max(dim=1)
            td_target = data.rewards + self.args.gamma * target_max * (1 - data.dones)
        old_val = self.q_network(data.observations).gather(1, data.actions.unsqueeze(1)).squeeze(1)
        loss = F.mse_loss(td_target, old_val)

        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"td_loss": loss.detach(), "q_values": old_val.detach().mean()}

    def update_target_network(self, tau):
        for target_param, q_param in zip(self.target_network.parameters(), self.q_network.parameters(), strict=True):
            target_param.data.copy_(tau * q_param.data + (1.0 - tau) * target_param.data)


# ==================================== end of EDITABLE ====================================


# FIXED: the exploration schedule
def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def check_args(args: Args) -> str | None:
    """the template's own flag (the shared ones are checked by the run): what is wrong, or None"""
    if args.parameter_budget is not None and args.parameter_budget <= 0:
        return f"--parameter-budget {args.parameter_budget} must be a positive integer (or left out for the default)"
    return None


# FIXED: everything below
if __name__ == "__main__":
    args = parse_args(Args)  # tyro.cli(Args): the algorithm's flags, then the run flags
    run = Run(args, __file__, check_args)  # --resume, the checks, device, threads, seeding, signals
    device = run.device

    envs = TrainEnvs(args.env_id, args.num_envs, seed=args.seed)
    algorithm = ValueAlgorithm(envs, run, args)
    # the rules: unmodified encoder, parameter budget, Q-values and actions of the right shape (tried on blank
    # frames: the games are reset once, below, as algos/dqn.py resets them)
    blank = np.zeros((args.num_envs, *OBSERVATION_SHAPE), dtype=np.uint8)
    try:
        q_network = check_algorithm(algorithm, QNetwork, envs, blank, device, args.parameter_budget)
    except TemplateRuleError as error:  # before the run folder exists: nothing to close
        sys.exit(f"error: {error}")
    rb = ReplayBuffer(
        args.buffer_size,
        args.num_envs,
        device=device,
        seed=args.seed,
        storage_device=run.buffer_device,
        compress=args.compress_replay,
    )
    # what the run owns, declared once: a checkpoint saves it and --resume puts it back
    obs, global_step = run.own(envs, rb, policy=q_network, algorithm=algorithm)  # its networks, optimizers, ...

    metrics = None  # the latest update's metrics (tensors), read every 1000 steps
    while global_step < args.total_timesteps:
        previous_step = global_step
        epsilon = linear_schedule(
            args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step
        )
        with run.timed("acting"):
            try:
                actions = check_actions(algorithm.select_action(obs, epsilon), args.num_envs, envs.n_actions)
            except TemplateRuleError as error:  # the receipt says failed: invalid actions
                run.record.close(status=f"failed: {error.status}")
                sys.exit(f"error: {error}")
        envs.send(actions)  # the games step in their own threads while the learner updates, below
        global_step += args.num_envs

        if global_step > run.learning_starts:
            # one update per train_frequency agent steps, whatever the number of environments
            for _ in range(global_step // args.train_frequency - previous_step // args.train_frequency):
                with run.timed("learning"):
                    data = rb.sample(args.batch_size)
                    try:  # the first update's metrics are read (sync): a broken loss shows at once
                        metrics = check_metrics(algorithm.update(data, global_step), global_step, sync=metrics is None)
                    except TemplateRuleError as error:  # e.g. failed: non-finite metrics
                        run.record.close(status=f"failed: {error.status}")
                        sys.exit(f"error: {error}")

            # update target network
            if global_step // args.target_network_frequency > previous_step // args.target_network_frequency:
                algorithm.update_target_network(args.tau)

        step = envs.recv()
        # the step after a game ends returns the reset observation: not a transition (mask)
        rb.add(obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        obs = step.next_obs
        if run.step(global_step, obs, step, epsilon, metrics):  # log, evaluate, checkpoint when due; True: stop
            break

    sys.exit(run.finish())  # the final evaluation, the saved model, the closed record (or the stop's message)
