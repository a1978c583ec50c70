"""The QR-DQN reference of benchmarks/side_by_side.py: sb3-contrib's QRDQN with rl-zoo3's Atari settings
(hyperparams/qrdqn.yml, ``atari``), run in the reference's own virtual environment (docs/side_by_side.md).

It imports nothing of this repository. The environment is the zoo's: ``make_vec_env`` with sb3's ``AtariWrapper``
(no-op starts, frame skip 4 with max-pool, a terminal at each life loss, FIRE on reset, 84x84 grayscale, rewards
clipped to their sign), ``VecFrameStack`` of 4 (``QRDQN`` adds ``VecTransposeImage``); the model: ``CnnPolicy``,
the zoo's ``optimize_memory_usage=False``, every setting that the zoo leaves alone at sb3-contrib's default; and
the schedule that the command line gives (learning starts, exploration, replay memory, steps). A callback saves the
online quantile network at each of ``--snapshot-steps``: the weights after the updates of the first N agent steps.
"""

from __future__ import annotations

import argparse
import os
import time

import ale_py
import gymnasium as gym
import torch
from sb3_contrib import QRDQN
from stable_baselines3.common.atari_wrappers import AtariWrapper
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import VecFrameStack

gym.register_envs(ale_py)


def snapshot(model: QRDQN, step: int, folder: str) -> None:
    """The online quantile network at ``step``, with what rebuilds it; written whole or not at all."""
    path = os.path.join(folder, f"step_{step}.pt")
    state = {
        "state_dict": {k: v.detach().cpu() for k, v in model.quantile_net.state_dict().items()},
        "n_quantiles": model.n_quantiles,
        "n_actions": int(model.action_space.n),
        "step": step,
        "num_timesteps": model.num_timesteps,
        "n_updates": model._n_updates,
    }
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    print(f"snapshot: step {step} ({model._n_updates} updates) -> {path}", flush=True)


class Snapshots(BaseCallback):
    """Saves at the first step after each of ``steps``: sb3 calls ``_on_step`` after each environment step and
    trains after every ``train_freq`` steps, so at step N + 1 the update that follows step N has been made, and
    no other since (the last one is saved after ``learn`` returns)."""

    def __init__(self, steps: list[int], folder: str):
        super().__init__()
        self.pending, self.folder = sorted(steps), folder

    def _on_step(self) -> bool:
        while self.pending and self.num_timesteps > self.pending[0]:
            snapshot(self.model, self.pending.pop(0), self.folder)
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--total-timesteps", type=int, default=300_000)
    parser.add_argument("--learning-starts", type=int, default=10_000)
    parser.add_argument("--exploration-fraction", type=float, default=0.1)
    parser.add_argument("--buffer-size", type=int, default=100_000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--snapshot-dir", default="snapshots")
    parser.add_argument("--snapshot-steps", type=int, nargs="*", default=[])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.snapshot_dir, exist_ok=True)

    env = make_vec_env(args.env_id, n_envs=1, seed=args.seed, wrapper_class=AtariWrapper)  # the zoo's env_wrapper
    env = VecFrameStack(env, n_stack=4)  # the zoo's frame_stack: 4
    model = QRDQN(
        "CnnPolicy",  # the zoo's policy
        env,
        learning_starts=args.learning_starts,  # the zoo: 50,000 (of 10M steps)
        exploration_fraction=args.exploration_fraction,  # the zoo: 0.025 (of 10M steps)
        buffer_size=args.buffer_size,  # the zoo: sb3-contrib's default, 1M
        optimize_memory_usage=False,  # the zoo's
        tensorboard_log="tensorboard",
        verbose=1,
        seed=args.seed,
        device=args.device,
    )
    print(f"QRDQN: {model.policy}", flush=True)
    start = time.time()
    model.learn(
        total_timesteps=args.total_timesteps,
        callback=Snapshots([s for s in args.snapshot_steps if s < args.total_timesteps], args.snapshot_dir),
    )
    if args.total_timesteps in args.snapshot_steps:
        snapshot(model, args.total_timesteps, args.snapshot_dir)
    print(f"trained {model.num_timesteps} steps in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
