"""Bad flags stop every script early: exit status != 0, a one-line message naming the flag, no traceback, and no
run folder left behind. The common flags are tried on dqn.py and double_dqn.py, each script's own flags on that
script, and the Rainbow flags on the plain scripts that no longer have them.

Each script's cases run in one process (tests/script_cases.py runs the script's own code once per command line),
so that a case costs its check, not an interpreter start and a torch import."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_stopped_early, run_cases, run_python

CUDA = torch.cuda.is_available()
MPS = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def case(*flags: str, words: list[str], skip: bool = False):
    """Flags to pass, the words the error message must contain; ``skip`` where the input is valid here."""
    return flags, words, skip


COMMON = [
    case("--env-id", "BreakoutNoFrameskp-v4", words=["--env-id", "BreakoutNoFrameskip-v4"]),
    case("--env-id", "ALE/Breakout-v5", words=["--env-id", "BreakoutNoFrameskip-v4"]),
    case("--env-id", "CartPole-v1", words=["--env-id"]),
    case("--buffer-size", "100", "--batch-size", "256", words=["--buffer-size"]),
    case("--buffer-size", "5", "--batch-size", "5", "--learning-starts", "5", words=["--buffer-size"]),
    case("--num-envs", "8", "--buffer-size", "40", "--learning-starts", "32", words=["--buffer-size", "48"]),
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
    case("--cuda", "False", words=["--cuda", "CleanRL", "--device cpu"]),
    case("--cuda", "True", words=["--cuda", "--device cuda"]),
    case("--upload-model", words=["--upload-model", "--save-model"]),
    case("--buffer-size", "100000000000", words=["--buffer-size", "GiB"]),
    case("--checkpoint-every", "-1", words=["--checkpoint-every"]),
    case("--checkpoint-keep", "0", words=["--checkpoint-keep"]),
    case("--resume", "runs/no_such_run", words=["--resume", "no such run folder"]),
    case("--on-nonfinite", "ignore", words=["--on-nonfinite"]),
    case("--device", "cpu", "--buffer-device", "cuda", words=["--buffer-device cuda", "--device cuda"]),
]

OWN = {  # each script's own flags
    "c51": [
        case("--n-atoms", "1", words=["--n-atoms 1", "at least 2"]),
        case("--n-atoms", "0", words=["--n-atoms 0"]),
        case("--v-min", "10", "--v-max", "-10", words=["--v-min 10.0", "--v-max -10.0", "below"]),
        case("--v-min", "3", "--v-max", "3", words=["--v-min 3.0", "--v-max 3.0"]),
        case("--v-max", "inf", words=["--v-max inf", "finite"]),
        case("--v-min", "nan", words=["--v-min nan"]),
    ],
    "qrdqn": [
        case("--n-quantiles", "0", words=["--n-quantiles 0", "positive"]),
        case("--n-quantiles", "-3", words=["--n-quantiles -3"]),
        case("--kappa", "0", words=["--kappa 0.0", "> 0"]),
        case("--kappa", "-1", words=["--kappa -1.0"]),
        case("--kappa", "nan", words=["--kappa nan"]),
    ],
    "iqn": [
        case("--n-tau-samples", "0", words=["--n-tau-samples 0", "positive", "64"]),
        case("--n-quantile-samples", "-1", words=["--n-quantile-samples -1", "32"]),
        case("--kappa", "0", words=["--kappa 0.0", "> 0"]),
    ],
    "mdqn": [
        case("--m-tau", "0", words=["--m-tau", "> 0"]),
        case("--m-tau", "-0.03", words=["--m-tau"]),
        case("--m-alpha", "1.5", words=["--m-alpha", "[0, 1]"]),
        case("--m-alpha", "-0.1", words=["--m-alpha"]),
        case("--m-alpha", "nan", words=["--m-alpha"]),
        case("--m-l0", "0", words=["--m-l0", "< 0"]),
        case("--m-l0", "0.5", words=["--m-l0"]),
        case("--adam-eps", "0", words=["--adam-eps"]),
    ],
    "nc_qrdqn": [
        case("--n-quantiles", "0", words=["--n-quantiles", ">= 2"]),
        case("--n-quantiles", "1", words=["--n-quantiles"]),
        case("--n-quantiles", "-5", words=["--n-quantiles"]),
        case("--kappa", "0", words=["--kappa", "> 0"]),
        case("--kappa", "-1", words=["--kappa"]),
        case("--adam-eps", "-1e-4", words=["--adam-eps"]),
    ],
    "rainbow": [
        case("--n-step", "0", words=["--n-step 0", "positive"]),
        case("--prioritized-alpha", "-1", words=["--prioritized-alpha -1.0", ">= 0"]),
        case("--prioritized-beta", "1.5", words=["--prioritized-beta 1.5", "[0, 1]"]),
        case("--prioritized-beta-end", "-0.1", words=["--prioritized-beta-end -0.1", "[0, 1]"]),
        case("--prioritized-eps", "0", words=["--prioritized-eps 0.0", "> 0"]),
        case("--adam-eps", "0", words=["--adam-eps 0.0", "> 0", "default: 0.00015"]),
        case("--noisy-sigma", "nan", words=["--noisy-sigma nan"]),
        case("--n-step", "70", "--buffer-size", "64", "--learning-starts", "32", words=["--n-step 70", "--buffer-size 64", "75"]),
        # with one component switched off
        case("--no-noisy", "--start-e", "0.1", "--end-e", "0.5", words=["--start-e 0.1", "--end-e 0.5"]),
        case("--no-prioritized", "--n-step", "70", "--buffer-size", "64", "--learning-starts", "32", words=["--n-step 70", "--buffer-size 64", "75"]),
    ],
    "custom_value_atari": [
        case("--adam-eps", "0", words=["--adam-eps 0.0", "> 0", "default: 1e-08"]),
    ],
    "drq": [
        case("--n-step", "0", words=["--n-step 0", "positive"]),
        case("--augmentation-pad", "-1", words=["--augmentation-pad -1", ">= 0"]),
        case("--intensity-scale", "0.5", words=["--intensity-scale 0.5", "[0, 0.5)"]),
        case("--adam-eps", "0", words=["--adam-eps 0.0", "default: 0.00015"]),
        case("--n-step", "70", "--buffer-size", "64", "--learning-starts", "32", words=["--n-step 70", "--buffer-size 64", "75"]),
    ],
    "pqn": [
        case("--num-steps", "0", words=["--num-steps 0", "positive"]),
        case("--num-minibatches", "3", words=["--num-minibatches 3", "1024", "divisor"]),
        case("--num-minibatches", "0", words=["--num-minibatches 0", "positive"]),
        case("--update-epochs", "-1", words=["--update-epochs -1"]),
        case("--q-lambda", "1.5", words=["--q-lambda 1.5", "[0, 1]"]),
        case("--q-lambda", "-0.1", words=["--q-lambda -0.1"]),
        case("--max-grad-norm", "0", words=["--max-grad-norm 0.0", "> 0"]),
        case("--gamma", "1.5", words=["--gamma"]),
        case("--num-envs", "0", words=["--num-envs"]),
        case("--total-timesteps", "0", words=["--total-timesteps"]),
        case("--env-id", "ALE/Breakout-v5", words=["--env-id", "BreakoutNoFrameskip-v4"]),
        case("--buffer-device", "cuda", words=["--buffer-device", "pqn.py has none"]),
        case("--compress-replay", words=["--compress-replay", "pqn.py has none"]),
        case("--resume", "runs/no_such_run", words=["--resume", "no such run folder"]),
    ],
}  # fmt: skip
# PQN has no replay memory, target network or Adam eps: tyro refuses those flags
REMOVED_FROM_PQN = [["--buffer-size", "1000"], ["--learning-starts", "100"], ["--target-network-frequency", "5"]]
# the plain scripts refuse Rainbow's flags (tyro names the flag)
REMOVED = [("dqn", ["--n-step", "3"]), ("double_dqn", ["--prioritized"]), ("c51", ["--noisy"])]
REMOVED += [("pqn", flags) for flags in REMOVED_FROM_PQN]

TABLE = [(script, *c) for script in ("dqn", "double_dqn") for c in COMMON]
TABLE += [(script, *c) for script, cases in OWN.items() for c in cases]
TABLE += [(script, tuple(flags), [flags[0]], False) for script, flags in REMOVED]


@pytest.fixture(scope="session")  # made once (tests/conftest.py's _shared_run_group)
def stopped(tmp_path_factory):
    """the result of one case, run with the rest of its script's cases on first use"""
    results: dict[str, dict] = {}

    def result(script: str, flags: tuple[str, ...]) -> dict:
        if script not in results:
            cases = [list(f) for s, f, _, skip in TABLE if s == script and not skip]
            found = run_cases(script, cases, tmp_path_factory.mktemp(script))
            results[script] = {tuple(c): r for c, r in zip(cases, found, strict=True)}
        return results[script][flags]

    return result


