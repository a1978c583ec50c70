"""The scripts' TD targets against naive float64 loops, and terminal / truncation handling."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.tools.evaluate import load_algorithm

ALGOS = Path(__file__).resolve().parents[1] / "algos"
GAMMA = 0.97


class TinyQ(nn.Module):
    def __init__(self, seed: int, n_actions: int = 5):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(4 * 3 * 3, n_actions)

    def forward(self, x):
        return self.linear(x.float().flatten(1) / 255.0)


def q_rows(net, obs) -> list[list[float]]:
    with torch.no_grad():
        return net(obs).double().tolist()


def naive_target(algo: str, online, target, data) -> list[float]:
    online_q, target_q = q_rows(online, data.next_observations), q_rows(target, data.next_observations)
    out = []
    for i in range(len(data.rewards)):
        if algo == "dqn":
            bootstrap = max(target_q[i])
        else:  # double: the online network picks, the target network evaluates
            best = max(range(len(online_q[i])), key=lambda a: online_q[i][a])
            bootstrap = target_q[i][best]
        done = float(data.dones[i])
        out.append(float(data.rewards[i]) + (0.0 if done else GAMMA * bootstrap))
    return out


@pytest.fixture(scope="module", params=["dqn", "double_dqn"])
def algo(request):
    return request.param, load_algorithm(ALGOS / f"{request.param}.py")


def test_td_target_matches_naive_loops(algo):
    name, module = algo
    online, target = TinyQ(0), TinyQ(1)
    g = torch.Generator().manual_seed(3)
    data = SimpleNamespace(
        next_observations=torch.randint(0, 256, (64, 4, 3, 3), dtype=torch.uint8, generator=g),
        rewards=torch.randn(64, generator=g),
        dones=(torch.rand(64, generator=g) < 0.3).float(),
    )
    got = module.compute_td_target(online, target, data, GAMMA)
    expected = naive_target(name, online, target, data)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)
    if name == "double_dqn":  # differs from the plain max where the two networks disagree
        plain = load_algorithm(ALGOS / "dqn.py").compute_td_target(online, target, data, GAMMA)
        assert not torch.allclose(got, plain)


def test_terminal_target_is_the_reward_and_truncation_bootstraps(algo):
    name, module = algo
    online, target = TinyQ(0), TinyQ(1)
    buffer = ReplayBuffer(100, 1, (4, 3, 3), gamma=GAMMA, seed=0)
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 256, (1, 4, 3, 3), dtype=np.uint8)
    final = np.concatenate([obs[:, 1:], rng.integers(0, 256, (1, 1, 3, 3), dtype=np.uint8)], axis=1)
    # one truncated transition (time limit): not terminal, bootstraps from its real final obs
    buffer.add(obs, final, np.array([2]), np.array([0.5]), np.array([False]), np.array([True]))
    obs2 = rng.integers(0, 256, (1, 4, 3, 3), dtype=np.uint8)
    last = np.concatenate([obs2[:, 1:], rng.integers(0, 256, (1, 1, 3, 3), dtype=np.uint8)], axis=1)
    # one terminal transition (game over)
    buffer.add(obs2, last, np.array([1]), np.array([-1.0]), np.array([True]), np.array([True]))
    batch = buffer.sample(50)
    targets = module.compute_td_target(online, target, batch, GAMMA)
    expected = naive_target(name, online, target, batch)
    for i in range(50):
        if batch.rewards[i] < 0:
            assert targets[i].item() == -1.0
        else:
            assert torch.equal(batch.next_observations[i], torch.from_numpy(final[0]))
            assert batch.dones[i].item() == 0.0
            assert targets[i].item() == pytest.approx(expected[i], abs=1e-6)
            assert targets[i].item() != pytest.approx(0.5)  # it did bootstrap
    assert (batch.rewards < 0).any() and (batch.rewards > 0).any()
