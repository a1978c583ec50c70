"""Evaluation under the protocol: whole games, raw score, epsilon-greedy, separately seeded."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cleanrl_utils.envs import play_episodes
from cleanrl_utils.scores import human_normalized_score


def evaluate(
    q_network: nn.Module,
    env_id: str,
    n_actions: int,
    device: torch.device,
    episodes: int = 10,
    epsilon: float = 0.01,
    seed: int = 0,
) -> dict[str, Any]:
    """Play ``episodes`` whole games with the network's greedy action (argmax of its forward
    output, the Q-values) taken with probability 1 - ``epsilon``."""
    was_training = q_network.training
    q_network.eval()

    @torch.no_grad()
    def greedy(obs: np.ndarray) -> np.ndarray:
        return q_network(torch.as_tensor(obs, device=device)).argmax(dim=1).cpu().numpy()

    try:
        returns, lengths, histogram = play_episodes(
            env_id, episodes, seed, greedy, n_actions, epsilon, np.random.default_rng(seed)
        )
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
    q_network = module.QNetwork(saved["n_actions"])
    q_network.load_state_dict(saved["state_dict"])
    env_id = args.env_id or saved["env_id"]
    result = evaluate(
        q_network, env_id, saved["n_actions"], torch.device("cpu"), args.episodes, args.epsilon, args.seed
    )
    print(json.dumps(result))
    print(f"Eval episodic_return: {result['mean']}")


if __name__ == "__main__":
    main()
