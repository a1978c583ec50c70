"""Helpers shared by the tests that run the algorithm scripts as a user would."""

from __future__ import annotations

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
