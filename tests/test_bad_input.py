"""Bad flags stop both scripts early: exit status != 0, a one-line message naming the flag, no
traceback, and no run folder left behind."""

from __future__ import annotations

import pytest
import torch
from conftest import run_script

CUDA = torch.cuda.is_available()
MPS = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def case(*flags: str, words: list[str], skip: bool = False):
    """Flags to pass, the words the error message must contain; ``skip`` where the input is valid here."""
    marks = pytest.mark.skipif(skip, reason="valid on this machine")
    return pytest.param(list(flags), words, id=" ".join(flags), marks=marks)


CASES = [
    case("--env-id", "BreakoutNoFrameskp-v4", words=["--env-id", "BreakoutNoFrameskip-v4"]),
    case("--env-id", "ALE/Breakout-v5", words=["--env-id", "BreakoutNoFrameskip-v4"]),
    case("--env-id", "CartPole-v1", words=["--env-id"]),
    case("--buffer-size", "100", "--batch-size", "256", words=["--buffer-size"]),
    case("--buffer-size", "5", "--batch-size", "5", "--learning-starts", "5", words=["--buffer-size"]),
    case("--num-envs", "8", "--buffer-size", "40", "--learning-starts", "32", words=["--buffer-size", "64"]),
    case("--learning-starts", "10", words=["--learning-starts"]),
    case("--total-timesteps", "0", words=["--total-timesteps"]),
    case("--total-timesteps", "-5", words=["--total-timesteps"]),
    case("--train-frequency", "0", words=["--train-frequency"]),
    case("--target-network-frequency", "-1", words=["--target-network-frequency"]),
    case("--num-envs", "0", words=["--num-envs"]),
    case("--batch-size", "0", words=["--batch-size"]),
    case("--gamma", "0", words=["--gamma"]),
    case("--gamma", "1.5", words=["--gamma"]),
    case("--start-e", "1.5", words=["--start-e"]),
    case("--end-e", "-0.1", words=["--end-e"]),
    case("--start-e", "0.01", "--end-e", "0.5", words=["--start-e"]),
    case("--learning-rate", "0", words=["--learning-rate"]),
    case("--learning-rate", "-1e-4", words=["--learning-rate"]),
    case("--eval-epsilon", "2", words=["--eval-epsilon"]),
    case("--device", "cuda", words=["--device cuda"], skip=CUDA),
    case("--device", "mps", words=["--device mps"], skip=MPS),
    case("--buffer-size", "100000000000", words=["--buffer-size", "GiB"]),
    case("--checkpoint-every", "-1", words=["--checkpoint-every"]),
    case("--checkpoint-keep", "0", words=["--checkpoint-keep"]),
    case("--resume", "runs/no_such_run", words=["--resume", "no such run folder"]),
    case("--on-nonfinite", "ignore", words=["--on-nonfinite"]),
    case("--device", "cpu", "--buffer-device", "cuda", words=["--buffer-device cuda", "--device cuda"]),
]


@pytest.mark.parametrize("script", ["dqn", "double_dqn"])
@pytest.mark.parametrize(("flags", "words"), CASES)
def test_bad_flag_stops_early_with_a_message(script, flags, words, tmp_path):
    done = run_script(script, *flags, timeout=60, tmp_path=tmp_path)
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir())
