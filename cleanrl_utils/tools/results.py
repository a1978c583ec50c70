"""Score tables from run folders: per game and algorithm, and the aggregate IQM.

    python -m cleanrl_utils.tools.results runs/

For each game and algorithm: the final evaluation's mean, mean +- std over seeds, and the
human-normalized score. Then the interquartile mean (IQM) of human-normalized scores with a
stratified bootstrap 95% confidence interval (Agarwal et al. 2021, the method of the rliable
package: resample runs with replacement within each game, 25% trimmed mean of all scores),
separately for the tuning games and the held-out games.

``--published FILE`` (e.g. benchmarks/atari100k_published.json) adds a published algorithm's per-game means as a
row of each game's table, and an aggregate over that file's games with the published IQM beside ours; where the file
holds the published per-run scores (``runs``), also the published runs' IQM over the games each algorithm was run on,
the same games as ours.

Seeds are counted by seed: of several runs of one algorithm, game and seed, the newest finished one is
used. Unfinished runs and runs much shorter than the others of their algorithm and game are left out
(``--all-runs`` gives each its own row); the runs left out are listed at the end, with the reason.

rliable itself does not import with current pandas (its ``arch`` dependency fails), so this is
our own small implementation; the tests check it against scipy's trimmed mean and a plain loop.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from cleanrl_utils.scores import game_name, human_normalized_score

TUNING_GAMES = ("Breakout", "Pong", "BeamRider", "Seaquest")
HELD_OUT_GAMES = ("Qbert", "SpaceInvaders", "Enduro", "MsPacman")
SHORT = 0.9  # a finished run with fewer agent steps than this share of the longest of its algorithm and game


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


def run_records(run_root: Path) -> list[dict[str, Any]]:
    """One record per run folder under ``run_root`` that has a receipt: its algorithm, game and seed, how far it
    got (agent steps), whether it finished, and when it started (the folder name's time, else the receipt's)."""
    records = []
    for receipt_path in sorted(run_root.glob("**/receipt.json")):
        try:
            receipt = json.loads(receipt_path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        folder = receipt_path.parent
        env_id = receipt["args"]["env_id"]
        stamp = folder.name.rpartition("__")[2]
        records.append(
            {
                "folder": str(folder),
                "algo": receipt["args"].get("exp_name") or receipt["algo"],
                "env_id": env_id,
                "game": game_name(env_id),
                "seed": receipt["seed"],
                "status": receipt.get("status"),
                "finished": receipt.get("status") == "finished",
                "steps": int(receipt.get("counts", {}).get("env_steps", 0)),
                "started": float(stamp) if stamp.isdigit() else receipt_path.stat().st_mtime,
            }
        )
    return records


def choose_runs(records: list[dict[str, Any]], all_runs: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """Which runs to show, and a line for each one left out, with the reason.

    Seeds are counted by seed: of the runs of one algorithm, game and seed, the newest finished one (else the
    newest) is used, the others left out. Unfinished runs, and runs much shorter (under ``SHORT``, 90%, of the
    agent steps) than the longest finished run of their algorithm and game, are left out too. With ``all_runs``
    every run left out is kept instead, its ``partial`` set to the reason (shown on its own, to its own end,
    never averaged with the others); the runs averaged have ``partial`` None."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        groups[record["game"], record["algo"], record["seed"]].append(record)
    chosen, others = [], []
    for runs in groups.values():
        runs = sorted(runs, key=lambda r: (r["finished"], r["started"]), reverse=True)
        chosen.append(runs[0])
        used = f" ({Path(runs[0]['folder']).name} is used)"
        others += [(r, "older run", f" of seed {r['seed']}{used}") for r in runs[1:]]
    longest: dict[tuple, int] = defaultdict(int)
    for r in chosen:
        if r["finished"]:
            longest[r["game"], r["algo"]] = max(longest[r["game"], r["algo"]], r["steps"])
    kept, left_out = [], []
    for r, why, detail in [(r, None, "") for r in chosen] + others:
        full = longest[r["game"], r["algo"]]
        if not r["finished"]:
            why, detail = f"unfinished at step {r['steps']:,}", f" (status: {r['status']})"
        elif why is None and r["steps"] < SHORT * full:
            why = f"only {r['steps']:,} of {full:,} steps"
        if why is None or all_runs:
            kept.append({**r, "partial": why})
        else:
            left_out.append(f"{r['folder']}: {why}{detail}; --all-runs shows it on its own")
    kept.sort(key=lambda r: (r["game"], r["algo"], r["seed"], r["started"]))
    return kept, sorted(left_out)


