"""PQN (algos/pqn.py): its Q(lambda) returns against a naive float64 forward view, its loss, and end to end on the
toy task: it learns, and a run resumed from a checkpoint (a rollout boundary) ends bit-identical."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from conftest import REPO, mark_interrupted, read_json, run_python, run_script, weights

from cleanrl_utils.tools.evaluate import load_algorithm

pqn = load_algorithm(REPO / "algos" / "pqn.py")


def naive_q_lambda(rewards, dones, masks, values, next_value, gamma, lam):
    """The forward view, per game and step, in float64: from transition t, the path runs while it is the agent's
    transitions of one life; it ends at a terminal (no bootstrap), or before a step that is not a transition or at
    the rollout's end (bootstrap from max Q of the next observation). G = (1 - lam) sum_n lam^(n-1) G^(n) over the
    n-step returns that bootstrap inside the path, plus lam^(N-1) G^(N), the path's whole return."""
    steps, envs = len(rewards), len(rewards[0])
    out = np.zeros((steps, envs))
    for e in range(envs):
        for t in range(steps):
            path = []  # the steps of the path, and how it ends
            k = t
            while True:
                path.append(k)
                if dones[k][e]:
                    end_value = 0.0
                    break
                if k == steps - 1:
                    end_value = next_value[e]
                    break
                if not masks[k + 1][e]:
                    end_value = values[k + 1][e]
                    break
                k += 1
            n_total = len(path)
            total = 0.0
            for n in range(1, n_total + 1):
                discounted = sum(gamma**i * rewards[path[i]][e] for i in range(n))
                if n < n_total:
                    g_n = discounted + gamma**n * values[path[n]][e]  # the value of the path's n-th next state
                    total += (1 - lam) * lam ** (n - 1) * g_n
                else:
                    total += lam ** (n - 1) * (discounted + gamma**n * end_value)
            out[t, e] = total
    return out


# one game's rollout, step by step: (reward, done, mask). A life loss mid-rollout (done), then NOOP and FIRE pressed
# for the agent (not transitions); a time limit (not done, then the reset step, not a transition); the last step
# bootstraps from the observation after the rollout
SCRIPTED = [
    (1.0, 0, 1), (0.0, 0, 1), (1.0, 1, 1),  # a life lost at step 2
    (0.0, 0, 0), (0.0, 0, 0),  # NOOP, FIRE: forced
    (0.0, 0, 1), (1.0, 0, 1),  # the game's time limit at step 6: truncated, not done
    (0.0, 0, 0),  # the reset step
    (0.0, 0, 1), (1.0, 1, 1),  # game over at step 9
    (0.0, 0, 0),  # the reset step
    (0.0, 0, 1), (1.0, 0, 1), (0.0, 0, 1),  # the rollout ends mid-game: bootstrap from the next observation
]  # fmt: skip


def scripted_and_random_rollout(seed: int, envs: int = 5, steps: int = 14):
    rng = np.random.default_rng(seed)
    rewards = rng.choice([-1.0, 0.0, 1.0], size=(steps, envs))
    masks = (rng.random((steps, envs)) < 0.8).astype(float)
    dones = ((rng.random((steps, envs)) < 0.2) & (masks > 0)).astype(float)  # terminals are transitions
    column = np.array(SCRIPTED)
    rewards[:, 0], dones[:, 0], masks[:, 0] = column[:, 0], column[:, 1], column[:, 2]
    values = rng.normal(size=(steps, envs))
    next_value = rng.normal(size=envs)
    return rewards, dones, masks, values, next_value


