"""Long runs that survive (issue 6): checkpoints, exact resume after SIGTERM and kill -9, refusal of bad
checkpoints, non-finite losses, and a resumed real game. Real subprocess runs of the scripts, no mocks.

Exactness: on CPU with a fixed seed, a run interrupted (at a random moment) and resumed with
``--checkpoint-buffer`` ends with the same network weights as an uninterrupted run BIT FOR BIT
(``torch.equal``): the checkpoint holds every RNG, the replay memory and the toy environments' state. Every
script's exact resume from a periodic checkpoint is in tests/test_scripts.py.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, mark_interrupted, run_python, weights
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cleanrl_utils.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

TOTAL = 1000  # 400 updates; checkpoints at 300, 600, 900 and the end, evaluations at 400, 800 and the end
# one torch thread, fixed, for exactness (tests/conftest.py's FAST_LEARNING says why)
TOY = [
    "--env-id", "tests.toy_envs:DelayedImage-v0", "--total-timesteps", str(TOTAL), "--learning-starts", "200",
    "--buffer-size", "1000", "--train-frequency", "2", "--target-network-frequency", "50", "--learning-rate", "5e-4",
    "--exploration-fraction", "0.5", "--eval-every", "400", "--eval-episodes", "4", "--device", "cpu",
    "--checkpoint-every", "300", "--checkpoint-buffer", "--save-model", "--torch-threads", "1",
]  # fmt: skip
ENV = {**os.environ, "PYTHONPATH": str(REPO), "CI": "true"}


def start(script: Path, run_dir: Path, *flags: str) -> subprocess.Popen:
    command = [sys.executable, str(script), *TOY, *flags, "--run-dir", str(run_dir)]
    return subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(run_root: Path, process: subprocess.Popen, timeout: float = 300) -> Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [c for run in run_root.glob("*") for c in list_checkpoints(run)]
        if found:
            return found[0].parent.parent
        assert process.poll() is None, process.communicate()
        time.sleep(0.02)
    raise AssertionError("no checkpoint appeared")


def curve_steps(run_dir: Path, tag: str) -> list[int]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


_UNINTERRUPTED: dict[str, Path] = {}
# the tests that read dqn's reference run go to one worker under pytest-xdist, which makes it once
REFERENCE = pytest.mark.xdist_group("dqn reference run")


def uninterrupted_run(script: str, tmp_path_factory) -> Path:
    """One uninterrupted reference run per script, shared by the tests of this module."""
    if script not in _UNINTERRUPTED:
        root = tmp_path_factory.mktemp(f"uninterrupted_{script}")
        done = run_python(f"algos/{script}.py", *TOY, "--run-dir", str(root), timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        [_UNINTERRUPTED[script]] = root.iterdir()
    return _UNINTERRUPTED[script]


@pytest.fixture
def uninterrupted(tmp_path_factory) -> Path:
    return uninterrupted_run("dqn", tmp_path_factory)


def assert_same_run(resumed: Path, reference: Path) -> None:
    a, b = weights(reference), weights(resumed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after resume (max {(a[key] - b[key]).abs().max()})"
    receipt, reference_receipt = (json.loads((d / "receipt.json").read_text()) for d in (resumed, reference))
    assert receipt["status"] == "finished" and len(receipt["resumes"]) == 1
    for count in ("env_steps", "gradient_updates", "transitions_stored", "evaluations"):
        assert receipt["counts"][count] == reference_receipt["counts"][count], count
    assert receipt["counts"]["env_steps"] == TOTAL
    # whole curves: every step logged exactly once, as in the uninterrupted run
    for tag in ("charts/SPS", "losses/td_loss", "eval/episodic_return", "charts/episodic_return"):
        steps = curve_steps(resumed, tag)
        assert steps == curve_steps(reference, tag), tag
        assert len(steps) == len(set(steps)), f"{tag} has duplicate steps"
    evaluations = json.loads((resumed / "evaluations.json").read_text())
    assert [e["step"] for e in evaluations] == [400, 800, TOTAL]


def resume(run_dir: Path, script: str = "dqn") -> subprocess.CompletedProcess:
    done = run_python(f"algos/{script}.py", "--resume", str(run_dir), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout
    return done


@pytest.mark.parametrize(
    "script",
    [pytest.param("dqn", marks=REFERENCE), "custom_value_atari"],
)
def test_sigterm_writes_a_checkpoint_exits_0_and_the_resumed_run_is_bit_identical(script, tmp_path_factory, tmp_path):
    uninterrupted = uninterrupted_run(script, tmp_path_factory)
    process = start(REPO / "algos" / f"{script}.py", tmp_path)
    run_dir = wait_for_checkpoint(tmp_path, process)
    time.sleep(random.Random().uniform(0.0, 1.5))  # a random moment after the first checkpoint
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    assert f"resume with: python algos/{script}.py --resume" in out
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["status"] == "interrupted"
    newest = list_checkpoints(run_dir)[0]
    state = load_checkpoint(newest, f"{script}.py").state  # loadable
    assert state["global_step"] == receipt["counts"]["env_steps"] < TOTAL
    resume(run_dir, script)
    assert_same_run(run_dir, uninterrupted)


@REFERENCE
def test_kill_9_at_a_random_moment_then_resume_finishes_whole_and_bit_identical(uninterrupted, tmp_path):
    process = start(REPO / "algos" / "dqn.py", tmp_path)
    run_dir = wait_for_checkpoint(tmp_path, process)
    time.sleep(random.Random().uniform(0.0, 2.0))
    process.kill()
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    if (run_dir / "dqn.cleanrl_model").exists():
        pytest.skip("the run finished before the kill (machine faster than expected)")
    resume(run_dir)
    assert_same_run(run_dir, uninterrupted)
    assert len(list_checkpoints(run_dir)) <= 3  # --checkpoint-keep 3


@REFERENCE
def test_bad_checkpoints_are_refused_and_the_older_one_offered(uninterrupted, tmp_path):
    checkpoints = list_checkpoints(uninterrupted)
    assert [c.name for c in checkpoints] == ["step_000000001000", "step_000000000900", "step_000000000600"]
    copy = tmp_path / uninterrupted.name
    subprocess.run(["cp", "-r", str(uninterrupted), str(copy)], check=True)
    newest, older, _ = list_checkpoints(copy)
    state_file = newest / "state.pt"

    cases = {
        "truncated": state_file.read_bytes()[: state_file.stat().st_size // 2],
        "random bytes": random.Random(0).randbytes(4096),
    }
    for name, content in cases.items():
        state_file.write_bytes(content)
        with pytest.raises(CheckpointError, match="cannot be read") as refused:
            load_checkpoint(newest, "dqn.py")
        # torch's reason in whole sentences, without its advice to load the file unsafely
        assert re.search(r"\((\w+Error): [^()]+\)$", str(refused.value)), str(refused.value)
        assert "weights_only" not in str(refused.value)
        done = run_python("algos/dqn.py", "--resume", str(copy), timeout=120)
        assert done.returncode != 0 and "Traceback" not in done.stderr, (name, done.stderr)
        assert f"refusing checkpoint {newest}" in done.stderr and f"--resume {older}" in done.stderr, done.stderr
        assert state_file.read_bytes() == content, "a refused checkpoint must be left as it was"
    assert load_checkpoint(older, "dqn.py").step == 900  # the older one still loads

    done = run_python("algos/double_dqn.py", "--resume", str(older), timeout=120)
    assert done.returncode != 0 and "written by dqn.py, not double_dqn.py" in done.stderr, done.stderr
    with pytest.raises(CheckpointError, match="written by dqn.py"):
        load_checkpoint(older, "qrdqn.py")


PLANTED = ("loss = F.mse_loss(td_target, old_val)", "loss = F.mse_loss(td_target, old_val) * NAN_AFTER(global_step)")


def planted_script(tmp_path: Path) -> Path:
    """algos/dqn.py whose loss turns NaN after step 700 (a planted fault, the script otherwise unchanged)."""
    source = (REPO / "algos" / "dqn.py").read_text()
    assert PLANTED[0] in source
    source = source.replace(PLANTED[0], PLANTED[1])
    source = source.replace(
        "\nclass QNetwork", '\nNAN_AFTER = lambda step: float("nan") if step > 700 else 1.0  # noqa\n\n\nclass QNetwork'
    )
    folder = tmp_path / "planted"
    folder.mkdir()
    script = folder / "dqn.py"
    script.write_text(source)
    return script


def test_a_planted_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    script = planted_script(tmp_path)
    process = start(script, tmp_path / "runs")
    out, err = process.communicate(timeout=600)
    assert process.returncode == 1, err[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    assert "non-finite td_loss=nan" in err and "at step 1000" in err, err  # the first metrics step after the fault
    assert "not checkpointing at step 900: the network holds non-finite values" in out, out[-2000:]
    assert f"the last good checkpoint is {run_dir / 'checkpoints' / 'step_000000000600'}" in err, err
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["status"].startswith("failed: non-finite td_loss=nan") and "at step 1000" in receipt["status"]
    state = load_checkpoint(list_checkpoints(run_dir)[0], "dqn.py").state
    assert state["global_step"] == 600
    assert all(torch.isfinite(t).all() for t in state["q_network"]["state_dict"].values())


def test_skip_mode_skips_non_finite_updates_and_finishes(tmp_path):
    script = planted_script(tmp_path)
    process = start(script, tmp_path / "runs", "--on-nonfinite", "skip", "--checkpoint-every", "0")
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["status"] == "finished"
    skipped = (TOTAL - 700) // 2  # every update after step 700 (one per 2 steps)
    assert abs(receipt["counts"]["skipped_updates"] - skipped) <= 1
    assert receipt["counts"]["gradient_updates"] + receipt["counts"]["skipped_updates"] == (TOTAL - 200) // 2
    assert all(torch.isfinite(t).all() for t in weights(run_dir).values())


def test_a_real_game_resumes_with_new_games_and_an_empty_replay(tmp_path):
    """ale-py cannot save a game in progress: the resumed run starts new games, refills the replay memory
    before learning again, and still ends at the requested step with whole curves."""
    flags = [
        "--env-id", "BreakoutNoFrameskip-v4", "--total-timesteps", "700", "--learning-starts", "100",
        "--buffer-size", "400", "--num-envs", "2", "--checkpoint-every", "300", "--eval-every", "0",
        "--eval-episodes", "1", "--eval-epsilon", "1", "--device", "cpu", "--run-dir", str(tmp_path),
        "--no-checkpoint-buffer",
    ]  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "algos/dqn.py", *flags], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    run_dir = wait_for_checkpoint(tmp_path, process)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=300)
    assert process.returncode == 0
    stopped_at = json.loads((run_dir / "receipt.json").read_text())["counts"]["env_steps"]
    done = resume(run_dir)
    assert "new games started" in done.stdout and "learning waits until step" in done.stdout
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["status"] == "finished" and receipt["counts"]["env_steps"] == 700
    [entry] = receipt["resumes"]
    assert entry["step"] == stopped_at and not entry["buffer_restored"] and not entry["environments_restored"]
    sps = curve_steps(run_dir, "charts/SPS")
    assert sps == list(range(100, 701, 100))  # each step once (2 envs: multiples of 100 are all reached)


def test_a_resume_whose_first_logging_step_comes_before_its_first_update_finishes(tmp_path):
    """Resumed without the replay memory, learning restarts after step 1,999: the metrics of step 2,000 are
    due before the resumed process has made an update (one per 16 steps: few updates, the test is not about them),
    and must simply wait for one."""
    flags = [
        "--env-id", "tests.toy_envs:ImageBandit-v0", "--total-timesteps", "2100", "--learning-starts", "499",
        "--buffer-size", "1000", "--checkpoint-every", "1500", "--eval-every", "0", "--eval-episodes", "1",
        "--train-frequency", "16", "--device", "cpu", "--run-dir", str(tmp_path), "--no-checkpoint-buffer",
    ]  # fmt: skip
    first = run_python("algos/dqn.py", *flags, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    [run_dir] = tmp_path.glob("*")
    mark_interrupted(run_dir)
    again = run_python("algos/dqn.py", "--resume", str(run_dir / "checkpoints" / "step_000000001500"), timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "learning waits until step 1999" in again.stdout
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["status"] == "finished" and receipt["counts"]["env_steps"] == 2100


# ---------------------------------------------------------------- optimizer state across layouts


def test_optimizer_moments_take_their_parameters_layout_on_load():
    """A checkpoint written with contiguous networks (as on CUDA) and loaded into channels-last ones (as on
    CPU): the fused Adam kernel walks moments and parameters in memory order, so unless the loaded moments
    take the parameters' layout, every later update is wrong. With the fix, the resumed updates equal those
    of the run that went straight through, bit for bit; without it they differ."""
    from torch import nn

    from cleanrl_utils.checkpoint import moments_like_parameters

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 3))
    net = net.to(memory_format=torch.channels_last)
    x, y = torch.randn(16, 4, 8, 8).to(memory_format=torch.channels_last), torch.randn(16, 3)

    def train(network, optimizer, steps):
        for _ in range(steps):
            loss = ((network(x) - y) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    train(net, optimizer, 3)
    saved = copy.deepcopy(optimizer.state_dict())
    written_contiguous = copy.deepcopy(saved)  # what a CUDA run (contiguous networks) writes
    for state in written_contiguous["state"].values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() == 4:
                state[key] = value.contiguous()

    def resumed(state, fix):
        network = copy.deepcopy(net)
        optimizer = torch.optim.Adam(network.parameters(), lr=1e-2, fused=True)
        optimizer.load_state_dict(copy.deepcopy(state))
        if fix:
            moments_like_parameters(optimizer)
        train(network, optimizer, 3)
        return network[0].weight.detach()

    straight = resumed(saved, fix=False)
    assert torch.equal(resumed(written_contiguous, fix=True), straight)
    assert not torch.equal(resumed(written_contiguous, fix=False), straight)  # the fault the fix removes
    fixed = torch.optim.Adam(copy.deepcopy(net).parameters(), lr=1e-2, fused=True)
    fixed.load_state_dict(copy.deepcopy(written_contiguous))
    moments_like_parameters(fixed)
    for p in fixed.param_groups[0]["params"]:
        assert all(v.stride() == p.stride() for v in fixed.state[p].values() if v.shape == p.shape)


@REFERENCE
def test_resume_given_the_run_dir_resumes_its_one_run_or_lists_several(uninterrupted, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    empty = run_python("algos/dqn.py", "--resume", str(runs), timeout=120)
    assert empty.returncode == 2 and "neither a run folder nor a folder of runs" in empty.stderr, empty.stderr

    subprocess.run(["cp", "-r", str(uninterrupted), str(runs / "first")], check=True)
    subprocess.run(["cp", "-r", str(uninterrupted), str(runs / "second")], check=True)
    several = run_python("algos/dqn.py", "--resume", str(runs), timeout=120)
    assert several.returncode == 2 and "Traceback" not in several.stderr
    assert "is a folder of 2 runs, 2 of them dqn runs with a checkpoint" in several.stderr, several.stderr
    for name in ("first", "second"):
        assert f"{runs / name}  (dqn, finished, newest checkpoint at step 1000)" in several.stderr
    assert "the run wrote none" not in several.stderr

    other = run_python("algos/c51.py", "--resume", str(runs), timeout=120)  # runs of another script only
    assert other.returncode == 2 and "0 of them c51 runs with a checkpoint" in other.stderr, other.stderr

    subprocess.run(["rm", "-r", str(runs / "second")], check=True)
    mark_interrupted(runs / "first")
    for model in (runs / "first").glob("*.cleanrl_model"):
        model.unlink()
    one = run_python("algos/dqn.py", "--resume", str(runs), timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    assert f"the one dqn run there with a checkpoint is {runs / 'first'}" in one.stdout
    assert "resumed from" in one.stdout and (runs / "first" / "dqn.cleanrl_model").exists()


@REFERENCE
def test_a_checkpoint_of_another_format_or_with_a_setting_the_script_lacks_is_refused(uninterrupted, tmp_path):
    """no compatibility code: a checkpoint of the earlier format, or one whose run had a setting this script does
    not have (dqn.py's --prioritized, before it moved to rainbow.py), is refused with what to do, before anything
    is written; the run folder is left as it was"""
    copy = tmp_path / uninterrupted.name
    subprocess.run(["cp", "-r", str(uninterrupted), str(copy)], check=True)
    checkpoint = list_checkpoints(copy)[0]
    original = (checkpoint / "state.pt").read_bytes()
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    for changed, words in [
        ({"format": 1}, "format 1, written by an earlier version of value-atari; this version reads formats 2 to 3"),
        ({"args": {**state["args"], "prioritized": True}}, "settings this script does not have (prioritized)"),
    ]:
        torch.save({**state, **changed}, checkpoint / "state.pt")
        before = {p: p.stat().st_mtime_ns for p in copy.rglob("*")}
        done = run_python("algos/dqn.py", "--resume", str(copy), timeout=120)
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert {p: p.stat().st_mtime_ns for p in copy.rglob("*")} == before, "a refused resume wrote something"
    (checkpoint / "state.pt").write_bytes(original)
    mark_interrupted(copy)
    for model in copy.glob("*.cleanrl_model"):
        model.unlink()
    done = run_python("algos/dqn.py", "--resume", str(copy), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
