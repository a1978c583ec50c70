"""The training protocol on real ALE games (tests/test_protocol.py checks it against reference wrappers)."""

import numpy as np
import pytest

from cleanrl_utils.envs import EnvIdError, TrainEnvs, check_env_id, play_episodes

GAME_ID, ROM = "SpaceInvadersNoFrameskip-v4", "space_invaders"


def play_one_game(seed: int, rng: np.random.Generator):
    """Random play through one whole game; every step's StepResult and the actions."""
    envs = TrainEnvs(GAME_ID, 1, seed=seed)
    obs = envs.reset()
    assert obs.shape == (1, 4, 84, 84) and obs.dtype == np.uint8
    steps, actions = [], []
    while True:
        rng.random(1)  # keeps the random stream aligned with play_episodes' epsilon draw for its game
        action = rng.integers(0, envs.n_actions, 1)
        step = envs.step(action)
        steps.append((obs, step))
        actions.append(int(action[0]))
        obs = step.next_obs
        if step.ends[0]:
            after = envs.step(np.zeros(1, dtype=np.int64))  # the autoreset step
            envs.close()
            return steps, actions, after


@pytest.fixture(scope="module")
def game():
    return play_one_game(seed=3, rng=np.random.default_rng(0).spawn(1)[0])  # play_episodes' game 0 generator


def test_life_loss_ends_the_learning_episode_but_not_the_game(game):
    steps, _, after = game
    dones = [bool(s.dones[0]) for _, s in steps]
    ends = [bool(s.ends[0]) for _, s in steps]
    assert sum(dones) == 3  # Space Invaders: three lives, each loss is a learning terminal
    assert ends == [False] * (len(steps) - 1) + [True] and dones[-1]
    masks = [bool(s.mask[0]) for _, s in steps]
    assert masks[:2] == [False, False]  # FIRE and action 2 pressed for the agent at the start
    for k, done in enumerate(dones[:-1]):  # the game goes on after a life loss: NOOP, FIRE, 2, then the agent
        if done:
            assert masks[k + 1 : k + 5] == [False, False, False, True]
    for (_, step), (next_obs, _) in zip(steps, steps[1:], strict=False):
        np.testing.assert_array_equal(next_obs, step.next_obs)
    assert not after.mask[0]  # the step after the game is the reset, not a transition
    assert after.episode_returns == []


def test_rewards_are_clipped_for_learning_and_the_logged_return_is_the_raw_game(game):
    steps, _, _ = game
    raw = np.array([s.raw_rewards[0] for _, s in steps])
    clipped = np.array([s.rewards[0] for _, s in steps])
    assert raw.max() > 1  # Space Invaders pays 5 to 30 per invader
    np.testing.assert_array_equal(clipped, np.sign(raw))
    [(env, episodic_return, length)] = steps[-1][1].episode_returns
    assert episodic_return == raw.sum() and length == len(steps)


def test_evaluation_plays_the_same_whole_game_with_raw_score(game):
    steps, _, _ = game
    [(_, train_return, train_length)] = steps[-1][1].episode_returns
    returns, lengths, histogram = play_episodes(
        GAME_ID,
        1,
        seed=3,
        select_actions=lambda obs: np.zeros(1),
        n_actions=6,
        epsilon=1.0,
        rng=np.random.default_rng(0),
    )
    assert returns == [train_return] and lengths == [train_length]
    assert histogram.sum() == sum(bool(s.mask[0]) for _, s in steps)  # the agent's own actions only


# slow: 27,000 steps of Montezuma (36 s); CI keeps the cap through test_protocol.py's Breakout that never fires,
# the same TrainEnvs time limit (a truncation, not a terminal, at 27,000 steps)
@pytest.mark.slow
def test_time_limit_is_108k_frames_a_truncation_not_a_terminal():
    # Montezuma's Revenge with NOOP only: Panama Joe stands on his ledge, loses no life and the
    # game never ends by itself, so it runs into the 108,000-frame (27,000-step) cap.
    envs = TrainEnvs("MontezumaRevengeNoFrameskip-v4", 1, seed=0)
    envs.reset()
    noop = np.zeros(1, dtype=np.int64)
    length = 0
    while True:
        step = envs.step(noop)
        length += 1
        if step.ends[0]:
            break
    envs.close()
    assert step.truncations[0] and not step.dones[0]
    assert 26_960 <= length <= 27_000
    assert step.episode_returns[0][2] == length


@pytest.mark.parametrize(
    "env_id,hint",
    [
        ("BreakoutNoFrameskp-v4", "BreakoutNoFrameskip-v4"),
        ("ALE/Pong-v5", "PongNoFrameskip-v4"),
        ("Pongg", "did you mean PongNoFrameskip-v4"),
        ("Breakout-v5", r"did you mean BreakoutNoFrameskip-v4(, \w+NoFrameskip-v4)*\?$"),  # no FrozenLake-v1
        ("tests.toy_envs:ImageBandt-v0", r"did you mean tests\.toy_envs:ImageBandit-v0[,?]"),
    ],
)
def test_unknown_or_unsuitable_ids_are_refused_with_close_matches(env_id, hint):
    with pytest.raises(EnvIdError, match=hint):
        check_env_id(env_id)


