"""Progress that tells the truth (issue 15): steps/s and the time left from the recent rate, a run that never
learns says so, a closed standard output, signals during the final evaluation, the evaluation command.
Real runs of the scripts (subprocesses), real run folders and TensorBoard files; no mocks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, mark_interrupted, run_python
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cleanrl_utils.record import Record
from cleanrl_utils.tools.evaluate import load_algorithm

BANDIT = "tests.toy_envs:ImageBandit-v0"
TINY = ["--env-id", BANDIT, "--buffer-size", "500", "--learning-starts", "100", "--eval-episodes", "2"]
TINY += ["--device", "cpu"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "CI": "true"}
SCRIPTS = sorted((REPO / "algos").glob("*.py"))


def make_run(tmp_path: Path) -> Record:
    args = load_algorithm(REPO / "algos" / "dqn.py").Args(env_id=BANDIT, run_dir=str(tmp_path))
    return Record(args, str(REPO / "algos" / "dqn.py"), torch.device("cpu"))


# ---------------------------------------------------------------- steps/s and the time left


def test_steps_per_second_is_the_last_minutes_rate_not_the_average(tmp_path):
    run = make_run(tmp_path)
    run.start_rate(0, now=1000.0)
    for t in range(1, 601):  # ten minutes at 1,000 steps/s
        run.recent_sps(1000 * t, now=1000.0 + t)
    for t in range(1, 121):  # then two minutes at 10 steps/s
        sps = run.recent_sps(600_000 + 10 * t, now=1600.0 + t)
    assert sps == pytest.approx(10, rel=0.05)  # the average since the start would be about 835
    run.close()


def test_after_a_resume_only_this_processs_steps_count(tmp_path):
    run = make_run(tmp_path)
    run.start_rate(5_000_000, now=0.0)  # resumed at step 5M: the earlier process's steps are not this one's
    assert run.recent_sps(5_002_000, now=100.0) == pytest.approx(20.0)
    run.close()


def test_the_time_left_comes_from_the_rate_given(tmp_path, capsys):
    run = make_run(tmp_path)
    run.interactive = False
    run.last_progress_print = 0.0
    run.show_progress(400_000, 1_000_000, sps=50.0)
    assert "progress step=400000/1000000 (40.0%) sps=50 last_return=None eta=3.3h" in capsys.readouterr().out
    run.interactive = True  # the terminal's bar: the same rate and time left, counted from the step it starts at
    run.show_progress(400_000, 1_000_000, sps=1000.0)
    run.progress.refresh()
    assert "sps=1000, eta=10.0min" in capsys.readouterr().err
    assert run.progress.n == 400_000 and run.progress.format_dict["initial"] == 400_000
    run.close()


def test_every_script_logs_the_recent_rate():
    """the rate is the run's (run.py's log_step, which every script reaches through run.step or run.log_step)"""
    run_py = (REPO / "cleanrl_utils" / "run.py").read_text()
    assert run_py.count("sps = record.recent_sps(global_step)") == 1
    for script in SCRIPTS:
        source = script.read_text()
        assert "run.step(global_step" in source or "run.log_step(global_step" in source, script.name
        assert "start_time" not in source, script.name  # CleanRL's global_step / (time.time() - start_time)


def test_a_resumed_run_logs_its_own_rate_not_one_diluted_by_the_earlier_process(tmp_path):
    """The checkpoint says the earlier process trained for 11 days (a slow machine, or a long pause): the
    resumed process's steps/s is its own, not 1,100 steps over 11 days (0 in the old formula)."""
    # learning from step 1200 only: the rates, not the updates, are under test
    flags = [*TINY, "--total-timesteps", "1500", "--learning-starts", "1200", "--checkpoint-every", "1000"]
    flags += ["--eval-every", "0"]
    first = run_python("algos/dqn.py", *flags, "--run-dir", str(tmp_path), timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    [run_dir] = tmp_path.iterdir()
    checkpoint = run_dir / "checkpoints" / "step_000000001000"
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    state["run"]["wall_seconds"] = 1e6
    torch.save(state, checkpoint / "state.pt")
    mark_interrupted(run_dir)
    again = run_python("algos/dqn.py", "--resume", str(checkpoint), timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    resumed = [e.value for e in events.Scalars("charts/SPS") if e.step > 1000]
    assert len(resumed) == 5 and min(resumed) >= 5, resumed


# ---------------------------------------------------------------- torch's threads under load


def test_torch_threads_fixed_by_the_flag_are_printed_and_kept_in_the_receipt(tmp_path):
    done = run_python("algos/qrdqn.py", *TINY, "--total-timesteps", "300", "--torch-threads", "1",
                      "--run-dir", str(tmp_path), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch threads: 1 (--torch-threads)" in done.stdout
    [run_dir] = tmp_path.iterdir()
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["args"]["torch_threads"] == 1 and receipt["hardware"]["torch_threads"] == 1


def test_automatic_threads_are_the_default_and_printed(tmp_path):
    done = run_python("algos/dqn.py", *TINY, "--total-timesteps", "300", "--run-dir", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"torch threads: \d+ \(automatic: fewer while other processes use", done.stdout)
    [run_dir] = tmp_path.iterdir()
    assert json.loads((run_dir / "receipt.json").read_text())["args"]["torch_threads"] == 0


def test_negative_torch_threads_is_refused_before_anything_is_written(tmp_path):
    done = run_python("algos/c51.py", *TINY, "--torch-threads", "-2", "--run-dir", str(tmp_path), timeout=120)
    assert done.returncode == 2 and "--torch-threads -2 must be >= 0" in done.stderr
    assert not any(tmp_path.iterdir())


def test_every_script_chooses_its_threads_and_rereads_them_in_the_loop():
    """the run chooses them at its start and re-reads them every 100 steps (run.py); every script starts a run"""
    run_py = (REPO / "cleanrl_utils" / "run.py").read_text()
    assert "self.threads = CpuThreads(args.torch_threads)" in run_py
    assert run_py.count("torch.set_num_threads(self.threads.choose())") == 2
    for script in SCRIPTS:
        assert "run = Run(args, __file__" in script.read_text(), script.name


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to leave one to another process")
def test_automatic_threads_give_a_core_back_while_another_process_holds_it():
    """A busy process (as ``python3 -c "while True: pass"``) takes a core: the automatic choice drops to
    fewer threads than torch's default once it has seen an interval of it, and a fixed choice does not."""
    from cleanrl_utils.checks import CpuThreads

    default = torch.get_num_threads()
    torch.set_num_threads(2)  # as on a 2-core machine, whatever this one has
    try:
        automatic, fixed = CpuThreads(0, interval_s=1.5), CpuThreads(2, interval_s=1.5)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(2.0)  # one interval (1.5 s) with the other process on a core
            assert automatic.choose() == 1, automatic.others
            assert automatic.others > 0.5
            assert fixed.choose() == 2
        finally:
            busy.kill()
            busy.wait()
    finally:
        torch.set_num_threads(default)


# ---------------------------------------------------------------- a run that never learns says so


def test_a_run_that_never_updates_warns_at_start_and_still_runs(tmp_path):
    flags = ["--env-id", BANDIT, "--buffer-size", "500", "--eval-episodes", "2", "--device", "cpu"]
    for total, learning_starts, reason in (
        ("300", "300", "is at or above"),
        ("302", "300", "leaves no update before --total-timesteps 302 (one every --train-frequency 4"),
    ):
        done = run_python("algos/double_dqn.py", *flags, "--total-timesteps", total, "--learning-starts",
                          learning_starts, "--run-dir", str(tmp_path / total), timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        warning = f"warning: --learning-starts {learning_starts} {reason}"
        assert warning in done.stderr and "the network is never updated" in done.stderr, done.stderr
        assert "random-agent baseline" in done.stderr and done.stderr.count("never updated") == 1
        [run_dir] = (tmp_path / total).iterdir()
        receipt = json.loads((run_dir / "receipt.json").read_text())
        assert receipt["status"] == "finished" and receipt["counts"]["gradient_updates"] == 0
    # step 300, a multiple of --train-frequency 4, after --learning-starts 297: one update, no warning
    learning = run_python("algos/double_dqn.py", *flags, "--total-timesteps", "300", "--learning-starts", "297",
                          "--run-dir", str(tmp_path / "297"), timeout=300)  # fmt: skip
    assert learning.returncode == 0 and "never updated" not in learning.stderr
    [run_dir] = (tmp_path / "297").iterdir()
    assert json.loads((run_dir / "receipt.json").read_text())["counts"]["gradient_updates"] == 1


# ---------------------------------------------------------------- a closed standard output


def test_a_closed_standard_output_stops_printing_and_the_run_finishes(tmp_path):
    """``python algos/dqn.py ... | head -3``: the reader takes three lines and goes; no traceback, the run goes on
    to its end, and the receipt says when standard output closed."""
    flags = [*TINY, "--total-timesteps", "600", "--eval-every", "300", "--run-dir", str(tmp_path / "runs")]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "algos/dqn.py", *flags], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=stderr
        )
        lines = [process.stdout.readline() for _ in range(3)]  # what `head -3` does
        process.stdout.close()
        assert process.wait(timeout=300) == 0
    err = (tmp_path / "stderr.txt").read_text()
    assert lines[0].startswith(b"torch threads: ") and lines[1] == b"device: cpu\n", lines
    assert lines[2].startswith(b"global_step="), lines
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    [run_dir] = (tmp_path / "runs").iterdir()
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["status"] == "finished" and receipt["counts"]["env_steps"] == 600
    closed_at = receipt["stdout_closed_at_step"]
    assert 2 <= closed_at <= 600
    assert f"standard output was closed by its reader (e.g. `| head`) at step {closed_at}" in err
    assert [e["step"] for e in json.loads((run_dir / "evaluations.json").read_text())] == [300, 600]


# ---------------------------------------------------------------- signals during the final evaluation

PONG = ["--env-id", "PongNoFrameskip-v4", "--total-timesteps", "300", "--learning-starts", "300", "--buffer-size"]
PONG += ["500", "--eval-episodes", "4", "--eval-epsilon", "1", "--device", "cpu", "--save-model"]


def start_pong_and_wait_for_the_final_evaluation(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """Pong's final evaluation (4 random games, about 800 steps each) takes seconds: long enough to signal."""
    stderr = tmp_path / "stderr.txt"
    command = [sys.executable, "algos/dqn.py", *PONG, "--run-dir", str(tmp_path / "runs")]
    process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True)
    for line in process.stdout:
        if line.startswith("training done at step 300; final evaluation of 4 games"):
            return process, stderr
    raise AssertionError(f"no 'training done' line; stderr: {stderr.read_text()[-2000:]}")


def test_sigterm_during_the_final_evaluation_says_what_really_happens(tmp_path):
    process, stderr = start_pong_and_wait_for_the_final_evaluation(tmp_path)
    process.send_signal(signal.SIGTERM)
    out = process.stdout.read()
    assert process.wait(timeout=300) == 0
    err = stderr.read_text()
    said = "SIGTERM: training is done (step 300); the final evaluation goes on to its end and the model is saved, "
    assert said + "then the run ends as finished; no other checkpoint than the end of training's" in err, err
    assert "writing a checkpoint" not in err
    [run_dir] = (tmp_path / "runs").iterdir()
    assert "Final eval return:" in out and (run_dir / "dqn.cleanrl_model").exists()  # as said
    assert json.loads((run_dir / "receipt.json").read_text())["status"] == "finished"
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_000000000300"]  # the end's only


def test_a_second_sigterm_during_the_final_evaluation_ends_the_process_at_once(tmp_path):
    """the first signal gives both signals back their default action: the second ends the process by that signal
    itself (no Python code runs, so the receipt is left as the last write made it, "running")"""
    process, stderr = start_pong_and_wait_for_the_final_evaluation(tmp_path)
    process.send_signal(signal.SIGTERM)
    while "SIGTERM: training is done" not in stderr.read_text():
        assert process.poll() is None, stderr.read_text()
    process.send_signal(signal.SIGTERM)
    out = process.stdout.read()
    assert process.wait(timeout=300) == -signal.SIGTERM
    assert "(signal again to exit at once, without the final evaluation)" in stderr.read_text()
    [run_dir] = (tmp_path / "runs").iterdir()
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["status"] == "running" and receipt["final_eval_return"] is None
    assert "Final eval return:" not in out and not (run_dir / "dqn.cleanrl_model").exists()


# ---------------------------------------------------------------- the evaluation command


@pytest.fixture(scope="session")  # made once (tests/conftest.py's _shared_run_group)
def saved_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("model")
    done = run_python("algos/dqn.py", *TINY, "--total-timesteps", "300", "--save-model", "--run-dir", str(root),
                      timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    [model] = root.glob("*/dqn.cleanrl_model")
    return model


def test_evaluation_command_shows_each_game_then_a_readable_summary(saved_model):
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(saved_model), "--episodes", "3", "--epsilon", "1",
                      "--seed", "7")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    games = re.findall(r"^game (\d)/3 \(seed (\d+)\): return (\S+), 1 agent steps, \d+\.\ds$", done.stderr, re.M)
    assert [(g, seed) for g, seed, _ in games] == [("1", "7"), ("2", "8"), ("3", "9")], done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"dqn on {BANDIT} ({saved_model}): 3 games, epsilon 1.0, seeds 7-9"
    mean = sum(float(r) for *_, r in games) / 3
    assert re.match(rf"  return: mean {mean:.2f} \+- \d\.\d\d \(std\), min \S+, median \S+, max \S+$", lines[1])
    assert lines[2] == "  human-normalized score: n/a (no reference scores for this game)"
    assert lines[3] == "  game length: mean 1 agent steps (min 1, max 1)"
    assert re.fullmatch(r"  actions chosen: action 0 \d+\.\d%, action 1 \d+\.\d%", lines[4])
    assert lines[5] == f"Eval episodic_return: {mean}" and len(lines) == 6  # no raw JSON without --json


def test_evaluation_command_prints_the_raw_result_with_json(saved_model):
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(saved_model), "--episodes", "4", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    [line] = done.stdout.splitlines()
    result = json.loads(line)
    assert result["episodic_returns"] == [1.0] * 4 and result["mean"] == 1.0  # the trained policy's optimum
    assert result["seeds"] == [12345, 12346, 12347, 12348] and result["env_id"] == BANDIT
    assert sum(result["action_histogram"]) == 4 and result["episodic_lengths"] == [1] * 4
    assert done.stderr.count("game ") == 4


def test_evaluation_help_explains_every_flag():
    done = run_python("-m", "cleanrl_utils.tools.evaluate", "--help")
    assert done.returncode == 0
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", done.stdout).split())  # tyro draws boxes and wraps lines
    for flag, words in {
        "MODEL_PATH": "the .cleanrl_model file a run saved",
        "--episodes INT": "how many whole games to play (default: 10)",
        "--epsilon FLOAT": "the probability of a random action at each step",
        "--seed INT": "the seed of the first game; game i uses SEED + i (default: 12345)",
        "--env-id {None}|STR": "the game to play (None: the one the model was trained on)",
        "--json": "print the result as one JSON object",
        "--forced-steps": "FIRE (and the NOOP after a life loss) pressed for the agent",
        "--no-forced-steps": "nothing pressed for the agent",
    }.items():
        assert f"{flag} {words}" in text, (flag, text)
    assert "At most one argument can be overridden" in text  # --forced-steps and --no-forced-steps exclude each other


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--episodes", "0"], "--episodes 0 must be at least 1"),
        (["--epsilon", "1.5"], "--epsilon 1.5 must be in [0, 1]"),
        (["--env-id", "PongNoFrameskip-v4"], "--env-id PongNoFrameskip-v4 has 6 actions, the model 2"),
        (["--env-id", "Pongg"], "did you mean PongNoFrameskip-v4"),
    ],
)
def test_evaluation_command_bad_input(saved_model, flags, words):
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(saved_model), *flags)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_evaluation_command_refuses_a_missing_model(tmp_path):
    done = run_python("-m", "cleanrl_utils.tools.evaluate", str(tmp_path / "nothing.cleanrl_model"))
    assert done.returncode == 2 and "no such file" in done.stderr and "Traceback" not in done.stderr


def test_the_receipt_keeps_the_revision_the_run_started_from(tmp_path, monkeypatch):
    # A later commit in the checkout (here: git pointed at another repository) must not relabel a running run.
    run = make_run(tmp_path / "runs")
    started = run.git["revision"]
    other = tmp_path / "other"
    for command in (["init", "-q", str(other)], ["-C", str(other), "commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *command], check=True)
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    run.write_receipt()
    receipt = json.loads((run.dir / "receipt.json").read_text())
    assert receipt["git"]["revision"] == started and len(started) == 40
    run.close()
