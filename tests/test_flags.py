"""The command line (issue 59): ``--help`` of every script lists the script's own flags (``--exp-name``, ``--seed``,
``--env-id``, ...) first and the run flags (``RunFlags``) after them as their own group, each under its own name;
CleanRL's retired flags are not listed but still answered; ``args`` stays one flat ``Args``; and what earlier
versions wrote (their checkpoints store the arguments with the run flags first and the retired flags in them) still
resumes and plays.

``tests/data/dqn_run_before_issue59.tar.gz`` is a run folder written by the code before this change (git 66923c3,
``--save-model``), from a clone of the repository at that revision:

    python algos/dqn.py --env-id tests.toy_envs:DelayedImage-v0 --total-timesteps 1000 --learning-starts 400 \\
        --buffer-size 2000 --train-frequency 4 --target-network-frequency 50 --learning-rate 5e-4 \\
        --exploration-fraction 0.5 --eval-every 0 --eval-episodes 4 --eval-epsilon 0 --device cpu \\
        --torch-threads 1 --checkpoint-every 1000 --checkpoint-keep 1 --save-model --run-dir runs

as it wrote it, but for the values of the networks' weights and Adam's moments (in the checkpoint and the model),
set to zeros of the same shapes and dtypes so that the file packs to 80 KB instead of 34 MB; every key, shape,
dtype, setting and replay segment is the old code's.
"""

from __future__ import annotations

import dataclasses
import json
import re
import runpy
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_python

from cleanrl_utils.run import RETIRED_FLAGS, RunFlags, parse_args
from cleanrl_utils.tools.evaluate import load_algorithm

SCRIPTS = sorted(p.stem for p in (REPO / "algos").glob("*.py"))
RUN_FLAGS = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(RunFlags)]
OLD_RUN = REPO / "tests" / "data" / "dqn_run_before_issue59.tar.gz"


def script_module(script: str, monkeypatch) -> object:
    """``algos/<script>.py`` imported (its main block not run), where tyro finds its source for the help texts"""
    module = load_algorithm(REPO / "algos" / f"{script}.py")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def flag_at(text: str, flag: str) -> int:
    """where ``flag`` is first listed in a help text (-1: not listed)"""
    found = re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
    return found.start() if found else -1