def test_toy_ids_with_a_module_prefix_are_accepted():
    check_env_id("tests.toy_envs:ImageBandit-v0")


def obs_policy(n_actions: int, forwarded: list[int]):
    """A deterministic policy of the observation alone (no network), counting the rows it is given."""

    def select_actions(obs: np.ndarray) -> np.ndarray:
        forwarded.append(len(obs))
        return (obs.reshape(len(obs), -1).astype(np.int64).sum(axis=1) // 7) % n_actions

    return select_actions


DOPAMINE = {"forced_steps": False, "zero_stacks": True, "noop_starts": "steps"}  # today's Dopamine runner's protocol


@pytest.mark.parametrize(
    "env_id,n_actions,protocol",
    [
        ("BreakoutNoFrameskip-v4", 4, {}),
        ("BreakoutNoFrameskip-v4", 4, DOPAMINE),
        ("tests.toy_envs:DelayedImage-v0", 2, {}),
    ],
)
def test_each_evaluation_game_is_the_same_however_many_are_played_at_a_time(env_id, n_actions, protocol):
    """Game i is seeded seed + i and explores with its own generator, so playing 5 games one, two or all at a
    time gives the same games (later games start in a slot another game left, by TrainEnvs.restart), and only
    the games being played are forwarded: as many rows as the games have steps, not games x longest game. With
    drq.py's protocol too, whose no-op steps each game draws from its own seed."""
    results = {}
    for parallel in (5, 2, 1):
        forwarded: list[int] = []
        rng = np.random.default_rng(4)
        results[parallel] = play_episodes(env_id, 5, 11, obs_policy(n_actions, forwarded), n_actions, 0.3, rng,
                                          parallel=parallel, **protocol)  # fmt: skip
        returns, lengths, histogram = results[parallel]
        assert sum(forwarded) == sum(lengths) and max(forwarded) == parallel
    returns, lengths, histogram = results[5]
    assert len(set(zip(returns, lengths, strict=True))) > 1  # games that differ: a pool that mixed them up would show
    for parallel in (2, 1):
        assert results[parallel][:2] == (returns, lengths)
        np.testing.assert_array_equal(results[parallel][2], histogram)


@pytest.mark.parametrize("parallel", [5, 2])
def test_each_evaluation_game_is_shown_as_it_ends_with_its_return_and_length(parallel):
    """``on_game_end`` is called once per game, at the step the game ends, in the order the games end, with the
    return and length play_episodes returns for it: what a run prints while a long evaluation plays."""
    forwarded: list[int] = []  # one entry per step of the pool: len(forwarded) is the steps played so far
    ended: list[tuple[int, int, float, int, int]] = []
    returns, lengths, _ = play_episodes(
        "BreakoutNoFrameskip-v4", 5, 11, obs_policy(4, forwarded), 4, 0.3, np.random.default_rng(4),
        parallel=parallel, on_game_end=lambda game, count, r, length: ended.append((game, count, r, length, len(forwarded))),
    )  # fmt: skip
    assert sorted(game for game, *_ in ended) == [0, 1, 2, 3, 4]
    assert [count for _, count, *_ in ended] == [1, 2, 3, 4, 5]  # how many have ended, this one included
    assert [(r, length) for game, _, r, length, _ in ended] == [(returns[game], lengths[game]) for game, *_ in ended]
    at = [step for *_, step in ended]
    assert at == sorted(at) and at[-1] == len(forwarded)  # as they end; the last one ends the evaluation
    if parallel == 5:  # all started at the first step: each shows at the step its length says it ended
        assert len(set(lengths)) > 1 and all(step == lengths[game] for game, _, _, _, step in ended)


def test_a_restarted_game_is_the_game_its_seed_starts_in_a_fresh_environment():
    # Breakout game seeded 9, started in slot 1 after another game was played there for a while, against
    # the same game started alone by a reset: same stacks and lives, step by step, FIRE pressed for both.
    actions = np.random.default_rng(1).integers(0, 4, 300)
    alone = TrainEnvs("BreakoutNoFrameskip-v4", 1, seed=9)
    expected = [alone.reset()[0]]
    for action in actions:
        expected.append(alone.step(np.array([action])).next_obs[0].copy())
    alone.close()
    pool = TrainEnvs("BreakoutNoFrameskip-v4", 2, seed=100)
    pool.reset()
    for _ in range(40):
        pool.step(np.array([1, 3]))
    got = [pool.restart(np.array([False, True]), np.array([9]))[1].copy()]
    assert pool.lengths[1] == 0 and pool.returns[1] == 0 and pool.forced_actions[1, 0] == 1  # FIRE first
    for action in actions:
        got.append(pool.step(np.array([0, action])).next_obs[1].copy())
    pool.close()
    for step, (frame, reference) in enumerate(zip(got, expected, strict=True)):
        np.testing.assert_array_equal(frame, reference, err_msg=f"step {step}")
