"""Learning curves from run folders' TensorBoard events.

    python -m cleanrl_utils.plot runs/ --out curves.png

One panel per game, one line per algorithm: the mean over seeds of the (smoothed) training
episodic return, with a band of +- one standard deviation, against agent steps. Writes the PNG
and an SVG beside it. Needs matplotlib (``pip install 'value-atari[plot]'``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from cleanrl_utils.scores import game_name


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


def collect(run_root: Path, tag: str) -> dict[str, dict[str, list[tuple[np.ndarray, np.ndarray]]]]:
    curves: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for receipt_path in sorted(run_root.glob("**/receipt.json")):
        receipt = json.loads(receipt_path.read_text())
        steps, values = read_curve(receipt_path.parent, tag)
        if len(steps):
            algo = receipt.get("args", {}).get("exp_name") or receipt["algo"]
            curves[game_name(receipt["args"]["env_id"])][algo].append((steps, values))
    return curves


def plot(curves, out: Path, tag: str, window: int, points: int = 200) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    games = sorted(curves)
    columns = min(4, len(games))
    rows = -(-len(games) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.4 * rows), squeeze=False)
    for ax, game in zip(axes.flat, games, strict=False):
        for algo in sorted(curves[game]):
            runs = curves[game][algo]
            end = min(steps[-1] for steps, _ in runs)  # the range every seed covers
            start = max(steps[0] for steps, _ in runs)
            grid = np.linspace(start, end, points) if end > start else np.array([end])
            stacked = np.stack([np.interp(grid, s, smooth(v, window)) for s, v in runs])
            mean, std = stacked.mean(axis=0), stacked.std(axis=0)
            (line,) = ax.plot(grid, mean, label=f"{algo} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
            ax.fill_between(grid, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        ax.set_title(game)
        ax.set_xlabel("agent steps")
        ax.set_ylabel(tag.split("/")[-1].replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(games) :]:
        ax.set_visible(False)
    figure.tight_layout()
    written = []
    for suffix in (".png", ".svg"):
        path = out.with_suffix(suffix)
        figure.savefig(path, dpi=120)
        written.append(path)
    plt.close(figure)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cleanrl_utils.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_root", help="a folder of run folders (e.g. runs/)")
    parser.add_argument("--out", default="curves.png", help="the PNG to write; an SVG is written beside it")
    parser.add_argument("--tag", default="charts/episodic_return", help="the TensorBoard scalar to plot")
    parser.add_argument("--smooth", type=int, default=10, help="episodes in the trailing mean (1: none)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib: pip install 'value-atari[plot]'", flush=True)
        return 2
    root = Path(args.run_root)
    curves = collect(root, args.tag) if root.is_dir() else {}
    if not curves:
        print(f"error: no run under {root} has the TensorBoard tag {args.tag}", flush=True)
        return 2
    for path in plot(curves, Path(args.out), args.tag, max(1, args.smooth)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
