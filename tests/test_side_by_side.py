"""benchmarks/side_by_side.py: the run-time patches, the schedule and its evaluation seeds, the snapshot networks
(against our own scripts' networks here; against the references themselves where the reference virtual environment
is set up, docs/side_by_side.md), and one small run of our side end to end. No network access."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, run_python

spec = importlib.util.spec_from_file_location("side_by_side", REPO / "benchmarks" / "side_by_side.py")
sbs = importlib.util.module_from_spec(spec)
sys.modules["side_by_side"] = sbs
spec.loader.exec_module(sbs)

REFVENV = sbs.refvenv_default()
HAS_CLEANRL = (sbs.cleanrl_dir(REFVENV) / "cleanrl" / "c51_atari.py").exists()
HAS_REFVENV = (REFVENV / "bin" / "python").exists()
NO_REFERENCE = f"no reference virtual environment with CleanRL's files at {REFVENV} (docs/side_by_side.md)"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"algo_{name}", REPO / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- patches


def test_each_patch_must_match_exactly_once():
    patches = sbs.CLEANRL_C51_PATCHES
    text = "\n#\n".join(p.old for p in patches)
    patched = sbs.apply_patches(text, patches)
    for p in patches:
        assert p.new in patched
    with pytest.raises(sbs.PatchError, match="found it 0 times"):
        sbs.apply_patches(text.replace(patches[2].old, ""), patches)
    with pytest.raises(sbs.PatchError, match="found it 2 times"):
        sbs.apply_patches(text + "\n" + patches[2].old, patches)


def test_patches_name_no_line_twice():
    """no patch's text is inside another's: each changes its own lines, as docs/side_by_side.md lists them"""
    olds = [p.old for p in sbs.CLEANRL_C51_PATCHES]
    for i, a in enumerate(olds):
        for j, b in enumerate(olds):
            assert i == j or a not in b


@pytest.mark.skipif(not HAS_CLEANRL, reason=NO_REFERENCE)
def test_patches_apply_to_the_pinned_file():
    text = sbs.patched_c51(REFVENV)
    compile(text, "c51_atari_patched.py", "exec")
    assert "GrayScaleObservation" not in text and 'infos["final_observation"]' not in text


# ---------------------------------------------------------------- the schedule


def test_schedule_evaluations_and_seeds():
    points = sbs.Schedule().evaluations(seed=2)
    assert [p["step"] for p in points] == [50_000, 100_000, 150_000, 200_000, 250_000, 300_000]
    assert [p["episodes"] for p in points] == [30] * 5 + [100]
    assert [p["final"] for p in points] == [False] * 5 + [True]
    assert [p["seed"] for p in points] == [2 + 10_000 + 100 * i for i in range(6)]  # as Run.evaluate seeds them
    assert sbs.Schedule(total_timesteps=120_000).evaluations(1)[-1] == {
        "step": 120_000, "final": True, "episodes": 100, "seed": 10_201}  # fmt: skip
    assert [p["step"] for p in sbs.Schedule(eval_every=0).evaluations(1)] == [300_000]


@pytest.mark.parametrize("algo", sbs.ALGOS)
def test_our_command_is_accepted_by_each_script(algo, tmp_path):
    """every flag of the schedule exists in the script, and the values arrive as given"""
    from cleanrl_utils.run import parse_args

    command = sbs.ours_command(algo, 3, sbs.Schedule(), tmp_path, threads=1, device="cpu", checkpoint_every=50_000)
    args = parse_args(load_script(algo).Args, command[2:])
    assert (args.total_timesteps, args.learning_starts, args.buffer_size) == (300_000, 10_000, 100_000)
    assert (args.exploration_fraction, args.eval_every, args.eval_episodes, args.num_envs) == (0.1, 50_000, 30, 1)
    assert args.save_model and args.seed == 3 and args.torch_threads == 1


def test_reference_commands(tmp_path):
    c51 = sbs.reference_command("c51", 1, sbs.Schedule(), tmp_path, tmp_path / "c.py", tmp_path / "s", 1, "cpu")
    assert c51[c51.index("--snapshot-steps") + 1 :] == [str(50_000 * i) for i in range(1, 7)]
    assert "--no-cuda" in c51 and c51[c51.index("--exploration-fraction") + 1] == "0.1"
    qr = sbs.reference_command("qrdqn", 1, sbs.Schedule(), tmp_path, sbs.SB3_DRIVER, tmp_path / "s", 1, "cpu")
    assert qr[1] == str(sbs.SB3_DRIVER) and qr[qr.index("--buffer-size") + 1] == "100000"
    env = sbs.reference_env(tmp_path, 1)
    assert env["PYTHONPATH"] == str(sbs.cleanrl_dir(tmp_path)) and env["OMP_NUM_THREADS"] == "1"


# ---------------------------------------------------------------- the snapshot networks


def observations(n: int = 48) -> np.ndarray:
    """Breakout stacks from our environments under random play: what the evaluator gives the network"""
    from cleanrl_utils.envs import TrainEnvs

    envs = TrainEnvs("BreakoutNoFrameskip-v4", 1, seed=5)
    obs, rng, stacks = envs.reset(), np.random.default_rng(0), []
    for _ in range(n):
        stacks.append(obs[0])
        obs = envs.step(rng.integers(0, envs.n_actions, 1)).next_obs
    envs.close()
    return np.stack(stacks)


def test_cleanrl_c51_network_is_our_c51_on_its_weights():
    torch.manual_seed(0)
    ours = load_script("c51").QNetwork(4)
    state = {"atoms": ours.atoms}
    for mine, theirs in zip([0, 2, 4], [0, 2, 4], strict=True):
        state[f"network.{theirs}.weight"] = ours.encoder.state_dict()[f"{_conv(ours, mine)}.weight"]
        state[f"network.{theirs}.bias"] = ours.encoder.state_dict()[f"{_conv(ours, mine)}.bias"]
    state["network.7.weight"], state["network.7.bias"] = _linear(ours)
    state["network.9.weight"], state["network.9.bias"] = ours.head.weight.detach(), ours.head.bias.detach()
    theirs = sbs.CleanRLC51.from_state_dict(state)
    x = torch.as_tensor(np.random.default_rng(1).integers(0, 256, (6, 4, 84, 84), dtype=np.uint8))
    torch.testing.assert_close(theirs(x), ours(x))


def test_sb3_qrdqn_network_is_our_qrdqn_on_its_weights():
    torch.manual_seed(0)
    ours = load_script("qrdqn").QNetwork(4, n_quantiles=200)
    convs = [_conv(ours, i) for i in (0, 2, 4)]
    state = {}
    for index, name in zip([0, 2, 4], convs, strict=True):
        for part in ("weight", "bias"):
            state[f"features_extractor.cnn.{index}.{part}"] = ours.encoder.state_dict()[f"{name}.{part}"]
    state["features_extractor.linear.0.weight"], state["features_extractor.linear.0.bias"] = _linear(ours)
    # ours: (actions, quantiles) rows; sb3: (quantiles, actions)
    weight = ours.head.weight.detach().view(4, 200, 512).transpose(0, 1).reshape(800, 512)
    bias = ours.head.bias.detach().view(4, 200).t().reshape(800)
    state["quantile_net.0.weight"], state["quantile_net.0.bias"] = weight, bias
    theirs = sbs.SB3QRDQN.from_snapshot({"state_dict": state, "n_actions": 4, "n_quantiles": 200})
    x = torch.as_tensor(np.random.default_rng(1).integers(0, 256, (6, 4, 84, 84), dtype=np.uint8))
    torch.testing.assert_close(theirs(x), ours(x))


def _conv(network, index: int) -> str:
    """the name of the encoder's index-th layer of the Nature layout (0, 2, 4: the convolutions)"""
    convs = [name for name, m in network.encoder.named_modules() if isinstance(m, torch.nn.Conv2d)]
    return convs[index // 2]


def _linear(network):
    linear = [m for m in network.encoder.modules() if isinstance(m, torch.nn.Linear)][0]
    return linear.weight.detach(), linear.bias.detach()


REFERENCE_GREEDY = r"""
import sys, types, numpy as np, torch
algo, folder = sys.argv[1], sys.argv[2]
obs = np.load(folder + "/obs.npy")
torch.manual_seed(0)


def standardise(head, features):
    # the last layer on the batch's standardised features (the stacks of one game differ in a few pixels): the
    # greedy action then varies across the batch
    mean, std = features.mean(0), features.std(0) + 1e-3
    weight = torch.randn_like(head.weight) / std
    head.weight.copy_(weight)
    head.bias.copy_(-weight @ mean)


if algo == "c51":
    sys.path.insert(0, folder)
    import c51_atari_patched as c51
    net = c51.QNetwork(types.SimpleNamespace(single_action_space=types.SimpleNamespace(n=4)), 51, -10, 10)
    with torch.no_grad():
        standardise(net.network[9], net.network[:9](torch.Tensor(obs) / 255.0))
        actions, _ = net.get_action(torch.Tensor(obs))
    torch.save(net.state_dict(), folder + "/snapshot.pt")
else:
    import ale_py, gymnasium as gym
    from sb3_contrib import QRDQN
    from stable_baselines3.common.atari_wrappers import AtariWrapper
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecFrameStack
    gym.register_envs(ale_py)
    env = VecFrameStack(make_vec_env("BreakoutNoFrameskip-v4", n_envs=1, seed=0, wrapper_class=AtariWrapper), 4)
    model = QRDQN("CnnPolicy", env, buffer_size=100, seed=0, device="cpu")
    with torch.no_grad():
        features = model.quantile_net.features_extractor(torch.as_tensor(obs).float() / 255.0)
        standardise(model.quantile_net.quantile_net[0], features)
    actions, _ = model.predict(obs, deterministic=True)  # the reference's own greedy action
    torch.save({"state_dict": model.quantile_net.state_dict(), "n_quantiles": model.n_quantiles,
                "n_actions": 4}, folder + "/snapshot.pt")
np.save(folder + "/actions.npy", np.asarray(actions))
"""


@pytest.mark.skipif(not (HAS_REFVENV and HAS_CLEANRL), reason=NO_REFERENCE)
@pytest.mark.parametrize("algo", ["c51", "qrdqn"])
def test_snapshot_network_acts_as_the_reference(algo, tmp_path):
    """on real Breakout stacks of our environments, the snapshot network's argmax is the reference's own greedy
    action (CleanRL's get_action, sb3's predict with deterministic=True), computed in the reference's environment"""
    obs = observations()
    np.save(tmp_path / "obs.npy", obs)
    if algo == "c51":
        (tmp_path / "c51_atari_patched.py").write_text(sbs.patched_c51(REFVENV))
    (tmp_path / "greedy.py").write_text(REFERENCE_GREEDY)
    done = subprocess.run(
        [str(REFVENV / "bin" / "python"), str(tmp_path / "greedy.py"), algo, str(tmp_path)],
        env=sbs.reference_env(REFVENV, 1), capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = np.load(tmp_path / "actions.npy").reshape(-1)
    network = sbs.load_snapshot(algo, tmp_path / "snapshot.pt")
    with torch.no_grad():
        mine = network(torch.as_tensor(obs)).argmax(dim=1).numpy()
    assert len(set(theirs.tolist())) > 1, "the test's network should not pick one action everywhere"
    np.testing.assert_array_equal(mine, theirs)


# ---------------------------------------------------------------- our side, end to end


def test_our_side_end_to_end(tmp_path):
    """a small run of our side on a toy task: its evaluations' seeds and games as the schedule says (the runner
    checks), the final one played here from the saved model with the final number of games; then table and plot"""
    out = tmp_path / "out"
    done = run_python(
        "benchmarks/side_by_side.py", "run", "--algo", "c51", "--side", "ours", "--seed", "2", "--out", str(out),
        "--env-id", "tests.toy_envs:ImageBandit-v0", "--total-timesteps", "400", "--learning-starts", "100",
        "--buffer-size", "400", "--eval-every", "200", "--eval-episodes", "3", "--final-eval-episodes", "5",
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    side = out / "c51" / "ours" / "seed2"
    evaluations = json.loads((side / "evaluations.json").read_text())
    assert [(e["step"], e["final"], len(e["episodic_returns"]), e["seed"]) for e in evaluations] == [
        (200, False, 3, 10_002), (400, True, 5, 10_102)]  # fmt: skip
    record = json.loads((side / "side.json").read_text())
    assert record["status"] == "finished" and record["peak_memory_bytes"] > 0 and record["training_wall_seconds"] > 0
    again = run_python("benchmarks/side_by_side.py", "run", "--algo", "c51", "--side", "ours", "--seed", "2",
                       "--out", str(out), "--env-id", "tests.toy_envs:ImageBandit-v0", "--total-timesteps", "400",
                       "--learning-starts", "100", "--buffer-size", "400", "--eval-every", "200", "--eval-episodes",
                       "3", "--final-eval-episodes", "5")  # fmt: skip
    assert again.returncode == 0 and "algos/c51.py" not in again.stdout  # finished: scored only, nothing trained
    table = run_python("benchmarks/side_by_side.py", "table", str(out))
    assert "| c51 | ours | 2 |" in table.stdout, table.stdout + table.stderr
    pytest.importorskip("matplotlib")
    plot = run_python("benchmarks/side_by_side.py", "plot", str(out / "c51"), "--out", str(tmp_path / "p.png"))
    assert plot.returncode == 0 and (tmp_path / "p.png").exists(), plot.stderr


def test_reference_refused_without_one(tmp_path):
    done = run_python("benchmarks/side_by_side.py", "run", "--algo", "iqn", "--side", "reference",
                      "--out", str(tmp_path))  # fmt: skip
    assert done.returncode != 0 and "no reference" in done.stderr
    assert os.listdir(tmp_path) == []
