"""The evaluation command: play a model saved by a run (--save-model) on whole games, as the runs evaluate.

python -m cleanrl_utils.tools.evaluate runs/RUN/dqn.cleanrl_model --episodes 10
"""

from __future__ import annotations

import importlib.util
import inspect
import json as json_module
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import gymnasium as gym
import numpy as np
import torch
import tyro

from cleanrl_utils.checks import fail
from cleanrl_utils.envs import EnvIdError, ale_game, check_env_id
from cleanrl_utils.evaluation import evaluate


def load_algorithm(script: str | Path):
    """Import an algorithm script (its training sits under ``if __name__ == "__main__"``)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


PROTOCOL = tyro.conf.create_mutex_group(required=False, title="the protocol")


@dataclass
class EvaluateArgs:
    """Evaluate a model saved by a run (--save-model) on whole games, as the runs evaluate: raw game score, no
    life-loss ending, the no-op starts, forced steps and stacks its run played, epsilon-greedy actions with a run's
    draws for the same seed, several games at a time. A line per game goes to standard error as it ends, then a
    summary to standard output. Example:
    python -m cleanrl_utils.tools.evaluate runs/BreakoutNoFrameskip-v4__dqn__1__1700000000/dqn.cleanrl_model"""

    model_path: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="MODEL_PATH")]
    """the .cleanrl_model file a run saved in its run folder (--save-model)"""
    episodes: int = 10
    """how many whole games to play"""
    epsilon: float = 0.01
    """the probability of a random action at each step (as the runs' evaluations; 0: greedy)"""
    seed: int = 12345
    """the seed of the first game; game i uses SEED + i"""
    env_id: str | None = None
    """the game to play (None: the one the model was trained on); it must have as many actions"""
    forced_steps: Annotated[tyro.conf.FlagCreatePairsOff[bool], PROTOCOL] = False
    """FIRE (and the NOOP after a life loss) pressed for the agent; neither flag: as the model's run played"""
    no_forced_steps: Annotated[tyro.conf.FlagCreatePairsOff[bool], PROTOCOL] = False
    """nothing pressed for the agent (DrQ's Atari 100k default); neither flag: as the model's run played"""
    json: tyro.conf.FlagCreatePairsOff[bool] = False
    """print the result as one JSON object (per-game returns and lengths, mean, std, action histogram,
    human-normalized score) instead of the summary"""


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(EvaluateArgs, args=argv, prog="python -m cleanrl_utils.tools.evaluate")
    if args.episodes < 1:
        fail(f"--episodes {args.episodes} must be at least 1")
    if not 0.0 <= args.epsilon <= 1.0:
        fail(f"--epsilon {args.epsilon} must be in [0, 1] (0: greedy)")
    if not Path(args.model_path).is_file():
        fail(f"{args.model_path}: no such file; give the .cleanrl_model a run saved with --save-model")
    saved = torch.load(args.model_path, map_location="cpu", weights_only=True)
    script = Path(saved["algo_script"])
    if not script.exists():  # the repository moved: find the script beside this package
        script = Path(__file__).resolve().parents[2] / "algos" / f"{saved['algo']}.py"
    module = load_algorithm(script)
    taken = inspect.signature(module.QNetwork).parameters  # every script's network: QNetwork(n_actions, **settings)
    unknown = sorted(set(saved["network_kwargs"]) - set(taken))
    if unknown:
        fail(
            f"{args.model_path} was saved with network settings algos/{saved['algo']}.py's QNetwork does not take "
            f"({', '.join(unknown)}): an earlier version of the script saved it; evaluate it with that version"
        )
    q_network = module.QNetwork(saved["n_actions"], **saved["network_kwargs"])
    try:
        q_network.load_state_dict(saved["state_dict"])
    except RuntimeError as error:
        fail(f"{args.model_path} does not fit algos/{saved['algo']}.py's network as it is now: {error}")
    env_id = args.env_id or saved["env_id"]
    n_actions = saved["n_actions"]
    # the protocol the model's run played (files of earlier versions recorded forced_steps alone, zero_stacks and
    # noop_max did not exist then: their defaults are how those runs played)
    protocol = dict(
        saved.get("protocol") or ({"forced_steps": saved["forced_steps"]} if "forced_steps" in saved else {})
    )
    if args.forced_steps or args.no_forced_steps:
        protocol["forced_steps"] = args.forced_steps
    if "forced_steps" not in protocol:
        fail(
            f"{args.model_path} does not record its protocol (saved by an earlier version of value-atari): "
            "say how to play it, --forced-steps (FIRE pressed for the agent, every script but drq.py's default) "
            "or --no-forced-steps"
        )
    if env_id != saved["env_id"]:
        try:
            check_env_id(env_id)
        except EnvIdError as error:
            fail(str(error))
        env = gym.make(env_id)
        if env.action_space.n != n_actions:
            fail(f"--env-id {env_id} has {env.action_space.n} actions, the model {n_actions}")
        env.close()
    start = time.time()

    def show_game(game: int, ended: int, episodic_return: float, length: int) -> None:
        print(
            f"game {ended}/{args.episodes} (seed {args.seed + game}): return {episodic_return:g}, "
            f"{length:,} agent steps, {time.time() - start:.1f}s",
            file=sys.stderr,
            flush=True,
        )

    played = evaluate(
        q_network, env_id, n_actions, torch.device("cpu"), args.episodes, args.epsilon, args.seed, protocol=protocol,
        on_game_end=show_game,
    )  # fmt: skip
    result = {
        "model": args.model_path,
        "algo": saved["algo"],
        "env_id": env_id,
        **played,  # returns, lengths, mean, std, action histogram, human-normalized score, epsilon, first seed
        "seeds": [args.seed + i for i in range(args.episodes)],
        "protocol": protocol,
    }
    print(json_module.dumps(result) if args.json else summary(result, args.model_path), flush=True)


if __name__ == "__main__":
    main()
