"""Score tables from run folders: per game and algorithm, and the aggregate IQM.

    python -m cleanrl_utils.results runs/

For each game and algorithm: the final evaluation's mean, mean +- std over seeds, and the
human-normalized score. Then the interquartile mean (IQM) of human-normalized scores with a
stratified bootstrap 95% confidence interval (Agarwal et al. 2021, the method of the rliable
package: resample runs with replacement within each game, 25% trimmed mean of all scores),
separately for the tuning games and the held-out games.

rliable itself does not import with current pandas (its ``arch`` dependency fails), so this is
our own small implementation; the tests check it against scipy's trimmed mean and a plain loop.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from cleanrl_utils.scores import game_name, human_normalized_score

TUNING_GAMES = ("Breakout", "Pong", "BeamRider", "Seaquest")
HELD_OUT_GAMES = ("Qbert", "SpaceInvaders", "Enduro", "MsPacman")


def interquartile_mean(scores: np.ndarray) -> float:
    """Mean of the middle half: drop the lowest and highest int(0.25 n) values."""
    flat = np.sort(np.asarray(scores, dtype=np.float64).ravel())
    cut = int(0.25 * flat.size)
    return float(flat[cut : flat.size - cut].mean())


def stratified_bootstrap_ci(
    scores_per_game: list[np.ndarray], reps: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of the IQM when each game's runs are resampled with replacement."""
    rng = np.random.default_rng(seed)
    estimates = np.empty(reps)
    for r in range(reps):
        resampled = [s[rng.integers(0, len(s), len(s))] for s in scores_per_game]
        estimates[r] = interquartile_mean(np.concatenate(resampled))
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(estimates, [tail, 100 - tail])
    return float(low), float(high)


def final_evaluations(run_root: Path) -> list[dict]:
    """One record per run folder that has a final (or, failing that, last) evaluation."""
    records = []
    for receipt_path in sorted(run_root.glob("**/receipt.json")):
        folder = receipt_path.parent
        evaluations_path = folder / "evaluations.json"
        if not evaluations_path.exists():
            continue
        receipt = json.loads(receipt_path.read_text())
        evaluations = json.loads(evaluations_path.read_text())
        if not evaluations:
            continue
        final = next((e for e in reversed(evaluations) if e.get("final")), evaluations[-1])
        env_id = receipt["args"]["env_id"]
        records.append(
            {
                "folder": str(folder),
                "algo": receipt.get("args", {}).get("exp_name") or receipt["algo"],
                "env_id": env_id,
                "game": game_name(env_id),
                "seed": receipt["seed"],
                "step": final["step"],
                "mean": float(final["mean"]),
                "finished": receipt.get("status") == "finished",
            }
        )
    return records


def tables(records: list[dict]) -> str:
    by_game: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_game[r["game"]][r["algo"]].append(r)
    lines = []
    for game in sorted(by_game):
        group = " (tuning game)" if game in TUNING_GAMES else " (held-out game)" if game in HELD_OUT_GAMES else ""
        lines += [f"### {game}{group}", "", "| algorithm | seeds | steps | final eval (mean +- std over seeds) | HNS |"]
        lines.append("|---|---|---|---|---|")
        for algo in sorted(by_game[game]):
            runs = by_game[game][algo]
            means = np.array([r["mean"] for r in runs])
            hns = human_normalized_score(runs[0]["env_id"], float(means.mean()))
            steps = sorted({r["step"] for r in runs})
            lines.append(
                f"| {algo} | {len(runs)} | {', '.join(map(str, steps))} | {means.mean():.2f} +- {means.std():.2f} | "
                f"{'n/a' if hns is None else f'{hns:.3f}'} |"
            )
        lines.append("")
    lines += aggregate(records)
    return "\n".join(lines)


def aggregate(records: list[dict]) -> list[str]:
    lines = ["### Aggregate: IQM of human-normalized scores (stratified bootstrap 95% CI)", ""]
    lines += ["| games | algorithm | games with runs | IQM | 95% CI |", "|---|---|---|---|---|"]
    rows = 0
    for label, games in (("tuning", TUNING_GAMES), ("held-out", HELD_OUT_GAMES)):
        for algo in sorted({r["algo"] for r in records}):
            per_game = []
            for game in games:
                scores = [
                    human_normalized_score(r["env_id"], r["mean"])
                    for r in records
                    if r["game"] == game and r["algo"] == algo
                ]
                if scores:
                    per_game.append(np.array(scores, dtype=np.float64))
            if not per_game:
                continue
            iqm = interquartile_mean(np.concatenate(per_game))
            low, high = stratified_bootstrap_ci(per_game)
            lines.append(f"| {label} | {algo} | {len(per_game)} | {iqm:.3f} | [{low:.3f}, {high:.3f}] |")
            rows += 1
    if rows == 0:
        lines.append("| (no runs of the tuning or held-out games) | | | | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cleanrl_utils.results", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_root", help="a folder of run folders (e.g. runs/)")
    args = parser.parse_args(argv)
    root = Path(args.run_root)
    if not root.is_dir():
        print(f"error: {root} is not a folder of runs", flush=True)
        return 2
    records = final_evaluations(root)
    if not records:
        print(f"error: no run with an evaluations.json under {root}", flush=True)
        return 2
    print(tables(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