@pytest.mark.parametrize("lam", [0.0, 0.65, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q_lambda_returns_match_the_forward_view(lam, seed):
    rewards, dones, masks, values, next_value = scripted_and_random_rollout(seed)
    expected = naive_q_lambda(rewards, dones, masks, values, next_value, 0.99, lam)
    as_tensors = [torch.tensor(a, dtype=torch.float64) for a in (rewards, dones, masks, values, next_value)]
    got = pqn.q_lambda_returns(*as_tensors, 0.99, lam).numpy()
    transitions = masks > 0  # the returns of the other steps are never learned from
    np.testing.assert_allclose(got[transitions], expected[transitions], rtol=1e-12, atol=1e-12)


def test_q_lambda_returns_of_the_scripted_game_by_hand():
    """the scripted game's returns written out (gamma 0.5, lambda 0.5): the cases the naive loop covers, readable"""
    rewards, dones, masks, values, next_value = scripted_and_random_rollout(0)
    g, lam = 0.5, 0.5
    got = pqn.q_lambda_returns(*[torch.tensor(a) for a in (rewards, dones, masks, values, next_value)], g, lam)
    r, v, got = rewards[:, 0], values[:, 0], got[:, 0].numpy()
    assert got[2] == pytest.approx(1.0)  # the life loss: its reward alone
    assert got[1] == pytest.approx(0.0 + g * (lam * got[2] + (1 - lam) * v[2]))
    assert got[6] == pytest.approx(1.0 + g * v[7])  # the time limit: bootstraps from the game's last observation
    assert got[5] == pytest.approx(0.0 + g * (lam * got[6] + (1 - lam) * v[6]))
    assert got[9] == pytest.approx(1.0)  # game over
    assert got[13] == pytest.approx(0.0 + g * next_value[0])  # the rollout's last step
    assert got[12] == pytest.approx(r[12] + g * (lam * got[13] + (1 - lam) * v[13]))


def test_the_loss_is_the_mean_squared_error_towards_the_returns():
    torch.manual_seed(0)
    network = pqn.QNetwork(3)  # float32, as the script runs it; the naive sum in float64
    obs = torch.randint(0, 256, (6, 4, 84, 84), dtype=torch.uint8)
    actions = torch.tensor([0, 1, 2, 2, 1, 0])
    returns = torch.randn(6)
    loss, metrics = pqn.compute_loss(network, obs, actions, returns)
    with torch.no_grad():
        q = network(obs)
    naive = sum((returns[i].item() - q[i, actions[i]].item()) ** 2 for i in range(6)) / 6
    assert loss.item() == pytest.approx(naive, rel=1e-5)
    assert metrics["q_values"].item() == pytest.approx(sum(q[i, actions[i]].item() for i in range(6)) / 6, rel=1e-5)


def test_the_network_is_the_layer_norm_nature_cnn_with_orthogonal_init():
    from cleanrl_utils.encoder import NATURE_CNN_LAYER_NORM_PARAMETERS, NATURE_CNN_PARAMETERS, check_encoder

    network = pqn.QNetwork(4)
    check_encoder(network.encoder, layer_norm=True)
    assert sum(p.numel() for p in network.parameters()) == NATURE_CNN_LAYER_NORM_PARAMETERS + 513 * 4
    plain = pqn.QNetwork(4, layer_norm=False)
    check_encoder(plain.encoder)
    assert sum(p.numel() for p in plain.parameters()) == NATURE_CNN_PARAMETERS + 513 * 4
    weight = network.head.weight.detach().double()  # orthogonal rows, gain sqrt(2): W W^T = 2 I
    torch.testing.assert_close(weight @ weight.T, 2 * torch.eye(4, dtype=torch.float64), atol=1e-5, rtol=0)
    assert not network.head.bias.any()


# ---------------------------------------------------------------- end to end, on the toy task

# DelayedImage (the cue's value arrives only through the Q(lambda) bootstrap) in 24 rollouts of 4 games x 32 steps,
# with a checkpoint at step 2048 (a rollout boundary) that the resume test continues from
PQN_TOY = [
    "--env-id", "tests.toy_envs:DelayedImage-v0", "--total-timesteps", "3072", "--num-envs", "4", "--num-steps", "32",
    "--learning-rate", "1e-3", "--exploration-fraction", "0.5", "--eval-every", "0", "--eval-episodes", "20",
    "--eval-epsilon", "0", "--device", "cpu", "--torch-threads", "1", "--checkpoint-every", "2048", "--save-model",
]  # fmt: skip


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("pqn")
    done = run_script("pqn", *PQN_TOY, timeout=900, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    return done.stdout, run_dir


def test_pqn_learns_the_delayed_reward_task(toy):
    stdout, run_dir = toy
    assert read_json(run_dir / "evaluations.json")[-1]["mean"] >= 0.95
    receipt = read_json(run_dir / "receipt.json")
    assert receipt["status"] == "finished" and receipt["counts"]["env_steps"] == 3072
    # 24 rollouts x 4 epochs x 4 minibatches, each update counted once
    assert receipt["counts"]["gradient_updates"] == 24 * 16


def test_pqn_resumed_at_a_rollout_boundary_ends_bit_identical(toy, tmp_path):
    _, straight = toy
    copy = tmp_path / straight.name
    subprocess.run(["cp", "-r", str(straight), str(copy)], check=True)
    for model in copy.glob("*.cleanrl_model"):
        model.unlink()
    mark_interrupted(copy)  # as if stopped after that checkpoint: a finished run refuses an older checkpoint
    again = run_python("algos/pqn.py", "--resume", str(copy / "checkpoints" / "step_000000002048"), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "games continued" in again.stdout, again.stdout[-2000:]
    a, b = weights(straight), weights(copy)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
