"""Prioritized replay (algos/rainbow.py): the sum tree against naive sums and searches, sampling
frequencies against the priorities (chi-square tests with fixed seeds), importance-sampling weights against a
naive float64 computation, new transitions at the largest priority, no sampling of slots without a complete
transition (after wrap-around, with n-step returns), and byte-exact batches with the n-step returns of a naive
loop over random episode streams with terminations, truncations and life losses.

The uniform buffer's own n-step returns are tested against a naive loop in tests/test_buffer.py
(test_n_step_returns_match_a_naive_computation: stops at terminations and truncations, truncations bootstrap);
here the same naive loop checks what the prioritized buffer samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import REPO
from scipy.stats import chi2
from test_buffer import FRAME, STACK, RandomStreams, fill, naive_n_step

from cleanrl_utils.tools.evaluate import load_algorithm

rainbow = load_algorithm(REPO / "algos" / "rainbow.py")  # the buffer lives in the script that uses it
PrioritizedReplayBuffer, SumTree = rainbow.PrioritizedReplayBuffer, rainbow.SumTree

# A chi-square statistic above its 0.999 quantile would reject "the frequencies follow the priorities" at the
# 0.1% level; the seeds are fixed, so each test is deterministic. Stratified sampling (one draw per segment of
# the total) varies less than independent draws, so the test is conservative for it.
CHI2_QUANTILE = 0.999


def chi_square(counts: np.ndarray, probabilities: np.ndarray) -> tuple[float, float]:
    """the statistic over the bins of positive probability, and the 0.999 quantile for its degrees of freedom"""
    n = counts.sum()
    positive = probabilities > 0
    expected = n * probabilities[positive]
    statistic = float((((counts[positive] - expected) ** 2) / expected).sum())
    return statistic, float(chi2.ppf(CHI2_QUANTILE, positive.sum() - 1))


# ---------------------------------------------------------------- 1. the sum tree


@pytest.mark.parametrize("size", [1, 2, 5, 64, 1000])
def test_sum_tree_sums_minimum_and_search_match_naive(size):
    rng = np.random.default_rng(size)
    tree = SumTree(size)
    truth = np.zeros(size)
    for _ in range(30):  # batches of updates, with repeated indices (the last priority wins) and zeros
        indices = rng.integers(0, size, rng.integers(1, 2 * size + 2))
        priorities = rng.exponential(size=len(indices)) * (rng.random(len(indices)) < 0.8)
        tree.update(indices, priorities)
        for i, p in zip(indices, priorities, strict=True):  # naive: one at a time, in order
            truth[i] = p
        assert tree.total() == pytest.approx(truth.sum(), rel=1e-12)
        positive = truth[truth > 0]
        assert tree.min() == (positive.min() if len(positive) else np.inf)
        np.testing.assert_array_equal(tree.get(np.arange(size)), truth)
        if truth.sum() == 0:
            continue
        values = np.concatenate([rng.random(200) * truth.sum(), [0.0, truth.sum(), np.nextafter(truth.sum(), 0)]])
        found = tree.find(values)
        assert (truth[found] > 0).all()  # never a leaf of priority 0, even at or past the total
        cumulative = np.cumsum(truth)
        naive = np.array([next(i for i in range(size) if v < cumulative[i] or i == size - 1) for v in values[:200]])
        # leaves of priority 0 are skipped by both; away from float ties, the leaf is the naive one
        away = np.abs(values[:200, None] - cumulative[None]).min(axis=1) > 1e-9
        np.testing.assert_array_equal(found[:200][away], naive[away])


def test_sum_tree_sampling_frequencies_match_the_priorities():
    rng = np.random.default_rng(0)
    size = 50
    priorities = rng.exponential(size=size) ** 2  # spread out: from about 0 to about 20
    priorities[rng.choice(size, 8, replace=False)] = 0.0  # and some leaves that must never be drawn
    tree = SumTree(size)
    tree.update(np.arange(size), priorities)
    draws = 200_000
    counts = np.bincount(tree.find(rng.random(draws) * tree.total()), minlength=size)
    assert counts[priorities == 0].sum() == 0
    statistic, limit = chi_square(counts, priorities / priorities.sum())
    assert statistic < limit, f"chi-square {statistic:.1f} above its {CHI2_QUANTILE} quantile {limit:.1f}"
    # the check has power: frequencies that ignore the priorities (uniform) fail it by far
    uniform = np.bincount(rng.integers(0, size, draws), minlength=size)
    assert chi_square(uniform, priorities / priorities.sum())[0] > 100 * limit


def test_sum_tree_refuses_bad_updates():
    tree = SumTree(4)
    with pytest.raises(IndexError):
        tree.update(np.array([4]), np.array([1.0]))
    with pytest.raises(ValueError, match="finite"):
        tree.update(np.array([0]), np.array([np.nan]))
    with pytest.raises(ValueError, match=">= 0"):
        tree.update(np.array([0]), np.array([-1.0]))


# ---------------------------------------------------------------- 2. the buffer: sampling, weights, priorities


def filled_buffer(num_envs=3, buffer_size=10_000, n_step=1, steps=120, seed=0, alpha=0.6, gamma=0.9):
    streams = RandomStreams(num_envs, seed=seed, p_term=0.08, p_trunc=0.05, p_life=0.1)
    buffer = PrioritizedReplayBuffer(
        buffer_size, num_envs, (STACK, *FRAME), n_step=n_step, gamma=gamma, seed=seed, alpha=alpha
    )
    fill(buffer, streams, steps, np.random.default_rng(seed + 100))
    return buffer, streams


def live_leaves(buffer: PrioritizedReplayBuffer) -> np.ndarray:
    return np.flatnonzero(buffer.tree.get(np.arange(buffer.tree.size)) > 0)


def test_buffer_sampling_frequencies_and_weights_match_naive():
    buffer, _ = filled_buffer(num_envs=2, steps=40, alpha=0.7)
    live = live_leaves(buffer)
    rng = np.random.default_rng(1)
    errors = rng.exponential(size=len(live)) * 3
    buffer.update_priorities(live, errors)
    # naive, float64, one transition at a time: p = (|error| + eps) ** alpha, P = p / sum p
    p = {int(i): (abs(float(e)) + buffer.eps) ** buffer.alpha for i, e in zip(live, errors, strict=True)}
    total = sum(p.values())
    probabilities = np.zeros(buffer.tree.size)
    for i, pi in p.items():
        probabilities[i] = pi / total
    counts = np.zeros(buffer.tree.size, dtype=np.int64)
    beta = 0.6
    n = len(p)
    max_weight = max((n * pi / total) ** -beta for pi in p.values())  # over the whole buffer
    for _ in range(1500):
        batch = buffer.sample(32, beta)
        np.add.at(counts, batch.indices, 1)
        for i, w in zip(batch.indices, batch.weights.tolist(), strict=True):
            naive = (n * p[int(i)] / total) ** -beta / max_weight
            assert w == pytest.approx(naive, rel=1e-5)
        assert batch.weights.dtype == torch.float32 and (batch.weights <= 1.0).all()
    assert counts[probabilities == 0].sum() == 0  # slots without a complete transition: never
    statistic, limit = chi_square(counts, probabilities)
    assert statistic < limit, f"chi-square {statistic:.1f} above its {CHI2_QUANTILE} quantile {limit:.1f}"
    # the weight of the least likely transition is 1, if it is drawn; beta 0 gives weights of 1
    assert buffer.sample(32, 0.0).weights.eq(1.0).all()


def test_new_transitions_get_the_largest_priority_seen():
    """Also where a new transition lands on a slot whose old transition had a learned priority (small rings
    that wrap, and episode starts that write several slots in one step)."""
    buffer, streams = filled_buffer(num_envs=2, buffer_size=40, steps=30)
    live = live_leaves(buffer)
    assert np.allclose(buffer.tree.get(live), 1.0)  # before any update: the initial maximum, 1
    errors = np.linspace(0.0, 5.0, len(live))
    buffer.update_priorities(live, errors)
    np.testing.assert_allclose(buffer.tree.get(live), (errors + buffer.eps) ** buffer.alpha)
    top = (5.0 + buffer.eps) ** buffer.alpha
    assert buffer.max_priority == pytest.approx(top)
    low = (0.1 + buffer.eps) ** buffer.alpha
    buffer.update_priorities(live, np.full(len(live), 0.1))  # lower priorities do not lower the maximum
    before = [len(h) for h in streams.history]
    fill(buffer, streams, 6, np.random.default_rng(5))
    new_keys = {
        t["obs"].tobytes() + bytes([t["action"]]) for h, b in zip(streams.history, before, strict=True) for t in h[b:]
    }
    leaves = live_leaves(buffer)
    batch = buffer.gather(*np.divmod(leaves, buffer.capacity))
    is_new = [
        batch.observations[i].numpy().tobytes() + bytes([batch.actions[i].item()]) in new_keys
        for i in range(len(leaves))
    ]
    reused = np.isin(leaves[is_new], live)  # new transitions on slots that held a prioritized one
    assert sum(is_new) > 0 and reused.any() and not all(is_new)
    np.testing.assert_allclose(buffer.tree.get(leaves[is_new]), top)
    np.testing.assert_allclose(buffer.tree.get(leaves[np.logical_not(is_new)]), low)  # old ones keep theirs


@pytest.mark.parametrize("n_step", [1, 3])
@pytest.mark.parametrize("num_envs,buffer_size", [(3, 10_000), (2, 40), (3, 45)])
def test_only_complete_transitions_are_sampled_byte_exact_with_n_step_returns(n_step, num_envs, buffer_size):
    """Small rings wrap around many times: every slot whose stack was overwritten, whose first frames start an
    episode, or whose n-step return is not complete yet must have priority 0; every sampled transition is one
    the streams produced, with the naive n-step return, bootstrap observation, terminal and discount."""
    gamma = 0.9
    buffer, streams = filled_buffer(num_envs, buffer_size, n_step, steps=0, gamma=gamma)
    rng = np.random.default_rng(3)
    for _ in range(8):
        fill(buffer, streams, 40, rng)
        live = live_leaves(buffer)
        buffer.update_priorities(live, rng.exponential(size=len(live)))  # learned priorities, kept on refresh
        # the incrementally kept priorities agree with a from-scratch look at every slot
        envs, slots = np.divmod(np.arange(buffer.num_envs * buffer.capacity), buffer.capacity)
        np.testing.assert_array_equal(buffer.tree.get(np.arange(len(envs))) > 0, buffer.complete(envs, slots))
        expected = {}
        for history in streams.history:
            expected.update(naive_n_step(history, n_step, gamma))
        for _ in range(10):
            b = buffer.sample(32, 0.5)
            for i in range(32):
                k = b.observations[i].numpy().tobytes() + bytes([b.actions[i].item()])
                assert k in expected
                ret, next_obs, done, discount = expected[k]
                assert b.rewards[i].item() == pytest.approx(ret, abs=1e-5)
                assert b.next_observations[i].numpy().tobytes() == next_obs
                assert bool(b.dones[i].item()) == done
                assert b.discounts[i].item() == pytest.approx(discount, abs=1e-6)
    if buffer_size >= 10_000:  # nothing evicted: exactly the complete transitions are live
        assert len(live_leaves(buffer)) == len(expected)


def test_dead_indices_keep_priority_zero():
    buffer, streams = filled_buffer(num_envs=1, buffer_size=20, steps=10)
    old = buffer.sample(8, 0.4).indices
    fill(buffer, streams, 40, np.random.default_rng(9))  # the small ring wraps: old transitions are gone
    buffer.update_priorities(old, np.full(len(old), 3.0))
    envs, slots = np.divmod(np.arange(buffer.tree.size), buffer.capacity)
    np.testing.assert_array_equal(buffer.tree.get(np.arange(buffer.tree.size)) > 0, buffer.complete(envs, slots))


def test_checkpoint_state_round_trip_and_cut_episodes():
    """A buffer's ``state_dict`` holds its arrays and its sum tree's; a buffer loaded from it samples the same
    transitions with the same weights. Cutting the games in progress
    (a resume that does not continue them) completes their last n-step returns, which become sampleable at
    the largest priority."""
    buffer, _ = filled_buffer(num_envs=3, buffer_size=60, n_step=3, steps=50)
    live = live_leaves(buffer)
    buffer.update_priorities(live, np.random.default_rng(0).exponential(size=len(live)))
    copy = PrioritizedReplayBuffer(60, 3, (STACK, *FRAME), n_step=3, gamma=0.9, seed=123)
    copy.load_state_dict(buffer.state_dict())
    np.testing.assert_array_equal(copy.tree.sums, buffer.tree.sums)
    assert copy.max_priority == buffer.max_priority
    a, b = buffer.sample(16, 0.5), copy.sample(16, 0.5)
    np.testing.assert_array_equal(a.indices, b.indices)
    torch.testing.assert_close(a.weights, b.weights)
    torch.testing.assert_close(a.observations, b.observations)

    before = set(live_leaves(buffer))
    assert buffer.open.any()
    buffer.cut_episodes()
    envs, slots = np.divmod(np.arange(buffer.tree.size), buffer.capacity)
    np.testing.assert_array_equal(buffer.tree.get(np.arange(buffer.tree.size)) > 0, buffer.complete(envs, slots))
    completed = np.array(sorted(set(live_leaves(buffer)) - before))
    assert len(completed) > 0
    np.testing.assert_allclose(buffer.tree.get(completed), buffer.max_priority)


def test_buffer_refuses_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        PrioritizedReplayBuffer(100, 1, (STACK, *FRAME), alpha=-1.0)
    with pytest.raises(ValueError, match="eps"):
        PrioritizedReplayBuffer(100, 1, (STACK, *FRAME), eps=0.0)
    empty = PrioritizedReplayBuffer(100, 1, (STACK, *FRAME))
    with pytest.raises(ValueError, match="no complete transition"):
        empty.sample(4, 0.4)
    buffer, _ = filled_buffer(num_envs=1, steps=10)
    with pytest.raises(ValueError, match="beta"):
        buffer.sample(4, 1.5)
    live = live_leaves(buffer)[:3]
    buffer.update_priorities(live, np.array([2.0, 2.0, 2.0]))
    buffer.update_priorities(live, np.array([np.nan, np.inf, 0.5]))  # non-finite: left as they were
    np.testing.assert_allclose(buffer.tree.get(live), (np.array([2.0, 2.0, 0.5]) + buffer.eps) ** buffer.alpha)
    assert np.isfinite(buffer.tree.total()) and buffer.max_priority == pytest.approx((2.0 + buffer.eps) ** 0.6)
    with pytest.raises(ValueError, match="indices"):
        buffer.update_priorities(live, np.array([1.0]))


def test_state_dict_declares_the_tree_and_loads_back():
    """The prioritized buffer's state adds the sum tree and the largest priority to the replay fields, and loads
    into a buffer of the same settings (another alpha is refused)."""
    buffer, _ = filled_buffer(num_envs=2, buffer_size=40, n_step=1, steps=30)
    live = live_leaves(buffer)
    buffer.update_priorities(live, np.random.default_rng(1).exponential(size=len(live)))
    state = buffer.state_dict()
    assert set(state) == {*PrioritizedReplayBuffer.SETTINGS, *PrioritizedReplayBuffer.ARRAYS, "rng", "tree.sums",
                          "tree.mins", "max_priority"}  # fmt: skip
    copy = PrioritizedReplayBuffer(40, 2, (STACK, *FRAME), n_step=1, gamma=0.9, seed=7)
    copy.load_state_dict(state)
    np.testing.assert_array_equal(copy.tree.mins, buffer.tree.mins)
    np.testing.assert_array_equal(copy.sample(8, 0.4).indices, buffer.sample(8, 0.4).indices)
    wrong = PrioritizedReplayBuffer(40, 2, (STACK, *FRAME), n_step=1, gamma=0.9, alpha=0.9)
    with pytest.raises(ValueError, match="alpha is"):
        wrong.load_state_dict(state)
