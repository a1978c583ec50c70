"""Helpers shared by the tests that run the algorithm scripts as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_python(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root, importable and non-interactive (CI=true)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "true"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_script(script: str, *args: str, timeout: float = 60, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``algos/<script>.py ARGS --run-dir <tmp_path>/runs``."""
    return run_python(f"algos/{script}.py", *args, "--run-dir", str(tmp_path / "runs"), timeout=timeout)


def run_cases(script: str, cases: list[list[str]], tmp_path: Path, timeout: float = 600) -> list[dict]:
    """Run ``algos/<script>.py`` once per argument list, all in one process (tests/script_cases.py), case i
    with ``--run-dir <tmp_path>/<i>/runs``. Each result: ``status`` (None: not stopped within 60 s), ``stdout``,
    ``stderr`` and ``runs``, the folder that must stay empty."""
    runs = [tmp_path / str(i) / "runs" for i in range(len(cases))]
    (tmp_path / "cases.json").write_text(
        json.dumps([[*c, "--run-dir", str(r)] for c, r in zip(cases, runs, strict=True)])
    )
    out = tmp_path / "results.json"
    done = run_python(
        "tests/script_cases.py", f"algos/{script}.py", str(tmp_path / "cases.json"), str(out), timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [{**result, "runs": r} for result, r in zip(json.loads(out.read_text()), runs, strict=True)]


def assert_stopped_early(result: dict, words: list[str]) -> None:
    """a bad flag: a non-zero exit, a message with these words and no traceback, and no run folder"""
    assert result["status"] not in (0, None), f"{result['argv']} was accepted: {result['stdout'][-1000:]}"
    assert "Traceback" not in result["stderr"], result["stderr"]
    for word in words:
        assert word in result["stderr"], result["stderr"]
    assert not result["runs"].exists() or not any(result["runs"].iterdir())


# ---------------------------------------------------------------- the runs the end-to-end tests read back

# learning fast on the toy tasks of tests/toy_envs.py (their values lie in [0, 1]; optimum 1, random 0.5). One
# torch thread, fixed: torch's CPU kernels sum in an order that depends on the thread count, so the automatic
# choice (which follows the machine's load) would make a run and its resume differ in the last bits
FAST_LEARNING = [
    "--learning-starts", "200", "--buffer-size", "2000", "--train-frequency", "1",
    "--target-network-frequency", "50", "--learning-rate", "5e-4", "--exploration-fraction", "0.5",
    "--eval-every", "0", "--eval-episodes", "20", "--eval-epsilon", "0", "--device", "cpu", "--torch-threads", "1",
]  # fmt: skip
# DelayedImage in 1000 steps, 600 updates (seeds 1, 2 and 3 reach the optimum with every script; see
# tests/test_scripts.py), with a checkpoint at step 900 that the exact-resume test continues from (100 updates and
# two target-network syncs to go)
TOY_RUN = [
    "--env-id", "tests.toy_envs:DelayedImage-v0", "--total-timesteps", "1000", *FAST_LEARNING,
    "--learning-starts", "400", "--checkpoint-every", "900", "--checkpoint-buffer", "--save-model",
]  # fmt: skip
TOY_RUN_OWN = {"iqn": ["--n-tau-samples", "16", "--n-tau-prime-samples", "16", "--n-quantile-samples", "8"]}
# Breakout: 200 steps of learning (50 updates) after 900 of random play, a TRAIN_METRICS line at step 1000, an
# evaluation game at step 1000 and one at the end, and the saved model
BREAKOUT_RUN = [
    "--total-timesteps", "1100", "--learning-starts", "900", "--buffer-size", "2000",
    "--target-network-frequency", "500", "--exploration-fraction", "0.5", "--eval-every", "1000",
    "--eval-episodes", "1", "--eval-epsilon", "0.05", "--save-model", "--device", "cpu",
]  # fmt: skip


class Run(NamedTuple):
    stdout: str
    dir: Path


def _cached_runs(tmp_path_factory, flags_of) -> Callable[[str], Run]:
    """one run per script per session, made on first use: its standard output and its run folder"""
    runs: dict[str, Run] = {}

    def run(script: str) -> Run:
        if script not in runs:
            tmp_path = tmp_path_factory.mktemp(script)
            done = run_script(script, *flags_of(script), timeout=900, tmp_path=tmp_path)
            assert done.returncode == 0, done.stderr[-3000:]
            [run_dir] = (tmp_path / "runs").iterdir()
            runs[script] = Run(done.stdout, run_dir)
        return runs[script]

    return run


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory) -> Callable[[str], Run]:
    """``toy_run(script)``: the script's run of TOY_RUN (DelayedImage, with a checkpoint at step 900)"""
    return _cached_runs(tmp_path_factory, lambda script: [*TOY_RUN, *TOY_RUN_OWN.get(script, [])])