def final_evaluations(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The records that have an evaluation, each with its final (or, failing that, last) one: ``step`` and
    ``mean``; and a line for each run without one."""
    evaluated, left_out = [], []
    for record in records:
        path = Path(record["folder"]) / "evaluations.json"
        evaluations = json.loads(path.read_text()) if path.exists() else []
        if not evaluations:
            left_out.append(f"{record['folder']}: no evaluation yet")
            continue
        final = next((e for e in reversed(evaluations) if e.get("final")), evaluations[-1])
        evaluated.append({**record, "step": final["step"], "mean": float(final["mean"])})
    return evaluated, left_out


def load_published(path: Path) -> dict[str, Any]:
    """A published algorithm's scores: ``algorithm``, ``source``, ``runs_per_game``, ``steps``, ``games`` (game
    name -> mean final score), optionally ``iqm`` and ``iqm_ci`` over those games, and ``runs`` (game name -> each
    run's final score)."""
    published = json.loads(Path(path).read_text())
    missing = [key for key in ("algorithm", "source", "runs_per_game", "steps", "games") if key not in published]
    if missing:
        raise ValueError(f"--published {path}: missing {', '.join(missing)}")
    return published


def tables(
    records: list[dict[str, Any]], left_out: list[str] | None = None, published: dict[str, Any] | None = None
) -> str:
    """Per game, a row per algorithm (mean +- std over seeds of the final evaluations) and one per partial run
    (``choose_runs(all_runs=True)``), and the published mean where ``published`` has the game; then the aggregate
    IQM (whole runs only) and the runs left out."""
    by_game: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_game[r["game"]][r["algo"]].append(r)
    lines = []
    for game in sorted(by_game):
        group = " (tuning game)" if game in TUNING_GAMES else " (held-out game)" if game in HELD_OUT_GAMES else ""
        lines += [f"### {game}{group}", "", "| algorithm | seeds | steps | final eval (mean +- std over seeds) | HNS |"]
        lines.append("|---|---|---|---|---|")
        for algo in sorted(by_game[game]):
            runs = [r for r in by_game[game][algo] if not r.get("partial")]
            if runs:
                lines.append(row(algo, runs))
            for r in by_game[game][algo]:
                if r.get("partial"):
                    lines.append(row(f"{algo} seed {r['seed']}: {r['partial']}", [r]))
        if published and game in published["games"]:
            lines.append(published_row(published, game, next(iter(by_game[game].values()))[0]["env_id"]))
        lines.append("")
    lines += aggregate([r for r in records if not r.get("partial")], published)
    if left_out:
        lines += ["", "### Left out", "", *(f"- {line}" for line in left_out)]
    return "\n".join(lines)


def row(label: str, runs: list[dict[str, Any]]) -> str:
    means = np.array([r["mean"] for r in runs])
    hns = human_normalized_score(runs[0]["env_id"], float(means.mean()))
    steps = sorted({r["step"] for r in runs})
    return (
        f"| {label} | {len({r['seed'] for r in runs})} | {', '.join(map(str, steps))} | "
        f"{means.mean():.2f} +- {means.std():.2f} | {'n/a' if hns is None else f'{hns:.3f}'} |"
    )


def published_row(published: dict[str, Any], game: str, env_id: str) -> str:
    mean = float(published["games"][game])
    hns = human_normalized_score(env_id, mean)
    return (
        f"| published {published['algorithm']} | {published['runs_per_game']} | {published['steps']} | "
        f"{mean:.2f} (mean) | {'n/a' if hns is None else f'{hns:.3f}'} |"
    )


def aggregate(records: list[dict], published: dict[str, Any] | None = None) -> list[str]:
    lines = ["### Aggregate: IQM of human-normalized scores (stratified bootstrap 95% CI)", ""]
    lines += ["| games | algorithm | games with runs | IQM | 95% CI |", "|---|---|---|---|---|"]
    rows = 0
    ran = {(r["algo"], r["game"]) for r in records}
    groups = [("tuning", TUNING_GAMES), ("held-out", HELD_OUT_GAMES)]
    if published:
        groups.append((f"{len(published['games'])} games of --published", tuple(published["games"])))
    for label, games in groups:
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
            if published and "runs" in published and games == tuple(published["games"]):
                lines.append(published_runs_row(published, algo, [g for g in games if (algo, g) in ran]))
    if published and "iqm" in published:
        low, high = published.get("iqm_ci", ("?", "?"))
        games = len(published["games"])
        name = f"published {published['algorithm']} ({published['runs_per_game']} runs per game)"
        lines.append(f"| {games} games of --published | {name} | {games} | {published['iqm']:.3f} | [{low}, {high}] |")
    if published:
        lines += ["", f"Published: {published['source']}"]
    if rows == 0:
        lines.append("| (no runs of the tuning or held-out games) | | | | |")
    return lines


def published_runs_row(published: dict[str, Any], algo: str, games: list[str]) -> str:
    """The published runs' IQM and its interval over ``games`` (those ``algo`` was run on): ours beside theirs on
    the same games, where the file's IQM is over all of its games"""
    per_game = [
        np.array([human_normalized_score(game, score) for score in published["runs"][game]], dtype=np.float64)
        for game in games
    ]
    iqm = interquartile_mean(np.concatenate(per_game))
    low, high = stratified_bootstrap_ci(per_game)
    name = f"published {published['algorithm']}, {published['runs_per_game']} runs per game"
    return f"| the {len(games)} games of {algo} | {name} | {len(games)} | {iqm:.3f} | [{low:.3f}, {high:.3f}] |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cleanrl_utils.tools.results", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_root", help="a folder of run folders (e.g. runs/)")
    parser.add_argument(
        "--all-runs",
        action="store_true",
        help="also list unfinished and much shorter runs, each on its own row (never averaged with the others)",
    )
    parser.add_argument(
        "--published",
        default=None,
        help="a JSON file of a published algorithm's per-game means (e.g. benchmarks/atari100k_published.json)",
    )
    args = parser.parse_args(argv)
    root = Path(args.run_root)
    if not root.is_dir():
        print(f"error: {root} is not a folder of runs", flush=True)
        return 2
    chosen, left_out = choose_runs(run_records(root), args.all_runs)
    records, no_evaluation = final_evaluations(chosen)
    if not records:
        print(f"error: no run with an evaluations.json under {root}", flush=True)
        return 2
    try:
        published = load_published(Path(args.published)) if args.published else None
    except (OSError, ValueError) as error:
        print(f"error: {error}", flush=True)
        return 2
    print(tables(records, left_out + no_evaluation, published))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
