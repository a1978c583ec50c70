"""Evaluation under the protocol: whole games, raw score, epsilon-greedy, separately seeded."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import gymnasium as gym
import numpy as np
import torch
from torch import nn

from cleanrl_utils.envs import MAX_FRAMES_PER_EPISODE, NOOP_MAX, ale_game, forced_actions, has_fire, play_episodes
from cleanrl_utils.scores import human_normalized_score


def evaluate(
    q_network: nn.Module,
    env_id: str,
    n_actions: int,
    device: torch.device,
    episodes: int = 10,
    epsilon: float = 0.01,
    seed: int = 0,
    video_path: Path | None = None,
) -> dict[str, Any]:
    """Play ``episodes`` whole games with the network's greedy action (argmax of its forward
    output, the Q-values) taken with probability 1 - ``epsilon``. With ``video_path``, one more
    game is played and recorded as MP4 (the RGB screen)."""
    was_training = q_network.training
    q_network.eval()

    @torch.no_grad()
    def greedy(obs: np.ndarray) -> np.ndarray:
        return q_network(torch.as_tensor(obs, device=device)).argmax(dim=1).cpu().numpy()

    try:
        returns, lengths, histogram = play_episodes(
            env_id, episodes, seed, greedy, n_actions, epsilon, np.random.default_rng(seed)
        )
        if video_path is not None:
            record_game(greedy, env_id, n_actions, epsilon, seed, video_path)
    finally:
        q_network.train(was_training)
    mean = float(np.mean(returns))
    return {
        "episodic_returns": returns,
        "episodic_lengths": lengths,
        "mean": mean,
        "std": float(np.std(returns)),
        "action_histogram": histogram.tolist(),
        "human_normalized_score": human_normalized_score(env_id, mean),
        "epsilon": epsilon,
        "seed": seed,
    }


def record_game(
    greedy: Callable[[np.ndarray], np.ndarray],
    env_id: str,
    n_actions: int,
    epsilon: float,
    seed: int,
    path: Path,
) -> None:
    """Record one whole game as MP4 with OpenCV (no extra dependency). The single environment is
    Gymnasium's AtariPreprocessing, played under the same protocol (the same forced steps, a fresh
    stack after each life loss); it matches the vector environment up to its own no-op draws, so
    the recorded game is representative, not one of the scored ones."""
    if ale_game(env_id) is None:
        print(f"warning: --capture-video records ALE games only; {env_id} is not recorded", file=sys.stderr)
        return
    env = gym.make(env_id, render_mode="rgb_array", max_num_frames_per_episode=MAX_FRAMES_PER_EPISODE)
    env = gym.wrappers.AtariPreprocessing(env, noop_max=NOOP_MAX, frame_skip=4, screen_size=84, grayscale_obs=True)
    fire = has_fire(env_id)
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    obs, _ = env.reset(seed=seed)
    stack, lives, pending = [obs] * 4, env.unwrapped.ale.lives(), forced_actions(fire, life_lost=False)
    frame = env.render()
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 15, (frame.shape[1], frame.shape[0]))
    try:
        while True:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
            forced = bool(pending)
            if forced:
                action = pending.pop(0)
            else:
                action = int(greedy(np.stack(stack)[None])[0])
                if rng.random() < epsilon:
                    action = int(rng.integers(n_actions))
            obs, _, terminated, truncated, _ = env.step(action)
            frame = env.render()
            if terminated or truncated:
                writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
                break
            if env.unwrapped.ale.lives() < lives:
                pending = forced_actions(fire, life_lost=True)
            lives = env.unwrapped.ale.lives()
            stack = [obs] * 4 if forced else stack[1:] + [obs]  # after a forced step, the stack starts afresh
    finally:
        writer.release()
        env.close()


def load_algorithm(script: str | Path):
    """Import an algorithm script (its training sits under ``if __name__ == "__main__"``)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description="Evaluate a saved model (--save-model) on whole games.")
    parser.add_argument("model_path", help="the .cleanrl_model file a run saved")
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--env-id", default=None, help="defaults to the game the model was trained on")
    args = parser.parse_args()
    saved = torch.load(args.model_path, map_location="cpu", weights_only=True)
    script = Path(saved["algo_script"])
    if not script.exists():  # the repository moved: find the script beside this package
        script = Path(__file__).resolve().parents[1] / "algos" / f"{saved['algo']}.py"
    module = load_algorithm(script)
    if "envs" in inspect.signature(module.QNetwork).parameters:  # the custom-algorithm template's QNetwork(envs)
        from cleanrl_utils.harness import network_spec

        q_network = module.QNetwork(network_spec(saved["n_actions"]))
    else:
        q_network = module.QNetwork(saved["n_actions"], **saved.get("network_kwargs", {}))
    q_network.load_state_dict(saved["state_dict"])
    env_id = args.env_id or saved["env_id"]
    result = evaluate(
        q_network, env_id, saved["n_actions"], torch.device("cpu"), args.episodes, args.epsilon, args.seed
    )
    print(json.dumps(result))
    print(f"Eval episodic_return: {result['mean']}")


if __name__ == "__main__":
    main()