@pytest.fixture(scope="session")
def breakout_run(tmp_path_factory) -> Callable[[str], Run]:
    """``breakout_run(script)``: the script's run of BREAKOUT_RUN"""
    return _cached_runs(tmp_path_factory, lambda script: BREAKOUT_RUN)


def weights(run_dir: Path) -> dict:
    """the network weights of a run's saved model (``--save-model``)"""
    import torch

    [model] = run_dir.glob("*.cleanrl_model")
    return torch.load(model, weights_only=True)["state_dict"]


def mark_interrupted(run_dir: Path) -> None:
    """the run's receipt as a run stopped after its checkpoints says (a finished run refuses a plain --resume)"""
    receipt = json.loads((run_dir / "receipt.json").read_text())
    (run_dir / "receipt.json").write_text(json.dumps({**receipt, "status": "interrupted"}))


def read_json(path: Path):
    return json.loads(path.read_text())


def scalars(run: Path) -> dict[str, list]:
    """every TensorBoard scalar of a run folder, by tag, read back from the event files"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def check_evaluation(entry: dict, episodes: int, n_actions: int, forced_per_game: int = 2 + 3 * 4) -> None:
    """``forced_per_game``: steps the protocol plays for the agent in a whole game, not in the histogram;
    Breakout: FIRE and 2 at the start, NOOP, FIRE and 2 after each of 4 life losses; Pong: FIRE and 2."""
    import numpy as np

    returns = entry["episodic_returns"]
    assert len(returns) == len(entry["episodic_lengths"]) == episodes
    assert entry["mean"] == pytest.approx(np.mean(returns))
    assert entry["std"] == pytest.approx(np.std(returns))
    assert len(entry["action_histogram"]) == n_actions
    pressed = sum(entry["episodic_lengths"]) - episodes * forced_per_game - sum(entry["action_histogram"])
    assert pressed == 0, pressed


# ---------------------------------------------------------------- tiers: `pytest -m "not e2e"` is the unit tier

RUNS_A_PROGRAM = {"run_python", "run_script", "run_cases", "Popen", "subprocess"}


def _is_test_code(value: object) -> bool:
    return callable(value) and str(getattr(value, "__module__", "")).startswith(("test_", "conftest", "toy_envs"))


def _runs_a_program(function: object, seen: set[int], depth: int = 3) -> bool:
    """Whether ``function`` (or a function of the tests it calls, a few calls deep) starts a process: a
    script run end to end, the launcher, a benchmark."""
    code = getattr(function, "__code__", None)
    if code is None or id(code) in seen or depth < 0:
        return False
    seen.add(id(code))
    names = set(code.co_names) | {n for const in code.co_consts if hasattr(const, "co_names") for n in const.co_names}
    if names & RUNS_A_PROGRAM:
        return True
    module_globals = vars(sys.modules[function.__module__])
    return any(
        _runs_a_program(module_globals[name], seen, depth - 1)
        for name in names
        if _is_test_code(module_globals.get(name))
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook, which reads the xdist_group marks set here
def pytest_collection_modifyitems(config, items):
    """Mark ``e2e`` every test that runs a program (directly, through a helper of the tests, or through a
    fixture that does), so that ``pytest -m "not e2e"`` runs the unit tier alone."""
    for item in items:
        functions = [item.function]
        for name in item.fixturenames:
            for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
                functions.append(definition.func)
        seen: set[int] = set()
        if any(_runs_a_program(f, seen) for f in functions):
            item.add_marker(pytest.mark.e2e)
        group = _shared_run_group(item)
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))


def _shared_run_group(item) -> str | None:
    """Under pytest-xdist (`--dist loadgroup`), the tests that read one run go to one worker, so that the run
    is made once: a script's toy and Breakout runs (conftest's session fixtures), or a test module's own
    module- or session-scoped fixture (one group per parameter); the costly ones are session-scoped, so that a
    worker makes each once whatever order it runs its tests in."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if {"toy_run", "breakout_run"} & set(item.fixturenames):
        return "runs of " + str(params.get("script") or item.path.stem.removeprefix("test_"))
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            if definition.scope in ("module", "session") and definition.baseid.endswith(".py"):
                # no "]" in the name: pytest-xdist reads a group only after the nodeid's last "]"
                return f"{item.path.stem} {name} {params.get(name, '')}".rstrip()
    return None