def help_text(script: str, columns: int, monkeypatch, capsys) -> str:
    """``python algos/<script>.py --help`` as a user's terminal of that width shows it (in this process)"""
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr(sys, "argv", [f"algos/{script}.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / "algos" / f"{script}.py"), run_name="__main__")
    assert stop.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("columns", [80, 250])
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_the_algorithms_flags_first_then_the_run_flags_and_no_retired_flag(
    script, columns, monkeypatch, capsys
):
    text = help_text(script, columns, monkeypatch, capsys)
    run_flags = [flag_at(text, flag) for flag in RUN_FLAGS]
    assert -1 not in run_flags, [f for f, at in zip(RUN_FLAGS, run_flags, strict=True) if at < 0]
    group = text.find("run options")  # tyro's group of the nested RunFlags
    assert group >= 0, text
    first = ["--exp-name", "--seed", "--env-id"]
    assert all(0 <= flag_at(text, flag) < group for flag in first), text
    assert group < min(run_flags), text
    own = {
        f"--{f.name.replace('_', '-')}"
        for f in dataclasses.fields(load_algorithm(REPO / "algos" / f"{script}.py").Args)
    }
    assert all(0 <= flag_at(text, flag) < group for flag in own - set(RUN_FLAGS)), text
    assert [flag for flag in RETIRED_FLAGS if flag_at(text, flag) >= 0] == [], text
    assert "--run." not in text, text  # no prefix


def test_the_flags_keep_their_names_and_args_stay_one_flat_args(monkeypatch):
    dqn = script_module("dqn", monkeypatch)
    argv = ["--checkpoint-every", "5", "--no-checkpoint-buffer", "--seed", "3", "--run-dir", "elsewhere"]
    args = parse_args(dqn.Args, [*argv, "--env-id", "tests.toy_envs:DelayedImage-v0"])
    expected = dqn.Args(checkpoint_every=5, checkpoint_buffer=False, seed=3, run_dir="elsewhere")
    assert args == dataclasses.replace(expected, env_id="tests.toy_envs:DelayedImage-v0")
    assert type(args) is dqn.Args and args.checkpoint_every == 5  # as run.py and the scripts read it
    assert list(vars(args)) == [f.name for f in dataclasses.fields(dqn.Args)]  # what receipts and checkpoints store
    assert parse_args(dqn.Args, []) == dqn.Args()
    with pytest.raises(SystemExit):
        parse_args(dqn.Args, ["--run.checkpoint-every", "5"])


@pytest.mark.parametrize(
    ("argv", "answer"),
    [
        (["--cuda", "False"], "--cuda is CleanRL's flag; here --device picks the device: --device cpu"),
        (["--seed", "2", "--cuda=True"], "--cuda is CleanRL's flag; here --device picks the device: --device cuda"),
        (["--upload-model"], "--upload-model is CleanRL's flag; CleanRL's Hugging Face upload is not kept here"),
        (["--hf_entity", "me"], "--hf-entity is CleanRL's flag; CleanRL's Hugging Face upload is not kept here"),
    ],
)
def test_a_retired_flag_is_answered_with_the_flag_to_use(argv, answer, capsys, monkeypatch):
    dqn = script_module("dqn", monkeypatch)
    with pytest.raises(SystemExit) as stop:
        parse_args(dqn.Args, argv)
    assert stop.value.code == 2
    message = capsys.readouterr().err
    assert answer in message and ("--save-model" in message or "--device" in message), message


@pytest.fixture
def old_run(tmp_path) -> Path:
    """the run folder the code before issue 59 wrote (see the module's docstring), unpacked"""
    with tarfile.open(OLD_RUN) as packed:
        packed.extractall(tmp_path, filter="data")
    [run] = tmp_path.iterdir()
    return run


def test_a_model_saved_before_issue_59_plays(old_run):
    model = old_run / "dqn.cleanrl_model"
    saved = torch.load(model, weights_only=True)
    assert not Path(saved["algo_script"]).exists()  # so the evaluation loads this repository's algos/dqn.py
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(model), "--episodes", "3", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert (result["algo"], len(result["episodic_returns"])) == ("dqn", 3), result


def test_a_checkpoint_written_before_issue_59_resumes(old_run):
    [checkpoint] = (old_run / "checkpoints").glob("step_*")
    old_args = torch.load(checkpoint / "state.pt", weights_only=True)["args"]
    old_layout = [f.name for f in dataclasses.fields(RunFlags) if f.name != "compress_replay"]  # issue 58 added it
    assert list(old_args)[: len(old_layout)] == old_layout  # the old layout:
    assert {"cuda", "upload_model", "hf_entity"} <= set(old_args)  # run flags first, the retired ones among them
    done = run_python("algos/dqn.py", "--resume", str(old_run), "--total-timesteps", "1100", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    receipt = json.loads((old_run / "receipt.json").read_text())
    assert receipt["status"] == "finished" and receipt["counts"]["env_steps"] == 1100, receipt
    [resume] = receipt["resumes"]
    assert (resume["step"], resume["buffer_restored"], resume["extended"]) == (1000, True, {"from": 1000, "to": 1100})
    args = receipt["args"]  # one flat table: the run's own settings, extended, without the retired flags
    assert all(not isinstance(v, (dict, list)) for v in args.values()), args
    kept = {k: v for k, v in old_args.items() if k not in ("cuda", "upload_model", "hf_entity")}
    fraction = old_args["exploration_fraction"] * 1000 / 1100  # epsilon's end step kept
    added = {"compress_replay": False}  # a flag added since (issue 58), at its default
    assert args == {**kept, **added, "resume": str(old_run), "total_timesteps": 1100, "exploration_fraction": fraction}
    assert receipt["replay_memory"]["frames"] == "host, raw"
