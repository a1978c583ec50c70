"""What an evaluation of many games costs, before and after it plays a pool of games, measured in one process.

    python benchmarks/evaluation_cost.py --env-id BreakoutNoFrameskip-v4 --episodes 100 --baseline 7060ba7

The games are played by algos/drq.py's network (seeded, untrained) under DrQ's protocol (nothing pressed for the
agent, epsilon 0.01): an untrained agent seldom presses FIRE, so Breakout's games are long and unequal, as a
barely trained agent's are. Variants, each timed over the same games' seeds:

- before (``--baseline REV``): that revision's ``play_episodes``, every game at once, every game's observation
  forwarded at every step until the longest game ends;
- all_at_once: today's ``play_episodes`` with ``parallel`` = the number of games (only the games being played are
  forwarded; the finished ones' environments still step, ale-py's vector steps them all);
- pool P (``--parallel``): today's ``play_episodes`` with P games at a time, the default being
  ``EVAL_PARALLEL_GAMES``.

It prints, per variant, the wall time, the observations forwarded, the environment steps (slots x steps), and the
games' mean return and length; the pool variants must give the same games (printed). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from cleanrl_utils import envs as envs_module
from cleanrl_utils.envs import EVAL_PARALLEL_GAMES, play_episodes
from cleanrl_utils.tools.evaluate import load_algorithm

REPO = Path(__file__).resolve().parents[1]


def load_baseline_play_episodes(revision: str):
    """``play_episodes`` as ``revision``'s cleanrl_utils/envs.py wrote it (its own TrainEnvs with it)"""
    source = subprocess.run(
        ["git", "show", f"{revision}:cleanrl_utils/envs.py"], cwd=REPO, capture_output=True, check=True, text=True
    ).stdout
    module = types.ModuleType("envs_baseline")
    module.__dict__["__name__"] = "envs_baseline"
    sys.modules["envs_baseline"] = module  # dataclasses look their module up while they are built
    exec(compile(source, f"{revision}:cleanrl_utils/envs.py", "exec"), module.__dict__)
    return module.play_episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--parallel", type=int, nargs="+", default=[EVAL_PARALLEL_GAMES])
    parser.add_argument("--baseline", default=None, help="a git revision whose play_episodes is timed too")
    parser.add_argument("--epsilon", type=float, default=0.01)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    options = parser.parse_args()

    drq = load_algorithm(REPO / "algos" / "drq.py")
    n_actions = envs_module.TrainEnvs(options.env_id, 1, seed=0).n_actions
    torch.manual_seed(0)
    q_network = drq.QNetwork(n_actions).eval()

    variants: dict[str, tuple] = {}
    if options.baseline:
        variants["before"] = (load_baseline_play_episodes(options.baseline), {})
    variants["all_at_once"] = (play_episodes, {"parallel": options.episodes})
    for parallel in options.parallel:
        variants[f"pool {parallel}"] = (play_episodes, {"parallel": parallel})

    figures = {}
    for name, (play, extra) in variants.items():
        forwarded = [0]
        steps = [0]

        @torch.no_grad()
        def greedy(obs: np.ndarray, forwarded=forwarded, steps=steps) -> np.ndarray:
            forwarded[0] += len(obs)
            steps[0] += 1
            return q_network(torch.as_tensor(obs)).argmax(dim=1).numpy()

        start = time.perf_counter()
        returns, lengths, _ = play(
            options.env_id, options.episodes, 12345, greedy, n_actions, options.epsilon, np.random.default_rng(0),
            forced_steps=False, **extra,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        slots = min(options.episodes, extra.get("parallel", options.episodes))
        figures[name] = {
            "seconds": round(seconds, 1),
            "observations_forwarded": forwarded[0],
            "environment_steps": steps[0] * slots,
            "game_steps": int(sum(lengths)),
            "longest_game": int(max(lengths)),
            "mean_return": float(np.mean(returns)),
            "returns": returns,
            "lengths": lengths,
        }
        print(
            f"{name:>12}: {seconds:7.1f} s, {forwarded[0]:>9,} observations forwarded, "
            f"{steps[0] * slots:>9,} environment steps for {sum(lengths):,} game steps "
            f"(longest game {max(lengths):,}), mean return {np.mean(returns):.2f}",
            flush=True,
        )
    pools = [figures[name] for name in figures if name != "before"]
    same = all(f["returns"] == pools[0]["returns"] and f["lengths"] == pools[0]["lengths"] for f in pools)
    print(f"today's variants play the same games: {same}")
    if "before" in figures:
        for name in figures:
            if name != "before":
                print(f"before / {name}: {figures['before']['seconds'] / figures[name]['seconds']:.2f}x the time")
    if options.json:
        machine = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
        machine["threads"] = torch.get_num_threads()
        Path(options.json).write_text(json.dumps({"options": vars(options), "machine": machine, **figures}) + "\n")


if __name__ == "__main__":
    main()
