# Double DQN (van Hasselt et al. 2016): DQN with the online network choosing the next action
# and the target network evaluating it; CleanRL's dqn_atari.py defaults; docs in docs/algorithms.md
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


class QNetwork(nn.Module):
    def __init__(self, n_actions: int):
        super().__init__()
        self.encoder = NatureCNN()
        self.head = nn.Linear(512, n_actions)

    def forward(self, x):
        return self.head(self.encoder(x))


def compute_td_target(q_network, target_network, data, gamma: float):
    """r + gamma * Q_target(s', argmax_a' Q(s', a')), no bootstrap after a terminal"""
    with torch.no_grad():
        next_actions = q_network(data.next_observations).argmax(dim=1, keepdim=True)
        target_max = target_network(data.next_observations).gather(1, next_actions).squeeze(1)
        td_target = data.rewards + gamma * target_max * (1 - data.dones)
    return td_target


def compute_loss(q_network, target_network, data, args):
    """the loss on a sampled batch and the metrics the loop logs"""
    td_target = compute_td_target(q_network, target_network, data, args.gamma)
    old_val = q_network(data.observations).gather(1, data.actions.unsqueeze(1)).squeeze(1)
    loss = F.mse_loss(td_target, old_val)
    return loss, {"td_loss": loss, "q_values": old_val.mean()}


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


if __name__ == "__main__":
    args = parse_args(Args)  # tyro.cli(Args): the algorithm's flags, then the run flags
    run = Run(args, __file__)  # --resume, the checks, device, threads, seeding, signals
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
