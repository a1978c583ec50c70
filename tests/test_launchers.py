"""Per-game shell launchers, the many-runs launcher, plots and score tables, from real runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, check_evaluation, run_python
from scipy import stats

from cleanrl_utils.tools.results import interquartile_mean, stratified_bootstrap_ci

TINY = ["--total-timesteps", "300", "--learning-starts", "100", "--buffer-size", "500", "--eval-episodes", "2"]
TINY += ["--target-network-frequency", "100", "--device", "cpu"]


def test_shell_launcher_runs_a_game_from_any_directory(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "CI": "true"}
    command = [str(REPO / "scripts" / "pong.sh"), "double_dqn", "2", *TINY[:6], "--eval-episodes", "1"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first = done.stdout.splitlines()[0]
    assert first.startswith("+ ") and "--env-id PongNoFrameskip-v4 --seed 2 --device auto" in first
    [receipt] = (tmp_path / "runs").glob("PongNoFrameskip-v4__double_dqn__2__*/receipt.json")
    assert json.loads(receipt.read_text())["status"] == "finished"


@pytest.mark.parametrize("device", [["--device", "cpu"], ["--device=cpu"]])
def test_shell_launcher_echoes_the_users_device_once(device, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "CI": "true"}
    command = [str(REPO / "scripts" / "breakout.sh"), "dqn", "3", *device, "--help"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    first = done.stdout.splitlines()[0]
    assert first.endswith(f"--env-id BreakoutNoFrameskip-v4 --seed 3 {' '.join(device)} --help"), first
    assert first.count("--device") == 1 and "auto" not in first


def test_shell_launcher_refuses_an_unknown_algorithm(tmp_path):
    done = subprocess.run([str(REPO / "scripts" / "breakout.sh"), "dqnn"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown algorithm 'dqnn'" in done.stderr and "double_dqn" in done.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shell_launchers_pass_shellcheck():
    scripts = sorted(str(p) for p in (REPO / "scripts").glob("*.sh"))
    assert len(scripts) == 10
    done = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


ATARI100K_SHORT = ["--total-timesteps", "120", "--learning-starts", "64", "--eval-episodes", "1", "--device", "cpu"]


@pytest.mark.parametrize("algo,games,script", [("drq", "Pong Boxing", "drq"), ("der", "Pong", "rainbow")])
def test_the_atari100k_launcher_runs_its_games_and_prints_the_table_beside_the_published_means(
    algo, games, script, tmp_path
):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "CI": "true",
        "GAMES": games,
        "RUN_DIR": str(tmp_path),
        "WORKERS": "2",
    }
    command = [str(REPO / "scripts" / "atari100k.sh"), algo, "1", *ATARI100K_SHORT]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for game in games.split():
        [folder] = (tmp_path / algo).glob(f"{game}NoFrameskip-v4__{script}__1__*")
        receipt = json.loads((folder / "receipt.json").read_text())
        assert receipt["status"] == "finished" and receipt["counts"]["env_steps"] == 120
        if algo == "der":  # DER.gin's settings reached the run
            assert (receipt["args"]["n_step"], receipt["args"]["prioritized_beta_end"]) == (10, 0.5)
        # Dopamine's protocol, no forced steps: no FIRE pressed at the game's start (Pong's game outlasts 120
        # steps), and no-op frames (drq.py's default, DER's too), not steps: every step is a transition, and every step
        # of the evaluation's game is the agent's
        assert receipt["counts"]["transitions_stored"] == 120
        [final] = json.loads((folder / "evaluations.json").read_text())
        n_actions = 6 if game == "Pong" else 18
        check_evaluation(final, episodes=1, n_actions=n_actions, forced_per_game=0)
        mean = json.loads((REPO / "benchmarks" / "atari100k_published.json").read_text())["games"][game]
        assert f"| published DrQ(eps) | 100 | 100000 | {mean:.2f} (mean) |" in done.stdout, (game, done.stdout)
    assert f"| {script} | 1 | 120 |" in done.stdout  # our runs' rows


def test_the_atari100k_launcher_refuses_a_game_outside_the_26(tmp_path):
    env = {**os.environ, "GAMES": "Pong Tetris"}
    done = subprocess.run([str(REPO / "scripts" / "atari100k.sh"), "drq", "1"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "'Tetris' is not one of the 26" in done.stderr


@pytest.fixture(scope="session")  # made once (tests/conftest.py's _shared_run_group)
def grid(tmp_path_factory):
    """A real 3-run grid on the toy tasks with 2 workers; one run fails on purpose."""
    root = tmp_path_factory.mktemp("grid")
    args = ["-m", "cleanrl_utils.tools.benchmark", "--algos", "dqn", "double_dqn", "--env-ids"]
    args += ["tests.toy_envs:ImageBandit-v0", "--seeds", "1", "--workers", "2", "--run-dir", str(root)]
    first = run_python(*args, "--", *TINY, timeout=600)
    crash = ["-m", "cleanrl_utils.tools.benchmark", "--algos", "dqn", "--env-ids", "tests.toy_envs:CrashingBandit-v0"]
    crash += ["--seeds", "1", "--run-dir", str(root)]
    failing = run_python(*crash, "--", *TINY, timeout=600)
    again = run_python(*args, "--", *TINY, timeout=600)
    return root, first, failing, again


def test_pool_runs_the_grid_with_a_log_per_run(grid):
    root, first, _, _ = grid
    assert first.returncode == 0, first.stderr[-2000:]
    assert "2 finished, 0 failed" in first.stdout
    for algo in ("dqn", "double_dqn"):
        [folder] = root.glob(f"tests.toy_envs_ImageBandit-v0__{algo}__1__*")
        assert json.loads((folder / "receipt.json").read_text())["status"] == "finished"
        assert "Final eval return" in (root / "logs" / f"tests.toy_envs_ImageBandit-v0__{algo}__1.log").read_text()


def test_a_failed_run_is_reported_with_its_log_tail_and_exit_status(grid):
    _, _, failing, _ = grid
    assert failing.returncode == 1
    assert "failed" in failing.stderr and "deliberate failure for the tests" in failing.stderr


def test_relaunching_skips_finished_runs(grid):
    _, _, _, again = grid
    assert again.returncode == 0
    assert again.stdout.count(", skipped") == 2 and "0 run(s) to do" in again.stdout


def test_results_table_matches_the_evaluations(grid):
    root = grid[0]
    done = run_python("-m", "cleanrl_utils.tools.results", str(root))
    assert done.returncode == 0, done.stderr
    for algo in ("dqn", "double_dqn"):
        [folder] = root.glob(f"tests.toy_envs_ImageBandit-v0__{algo}__1__*")
        mean = json.loads((folder / "evaluations.json").read_text())[-1]["mean"]
        row = re.search(rf"^\| {algo} \| 1 \| 300 \| (\S+) \+- 0.00 \|", done.stdout, re.M)
        assert row and float(row.group(1)) == pytest.approx(mean, abs=0.005)


def test_plot_writes_png_and_svg(grid, tmp_path):
    pytest.importorskip("matplotlib")
    done = run_python("-m", "cleanrl_utils.tools.plot", str(grid[0]), "--out", str(tmp_path / "curves.png"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "curves.svg").read_bytes()[:1000]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--algos", "dqnn", "--env-ids", "PongNoFrameskip-v4", "--seeds", "1"], "unknown algorithm dqnn"),
        (["--algos", "dqn", "--env-ids", "Pongg-v4", "--seeds", "1"], "--env-id Pongg-v4"),
        (["--algos", "dqn", "--env-ids", "PongNoFrameskip-v4", "--seeds"], "--seeds"),
        (["--algos", "dqn", "--env-ids", "PongNoFrameskip-v4", "--seeds", "1", "--workers", "0"], "--workers"),
    ],
)
def test_launcher_bad_input(args, message, tmp_path):
    done = run_python("-m", "cleanrl_utils.tools.benchmark", *args, "--run-dir", str(tmp_path))
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_ray_unreachable_address_is_a_clear_error(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'value-atari[ray]')")
    args = ["--algos", "dqn", "--env-ids", "PongNoFrameskip-v4", "--seeds", "1", "--ray-address", "127.0.0.1:1"]
    done = run_python("-m", "cleanrl_utils.tools.benchmark", *args, "--run-dir", str(tmp_path), timeout=300)
    assert done.returncode == 2 and "--ray-address 127.0.0.1:1" in done.stderr


def test_interquartile_mean_matches_scipy_trimmed_mean():
    rng = np.random.default_rng(0)
    for n in (4, 5, 10, 17, 40):
        x = rng.normal(size=n) * 3
        assert interquartile_mean(x) == pytest.approx(stats.trim_mean(x, 0.25), abs=1e-12)


def test_stratified_bootstrap_matches_a_plain_loop():
    per_game = [np.array([0.1, 0.5, 0.9]), np.array([1.2, 0.8]), np.array([0.0, 0.3, 0.2, 2.0])]
    low, high = stratified_bootstrap_ci(per_game, reps=300, seed=5)
    rng = np.random.default_rng(5)
    estimates = []
    for _ in range(300):
        sample = []
        for scores in per_game:
            picks = rng.integers(0, len(scores), len(scores))
            sample.extend(float(scores[i]) for i in picks)
        estimates.append(stats.trim_mean(sample, 0.25))
    assert (low, high) == pytest.approx(tuple(np.percentile(estimates, [2.5, 97.5])))
    assert low <= interquartile_mean(np.concatenate(per_game)) <= high


def test_relaunching_resumes_an_interrupted_run_from_its_checkpoint(tmp_path):
    """A run stopped by SIGTERM (pre-emption) is continued by the next launch of the same grid."""
    flags = [
        *TINY,
        "--total-timesteps",
        "600",
        "--checkpoint-every",
        "200",
        "--env-id",
        "tests.toy_envs:ImageBandit-v0",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "true"}
    command = [sys.executable, "algos/dqn.py", *flags, "--run-dir", str(tmp_path)]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not list(tmp_path.glob("*/checkpoints/step_*[0-9]")):
        assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0
    [run_dir] = tmp_path.iterdir()
    assert json.loads((run_dir / "receipt.json").read_text())["status"] == "interrupted"

    args = ["-m", "cleanrl_utils.tools.benchmark", "--algos", "dqn", "--env-ids", "tests.toy_envs:ImageBandit-v0"]
    done = run_python(*args, "--seeds", "1", "--run-dir", str(tmp_path), "--", *TINY, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resuming the unfinished run in {run_dir}" in done.stdout
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["status"] == "finished" and receipt["counts"]["env_steps"] == 600 and len(receipt["resumes"]) == 1
    assert [p.name for p in tmp_path.iterdir() if p.name != "logs"] == [run_dir.name]  # no second run folder


def test_ray_runs_a_tiny_grid_on_a_local_cluster(tmp_path):
    """Each run a Ray task on a real local Ray cluster (``--ray-address local`` starts one, as ray.init())."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'value-atari[ray]')")
    args = ["-m", "cleanrl_utils.tools.benchmark", "--algos", "dqn", "--env-ids", "tests.toy_envs:ImageBandit-v0"]
    args += ["--seeds", "1", "2", "--ray-address", "local", "--run-dir", str(tmp_path)]
    done = run_python(*args, "--", *TINY, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 finished, 0 failed" in done.stdout
    for seed in (1, 2):
        [receipt] = tmp_path.glob(f"tests.toy_envs_ImageBandit-v0__dqn__{seed}__*/receipt.json")
        assert json.loads(receipt.read_text())["status"] == "finished"
        assert (
            "Final eval return" in (tmp_path / "logs" / f"tests.toy_envs_ImageBandit-v0__dqn__{seed}.log").read_text()
        )
