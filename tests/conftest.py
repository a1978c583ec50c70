"""Helpers shared by the tests that run the algorithm scripts as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def pytest_collection_modifyitems(config, items):
    """Mark ``e2e`` every test that runs a program (directly, through a helper of the tests, or through a
    fixture that does), so that ``pytest -m "not e2e"`` runs the unit tier alone."""
    import pytest

    for item in items:
        functions = [item.function]
        for name in item.fixturenames:
            for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
                functions.append(definition.func)
        seen: set[int] = set()
        if any(_runs_a_program(f, seen) for f in functions):
            item.add_marker(pytest.mark.e2e)