@pytest.mark.parametrize(
    ("script", "flags", "words"),
    [
        pytest.param(s, f, w, id=f"{s} {' '.join(f)}", marks=pytest.mark.skipif(skip, reason="valid on this machine"))
        for s, f, w, skip in TABLE
    ],
)
def test_bad_flag_stops_early_with_a_message(script, flags, words, stopped):
    result = stopped(script, flags)
    if (script, list(flags)) in REMOVED:  # tyro's message
        result = {**result, "stderr": result["stderr"] + result["stdout"]}
    assert_stopped_early(result, words)


def test_the_one_process_runner_reports_an_accepted_command_line_and_a_crash(tmp_path):
    """tests/script_cases.py: good flags are reported as accepted (status None) once the script has run for
    --seconds, a crash keeps its traceback, and the next case still starts afresh"""
    good = [
        "--env-id",
        "tests.toy_envs:ImageBandit-v0",
        "--total-timesteps",
        "100000000",
        "--buffer-size",
        "1000",
        "--device",
        "cpu",
    ]
    crash = [
        "--env-id",
        "tests.toy_envs:CrashingBandit-v0",
        "--learning-starts",
        "32",
        "--buffer-size",
        "1000",
        "--device",
        "cpu",
    ]
    cases = [good, crash, ["--gamma", "2"]]
    (tmp_path / "cases.json").write_text(json.dumps([[*c, "--run-dir", str(tmp_path / "runs")] for c in cases]))
    done = run_python(
        "tests/script_cases.py",
        "algos/dqn.py",
        str(tmp_path / "cases.json"),
        str(tmp_path / "out.json"),
        "--seconds",
        "20",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    accepted, crashed, refused = json.loads((tmp_path / "out.json").read_text())
    assert accepted["status"] is None and "torch threads" in accepted["stdout"]
    assert crashed["status"] == 1 and "Traceback" in crashed["stderr"]
    assert refused["status"] == 2 and "--gamma 2.0" in refused["stderr"] and "Traceback" not in refused["stderr"]
