"""DQN and Double DQN learn the small visual tasks of tests/toy_envs.py in about a minute.

The checks fail on broken learning: a wrong sign drives the greedy policy to the wrong action
(evaluation return), and a missing ``1 - done`` lets the values of terminal transitions grow
without bound (the logged Q-values, whose true mean lies between 0 and 1 on these tasks).
"""

import json
import re
from pathlib import Path

import pytest
from conftest import REPO, run_python

FAST_LEARNING = [
    "--learning-starts", "200", "--buffer-size", "2000", "--train-frequency", "1",
    "--target-network-frequency", "50", "--learning-rate", "5e-4", "--exploration-fraction", "0.5",
    "--eval-every", "0", "--eval-episodes", "20", "--eval-epsilon", "0", "--device", "cpu",
]  # fmt: skip
TASKS = {"ImageBandit-v0": 1200, "DelayedImage-v0": 2000}  # env id: agent steps
# CI runs the harder task only (it needs bootstrapping; the easy one does not); `-m slow` runs both.
TASK_PARAMS = [pytest.param("ImageBandit-v0", marks=pytest.mark.slow), "DelayedImage-v0"]


def train(script: Path, task: str, tmp_path: Path) -> tuple[float, float]:
    """Run a script on a toy task; return its final evaluation mean and last logged Q-value."""
    command = [str(script), "--env-id", f"tests.toy_envs:{task}", "--total-timesteps", str(TASKS[task])]
    done = run_python(*command, "--run-dir", str(tmp_path), *FAST_LEARNING, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    q_values = [float(v) for v in re.findall(r"^TRAIN_METRICS .* q_values=(\S+)", done.stdout, re.M)]
    [run_dir] = tmp_path.iterdir()
    evaluations = json.loads((run_dir / "evaluations.json").read_text())
    return evaluations[-1]["mean"], q_values[-1]


@pytest.mark.parametrize("task", TASK_PARAMS)
@pytest.mark.parametrize("algo", ["dqn", "double_dqn"])
def test_reaches_optimal_return_with_sane_values(algo, task, tmp_path):
    mean, q_value = train(REPO / "algos" / f"{algo}.py", task, tmp_path)
    assert mean >= 0.95, f"{algo} on {task}: evaluation mean {mean}, optimum 1, random 0.5"
    assert 0.0 < q_value < 1.3, f"{algo} on {task}: mean Q {q_value}, true values lie in [0, 1]"


@pytest.mark.parametrize(
    "bug,original,planted",
    [
        ("missing 1 - done", " * (1 - data.dones)", ""),
        ("wrong sign", "loss = F.mse_loss(td_target, old_val)", "loss = F.mse_loss(-td_target, old_val)"),
    ],
)
def test_the_learning_check_catches_a_planted_bug(bug, original, planted, tmp_path):
    source = (REPO / "algos" / "dqn.py").read_text()
    assert original in source
    broken = tmp_path / "broken_dqn.py"
    broken.write_text(source.replace(original, planted))
    runs = tmp_path / "runs"
    runs.mkdir()
    mean, q_value = train(broken, "ImageBandit-v0", runs)
    assert not (mean >= 0.95 and 0.0 < q_value < 1.3), f"{bug} went unnoticed"
