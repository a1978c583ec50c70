"""Evaluation under the protocol: whole games, raw score, epsilon-greedy, separately seeded."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import gymnasium as gym
import numpy as np
import torch
from torch import nn

from cleanrl_utils.envs import (
    MAX_FRAMES_PER_EPISODE,
    NOOP_MAX,
    EnvIdError,
    ale_game,
    check_env_id,
    forced_actions,
    has_fire,
    play_episodes,
)
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


def network_kwargs(network_class: type, saved: dict[str, Any]) -> dict[str, Any]:
    """The saved model's network settings that its script's ``QNetwork`` still takes: a model saved before a
    setting left the script (dqn.py's --dueling, say, now Rainbow's alone) loads if its weights fit, since
    ``load_state_dict`` then checks every tensor's name and shape."""
    taken = inspect.signature(network_class).parameters
    return {key: value for key, value in saved.get("network_kwargs", {}).items() if key in taken}


def action_names(env_id: str, n_actions: int) -> list[str]:
    """The ALE's names of a game's actions (NOOP, FIRE, ...); ``action i`` for other environments."""
    if ale_game(env_id) is not None:
        env = gym.make(env_id)
        names = list(env.unwrapped.get_action_meanings())
        env.close()
        if len(names) == n_actions:
            return names
    return [f"action {i}" for i in range(n_actions)]


def summary(result: dict[str, Any], model_path: str) -> str:
    """The result of ``main`` for people: returns, human-normalized score, game lengths, actions."""
    returns, lengths = np.array(result["episodic_returns"]), np.array(result["episodic_lengths"])
    seeds = result["seeds"]
    hns = result["human_normalized_score"]
    histogram = np.array(result["action_histogram"])
    shares = histogram / max(histogram.sum(), 1)
    names = action_names(result["env_id"], len(histogram))
    return "\n".join(
        [
            f"{result['algo']} on {result['env_id']} ({model_path}): {len(returns)} games, epsilon "
            f"{result['epsilon']}, seeds {seeds[0]}-{seeds[-1]}",
            f"  return: mean {returns.mean():.2f} +- {returns.std():.2f} (std), min {returns.min():g}, "
            f"median {np.median(returns):g}, max {returns.max():g}",
            "  human-normalized score: " + ("n/a (no reference scores for this game)" if hns is None else f"{hns:.3f}"),
            f"  game length: mean {lengths.mean():,.0f} agent steps (min {lengths.min():,}, max {lengths.max():,})",
            "  actions chosen: "
            + ", ".join(f"{name} {100 * share:.1f}%" for name, share in zip(names, shares, strict=True)),
            f"Eval episodic_return: {result['mean']}",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cleanrl_utils.evaluation",
        description="Evaluate a model saved by a run (--save-model) on whole games, as the runs evaluate: raw "
        "game score, no life-loss ending, up to 30 no-op starts, epsilon-greedy actions. The games are played "
        "one after another; a line per game goes to standard error as it ends, then a summary to standard output.",
        epilog="example: python -m cleanrl_utils.evaluation runs/BreakoutNoFrameskip-v4__dqn__1__1700000000/"
        "dqn.cleanrl_model --episodes 10",
    )
    parser.add_argument("model_path", help="the .cleanrl_model file a run saved in its run folder (--save-model)")
    parser.add_argument("--episodes", type=int, default=10, help="how many whole games to play (default: 10)")
    parser.add_argument(
        "--epsilon",
        type=float,
        default=0.01,
        help="the probability of a random action at each step (default: 0.01, as the runs' evaluations; 0: greedy)",
    )
    parser.add_argument(
        "--seed", type=int, default=12345, help="the seed of the first game; game i uses SEED + i (default: 12345)"
    )
    parser.add_argument(
        "--env-id",
        default=None,
        help="the game to play (default: the one the model was trained on); it must have as many actions",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object (per-game returns and lengths, mean, std, action histogram, "
        "human-normalized score) instead of the summary",
    )
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error(f"--episodes {args.episodes} must be at least 1")
    if not 0.0 <= args.epsilon <= 1.0:
        parser.error(f"--epsilon {args.epsilon} must be in [0, 1] (0: greedy)")
    if not Path(args.model_path).is_file():
        parser.error(f"{args.model_path}: no such file; give the .cleanrl_model a run saved with --save-model")
    saved = torch.load(args.model_path, map_location="cpu", weights_only=True)
    script = Path(saved["algo_script"])
    if not script.exists():  # the repository moved: find the script beside this package
        script = Path(__file__).resolve().parents[1] / "algos" / f"{saved['algo']}.py"
    module = load_algorithm(script)
    if "envs" in inspect.signature(module.QNetwork).parameters:  # the custom-algorithm template's QNetwork(envs)
        from cleanrl_utils.template_rules import network_spec

        q_network = module.QNetwork(network_spec(saved["n_actions"]))
    else:
        q_network = module.QNetwork(saved["n_actions"], **network_kwargs(module.QNetwork, saved))
    try:
        q_network.load_state_dict(saved["state_dict"])
    except RuntimeError as error:
        parser.error(f"{args.model_path} does not fit algos/{saved['algo']}.py's network as it is now: {error}")
    env_id = args.env_id or saved["env_id"]
    n_actions = saved["n_actions"]
    if env_id != saved["env_id"]:
        try:
            check_env_id(env_id)
        except EnvIdError as error:
            parser.error(str(error))
        env = gym.make(env_id)
        if env.action_space.n != n_actions:
            parser.error(f"--env-id {env_id} has {env.action_space.n} actions, the model {n_actions}")
        env.close()
    games = []
    for i in range(args.episodes):  # one game at a time, so that each shows as it ends
        start = time.time()
        game = evaluate(q_network, env_id, n_actions, torch.device("cpu"), 1, args.epsilon, args.seed + i)
        games.append(game)
        print(
            f"game {i + 1}/{args.episodes}: return {game['episodic_returns'][0]:g}, "
            f"{game['episodic_lengths'][0]:,} agent steps, {time.time() - start:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    returns = [g["episodic_returns"][0] for g in games]
    mean = float(np.mean(returns))
    result = {
        "model": args.model_path,
        "algo": saved["algo"],
        "env_id": env_id,
        "episodic_returns": returns,
        "episodic_lengths": [g["episodic_lengths"][0] for g in games],
        "mean": mean,
        "std": float(np.std(returns)),
        "action_histogram": np.sum([g["action_histogram"] for g in games], axis=0).tolist(),
        "human_normalized_score": human_normalized_score(env_id, mean),
        "epsilon": args.epsilon,
        "seeds": [args.seed + i for i in range(args.episodes)],
    }
    print(json.dumps(result) if args.json else summary(result, args.model_path), flush=True)


if __name__ == "__main__":
    main()
