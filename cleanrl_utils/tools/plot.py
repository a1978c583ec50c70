"""Learning curves from run folders' TensorBoard events.

    python -m cleanrl_utils.tools.plot runs/ --out curves.png

One panel per game, one line per algorithm: the mean over seeds of the (smoothed) training
episodic return, with a band of +- one standard deviation, against agent steps, and the random
agent's score (DQN Zoo's table) as a dotted line on return plots. Writes the PNG
and an SVG beside it. Needs matplotlib (``pip install 'value-atari[plot]'``).

The runs drawn are chosen as ``cleanrl_utils.tools.results`` chooses them: one per seed (the newest finished),
whole runs only; unfinished and much shorter runs are listed and left out (the figure says how many),
or with ``--all-runs`` drawn alone, dashed, to their own end.
"""

from __future__ import annotations

import argparse
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cleanrl_utils.scores import REFERENCE_SCORES
from cleanrl_utils.tools.results import choose_runs, run_records


def steps_label(value: float, _position: Any = None) -> str:
    """An axis label for a number of agent steps: 0, 50k, 1.5M."""
    if abs(value) >= 1e6:
        return f"{value / 1e6:g}M"
    if abs(value) >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


def read_curve(folder: Path, tag: str) -> tuple[np.ndarray, np.ndarray]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return np.empty(0), np.empty(0)
    scalars = events.Scalars(tag)
    return np.array([s.step for s in scalars], dtype=np.float64), np.array([s.value for s in scalars])


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` episodes (shorter at the start)."""
    cumulative = np.cumsum(np.insert(values, 0, 0.0))
    index = np.arange(1, len(values) + 1)
    start = np.maximum(index - window, 0)
    return (cumulative[index] - cumulative[start]) / (index - start)


def collect(run_root: Path, tag: str, all_runs: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """The runs to draw (``results.choose_runs``: one per seed, whole runs unless ``all_runs``), each with its
    curve (``curve_steps``, ``values``), and a line for each run left out, with the reason."""
    chosen, left_out = choose_runs(run_records(run_root), all_runs)
    runs = []
    for record in chosen:
        steps, values = read_curve(Path(record["folder"]), tag)
        if len(steps):
            runs.append({**record, "curve_steps": steps, "values": values})
        else:
            left_out.append(f"{record['folder']}: no {tag} logged yet")
    return runs, left_out


@dataclass
class Line:
    """One line of a panel: the mean over seeds with its std band, or (``std`` None) one partial run."""

    game: str
    label: str
    steps: np.ndarray
    mean: np.ndarray
    std: np.ndarray | None


def lines(runs: list[dict[str, Any]], window: int, points: int = 200) -> list[Line]:
    """Per game and algorithm: the mean of the smoothed curves of its whole runs, over the steps they all cover
    (whole runs are within 10% of each other's length); then each partial run alone, to its own end."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[run["game"], run["algo"]].append(run)
    out = []
    for (game, algo), group in sorted(groups.items()):
        whole = [r for r in group if not r["partial"]]
        if whole:
            end = min(r["curve_steps"][-1] for r in whole)
            start = max(r["curve_steps"][0] for r in whole)
            grid = np.linspace(start, end, points) if end > start else np.array([end])
            stacked = np.stack([np.interp(grid, r["curve_steps"], smooth(r["values"], window)) for r in whole])
            seeds = len({r["seed"] for r in whole})
            label = f"{algo} ({seeds} seed{'s' if seeds > 1 else ''})"
            out.append(Line(game, label, grid, stacked.mean(axis=0), stacked.std(axis=0)))
        for r in group:
            if r["partial"]:
                label = f"{algo} seed {r['seed']}: {r['partial']}"
                out.append(Line(game, label, r["curve_steps"], smooth(r["values"], window), None))
    return out


def plot(drawn: list[Line], out: Path, tag: str, left_out: int = 0) -> list[Path]:
    """One panel per game; partial runs dashed. A footnote counts the runs left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plt.rcParams["svg.fonttype"] = "none"  # text stays text in the SVG (searchable, smaller)
    games = sorted({line.game for line in drawn})
    columns = min(4, len(games))
    rows = -(-len(games) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.4 * rows + 0.3), squeeze=False)
    for ax, game in zip(axes.flat, games, strict=False):
        for line in (line for line in drawn if line.game == game):
            if line.std is None:
                ax.plot(line.steps, line.mean, linestyle="--", linewidth=1, label=line.label)
                continue
            (curve,) = ax.plot(line.steps, line.mean, label=line.label)
            ax.fill_between(line.steps, line.mean - line.std, line.mean + line.std, color=curve.get_color(), alpha=0.2)
        if tag.endswith("episodic_return") and game in REFERENCE_SCORES:  # where learning starts from
            ax.axhline(REFERENCE_SCORES[game][0], color="gray", linestyle=":", linewidth=1, label="random play")
        ax.set_title(game)
        ax.set_xlabel("agent steps")
        ax.xaxis.set_major_formatter(FuncFormatter(steps_label))  # 300k, 10M: tick labels that do not run together
        ax.set_ylabel(tag.split("/")[-1].replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(games) :]:
        ax.set_visible(False)
    notes = []
    if left_out:
        notes.append(f"Not drawn: {left_out} run(s), unfinished, much shorter, or an older run of a seed")
        notes.append("(the command lists them).")
    if any(line.std is None for line in drawn):
        notes.append("Dashed: a single run on its own, to its own end, not in the means (--all-runs).")
    note = textwrap.fill(" ".join(notes), width=int(20 * figure.get_figwidth()))
    bottom = 0.0
    if note:
        figure.text(0.01, 0.01, note, fontsize=7, va="bottom")
        bottom = (0.13 * (note.count("\n") + 1) + 0.05) / figure.get_figheight()
    figure.tight_layout(rect=(0, bottom, 1, 1))
    written = []
    for suffix in (".png", ".svg"):
        path = out.with_suffix(suffix)
        figure.savefig(path, dpi=120)
        written.append(path)
    plt.close(figure)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cleanrl_utils.tools.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_root", help="a folder of run folders (e.g. runs/)")
    parser.add_argument("--out", default="curves.png", help="the PNG to write; an SVG is written beside it")
    parser.add_argument("--tag", default="charts/episodic_return", help="the TensorBoard scalar to plot")
    parser.add_argument("--smooth", type=int, default=10, help="episodes in the trailing mean (1: none)")
    parser.add_argument(
        "--all-runs",
        action="store_true",
        help="also draw unfinished and much shorter runs, each alone (dashed) to its own end, not in the means",
    )
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib: pip install 'value-atari[plot]'", flush=True)
        return 2
    root = Path(args.run_root)
    runs, left_out = collect(root, args.tag, args.all_runs) if root.is_dir() else ([], [])
    for line in left_out:
        print(f"left out: {line}")
    if not runs:
        print(f"error: no run to draw under {root} with the TensorBoard tag {args.tag}", flush=True)
        return 2
    for path in plot(lines(runs, max(1, args.smooth)), Path(args.out), args.tag, len(left_out)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
