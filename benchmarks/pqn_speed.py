"""PQN's learning-phase agent steps/s against DQN's, the scripts themselves, in one run.

    OMP_NUM_THREADS=1 python benchmarks/pqn_speed.py --rounds 2

Each round runs algos/dqn.py and algos/pqn.py on Breakout twice, a short and a long run with the same start; the
difference of their wall times is the extra steps' cost, all in the learning phase (DQN: past --learning-starts,
one update of batch 32 per 4 agent steps, CleanRL's; PQN: learning from the first rollout, CleanRL's 8 games x 128
steps and 4 epochs x 4 minibatches), so start-up, random play and the final evaluation cancel. The rounds
alternate the scripts so a noisy machine slows both alike. From the long runs' receipts it also prints where the
time went (games, acting, updates). Figures are printed and written as JSON (``--json``); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--env-id", "BreakoutNoFrameskip-v4", "--device", "cpu", "--eval-every", "0", "--eval-episodes", "1"]
COMMON += ["--eval-epsilon", "1", "--checkpoint-every", "0", "--seed", "1"]
FLAGS = {  # DQN with 8 games, as the short CPU runs of docs/results.md; learning from step 2,000
    "dqn": ["--num-envs", "8", "--learning-starts", "2000", "--buffer-size", "20000"],
    "pqn": [],
}


def timed_run(script: str, total: int, threads: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, f"algos/{script}.py", *COMMON, *FLAGS[script], "--total-timesteps", str(total)]
        command += ["--torch-threads", str(threads), "--run-dir", folder]
        start = time.perf_counter()
        subprocess.run(command, cwd=REPO, check=True, capture_output=True)
        seconds = time.perf_counter() - start
        [receipt] = Path(folder).glob("*/receipt.json")
        return seconds, json.loads(receipt.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--short", type=int, default=4096, help="agent steps of the short run (a multiple of 1024)")
    parser.add_argument("--extra", type=int, default=8192, help="agent steps the long run adds (a multiple of 1024)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--json", default=None, help="where to write the figures as JSON")
    options = parser.parse_args()
    rates: dict[str, list[float]] = {"dqn": [], "pqn": []}
    shares: dict[str, dict[str, float]] = {}
    for round_ in range(options.rounds):
        for script in ("dqn", "pqn") if round_ % 2 == 0 else ("pqn", "dqn"):
            short, _ = timed_run(script, options.short, options.threads)
            long, receipt = timed_run(script, options.short + options.extra, options.threads)
            rates[script].append(options.extra / (long - short))
            timings = receipt["timings_seconds"]
            loop = sum(timings.get(k, 0.0) for k in ("acting", "environment", "learning"))
            shares[script] = {k: timings.get(k, 0.0) / loop for k in ("acting", "environment", "learning")}
            print(f"round {round_ + 1} {script}: {rates[script][-1]:.0f} agent steps/s in the learning phase")
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "threads": options.threads,
        "median_steps_per_second": {k: statistics.median(v) for k, v in rates.items()},
        "rounds": rates,
        "pqn_over_dqn": statistics.median(rates["pqn"]) / statistics.median(rates["dqn"]),
        "loop_shares_of_the_long_run": shares,
    }
    for script in ("dqn", "pqn"):
        parts = ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares[script].items())
        print(f"{script}: median {result['median_steps_per_second'][script]:.0f} steps/s; loop time: {parts}")
    print(f"PQN / DQN: {result['pqn_over_dqn']:.2f}x")
    if options.json:
        Path(options.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
