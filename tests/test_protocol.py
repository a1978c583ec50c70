"""The game as CleanRL plays it, checked against an independent reference.

The reference is Gymnasium's own AtariPreprocessing (frame skip 4 with max-pool, 84x84 grayscale)
with EpisodicLifeEnv and FireResetEnv written here as OpenAI baselines and SB3 write them, composed
as CleanRL's ``make_env`` composes them (FireResetEnv around EpisodicLifeEnv), under a frame stack
that starts with the first frame four times. CleanRL converts to grayscale and resizes with its own
wrappers, which do not match ale-py's C++ path byte for byte; AtariPreprocessing does the same
operations in the same order as ale-py (ALE's grayscale palette, max-pool, cv2 INTER_AREA), so the
comparison is byte-exact: every observation the agent acts on, every clipped reward, every learning
terminal and every whole game's return and length, for one game at a time and for several at once.

No-op starts, as ale-py plays them (and baselines' NoopResetEnv, beneath the frame skip): after a
game's reset, 0 to NOOP_MAX (30) raw frames of NOOP, drawn from the sub-environment's own generator
(seeded by TrainEnvs' reset, ``seed + i`` for game i, and not reseeded at autoresets); then FIRE
and 2 where the game has FIRE. CleanRL draws 1 to 30 (docs/protocol.md). The reference plays
the same counts, read from a twin vector environment seeded alike, so its stacks can be compared
byte for byte too; the range and spread of the draws are checked on their own.
"""

from collections.abc import Iterable, Iterator

import cv2
import gymnasium as gym
import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.envs import NOOP, NOOP_MAX, TrainEnvs, make_vector_env, play_episodes
from cleanrl_utils.evaluation import evaluate


class EpisodicLife(gym.Wrapper):
    """A life loss is a terminal; the game goes on, after one no-op step, at the next reset."""

    def __init__(self, env):
        super().__init__(env)
        self.lives = 0
        self.was_real_done = True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.was_real_done = terminated or truncated
        lives = self.env.unwrapped.ale.lives()
        if 0 < lives < self.lives:
            terminated = True
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        if self.was_real_done:
            obs, info = self.env.reset(**kwargs)
        else:
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        self.lives = self.env.unwrapped.ale.lives()
        return obs, info


class FireReset(gym.Wrapper):
    """Games that wait for FIRE: press it, then action 2, at every reset."""

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        obs, _, terminated, truncated, _ = self.env.step(1)
        if terminated or truncated:
            self.env.reset(**kwargs)
        obs, _, terminated, truncated, info = self.env.step(2)
        if terminated or truncated:
            self.env.reset(**kwargs)
        return obs, info


class NoopFrames(gym.Wrapper):
    """NoopResetEnv where baselines and CleanRL put it, on the raw game beneath the frame skip, with given
    counts instead of its own draws: the n-th game start plays ``counts[n]`` frames of NOOP."""

    def __init__(self, env, counts: Iterable[int]):
        super().__init__(env)
        self.counts: Iterator[int] = iter(counts)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        for _ in range(next(self.counts)):
            obs, _, terminated, truncated, info = self.env.step(NOOP)
            assert not (terminated or truncated)  # no game ends within 30 frames of its start
        return obs, info


def reference_env(env_id: str, noop_frames: Iterable[int] | None = None) -> gym.Env:
    env = gym.make(env_id)  # NoFrameskip-v4: one frame per step, no sticky actions
    if noop_frames is not None:
        env = NoopFrames(env, noop_frames)
    env = gym.wrappers.AtariPreprocessing(env, noop_max=0, frame_skip=4, screen_size=84, grayscale_obs=True)
    env = gym.wrappers.RecordEpisodeStatistics(env)  # whole games, raw score, every step counted
    env = EpisodicLife(env)
    if env.unwrapped.get_action_meanings()[1] == "FIRE":
        env = FireReset(env)
    return gym.wrappers.FrameStackObservation(env, 4)  # padding "reset": the first frame four times


class CleanRLFrames(gym.Wrapper):
    """CleanRL's own pixels: MaxAndSkipEnv over RGB screens, then resize (INTER_AREA) and RGB-to-gray."""

    def __init__(self, env):
        super().__init__(env)
        self.screens = np.zeros((2, 210, 160, 3), dtype=np.uint8)

    @staticmethod
    def frame(rgb: np.ndarray) -> np.ndarray:
        return cv2.cvtColor(cv2.resize(rgb, (84, 84), interpolation=cv2.INTER_AREA), cv2.COLOR_RGB2GRAY)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self.frame(obs), info

    def step(self, action):
        total = 0.0
        for k in range(4):
            obs, reward, terminated, truncated, info = self.env.step(action)
            if k >= 2:
                self.screens[k - 2] = obs
            total += reward
            if terminated or truncated:
                break
        return self.frame(self.screens.max(axis=0)), total, terminated, truncated, info


def agent_acts_next(envs: TrainEnvs, i: int = 0) -> bool:
    return envs.forced_actions[i, 0] < 0 and not envs.pending_reset[i]


@pytest.mark.parametrize(
    "env_id,games",
    [
        ("BreakoutNoFrameskip-v4", 3),  # FIRE, 5 lives
        ("SpaceInvadersNoFrameskip-v4", 2),  # FIRE, 3 lives
        ("MsPacmanNoFrameskip-v4", 1),  # no FIRE: a no-op after each life loss only
        ("PongNoFrameskip-v4", 1),  # FIRE, no lives
    ],
)
def test_same_game_as_the_reference_wrappers_step_by_step(env_id, games):
    ours = TrainEnvs(env_id, 1, seed=3, noop_max=0)
    reference = reference_env(env_id)
    rng = np.random.default_rng(0)
    obs = ours.reset()
    ref_obs, _ = reference.reset(seed=3)
    finished = life_losses = forced = 0
    while finished < games:
        while not agent_acts_next(ours):  # the reference does these steps inside its reset
            step = ours.step(np.zeros(1, dtype=np.int64))
            assert not step.mask[0] and not step.dones[0] and not step.ends[0]
            obs = step.next_obs
            forced += 1
        np.testing.assert_array_equal(obs[0], ref_obs)  # the observation the agent acts on
        action = int(rng.integers(ours.n_actions))
        step = ours.step(np.array([action]))
        ref_obs, reward, terminated, truncated, info = reference.step(action)
        assert step.mask[0]
        np.testing.assert_array_equal(step.next_obs[0], ref_obs)
        assert step.raw_rewards[0] == reward and step.rewards[0] == np.sign(reward)
        assert step.dones[0] == terminated and step.truncations[0] == truncated
        assert step.ends[0] == ("episode" in info)
        if step.ends[0]:
            [(_, episodic_return, length)] = step.episode_returns
            assert episodic_return == info["episode"]["r"] and length == info["episode"]["l"]
            finished += 1
        life_losses += int(step.dones[0] and not step.ends[0])
        if terminated or truncated:
            ref_obs, _ = reference.reset()
        obs = step.next_obs
    ours.close()
    reference.close()
    if env_id != "PongNoFrameskip-v4":
        assert life_losses > 0  # the comparison went through lives lost, not only game starts
    assert forced > 0


def play_against_references(ours: TrainEnvs, references: list[gym.Env], games: int) -> dict[str, np.ndarray]:
    """Play every game of ``ours`` against its own reference, step by step, until each has finished ``games``
    whole games and one has acted in a later game than another (past its autoreset). Each game takes its
    actions from its own stream, drawn only when its agent acts, so the games drift apart and each reference
    can replay its game alone; the steps the protocol plays for the agent (forced steps, the autoreset after
    a game ends) get random actions, which must be ignored. Game i's reference is seeded ``seed + i``, as
    ale-py seeds sub-environment i (Gymnasium derives another ALE seed from it; without sticky actions the
    game does not depend on it, only the no-op draws, which the references are given). ale-py returns results
    in sub-environment order (its ``batch_size`` is ``num_envs``), which TrainEnvs relies on: sending actions to
    the wrong games, or results read back from the wrong ones, fails."""
    n = ours.num_envs
    streams = [np.random.default_rng([1, i]) for i in range(n)]
    ignored = np.random.default_rng(2)
    obs = ours.reset()
    ref_obs = [reference.reset(seed=ours.seed + i)[0] for i, reference in enumerate(references)]
    finished = np.zeros(n, dtype=np.int64)
    life_losses = np.zeros(n, dtype=np.int64)
    forced = np.zeros(n, dtype=np.int64)
    lengths: list[list[int]] = [[] for _ in range(n)]
    ahead = 0  # most whole games a game was ahead of another while its agent acted
    for _ in range(20_000):
        if finished.min() >= games and ahead >= 1:  # and a game played on, past an autoreset, beside another
            break
        acts = np.array([agent_acts_next(ours, i) for i in range(n)])
        actions = ignored.integers(ours.n_actions, size=n)
        for i in np.flatnonzero(acts):
            np.testing.assert_array_equal(obs[i], ref_obs[i], err_msg=f"game {i}")  # what the agent acts on
            actions[i] = streams[i].integers(ours.n_actions)
        step = ours.step(actions)
        np.testing.assert_array_equal(step.mask, acts)
        ended = {i: (episodic_return, length) for i, episodic_return, length in step.episode_returns}
        assert sorted(ended) == np.flatnonzero(step.ends).tolist()
        for i in range(n):
            if not acts[i]:  # the reference plays these steps inside its reset
                assert not step.dones[i] and not step.ends[i]
                forced[i] += 1
                continue
            ahead = max(ahead, int(finished[i] - finished.min()))
            ref_obs[i], reward, terminated, truncated, info = references[i].step(int(actions[i]))
            np.testing.assert_array_equal(step.next_obs[i], ref_obs[i], err_msg=f"game {i}")
            assert step.raw_rewards[i] == reward and step.rewards[i] == np.sign(reward)
            assert step.dones[i] == terminated and step.truncations[i] == truncated
            assert step.ends[i] == ("episode" in info)
            if step.ends[i]:
                assert ended[i] == (info["episode"]["r"], info["episode"]["l"])
                lengths[i].append(ended[i][1])
                finished[i] += 1
            life_losses[i] += int(step.dones[i] and not step.ends[i])
            if terminated or truncated:
                ref_obs[i], _ = references[i].reset()
        obs = step.next_obs
    else:
        raise AssertionError(f"{finished} whole games, {ahead} ahead, after 20,000 steps")
    ours.close()
    for reference in references:
        reference.close()
    first_lengths = np.array([game_lengths[0] for game_lengths in lengths])
    return dict(life_losses=life_losses, forced=forced, first_lengths=first_lengths)


@pytest.mark.parametrize(
    "env_id,num_envs",
    [("BreakoutNoFrameskip-v4", 3), ("MsPacmanNoFrameskip-v4", 2)],  # FIRE; none
)
def test_several_games_at_once_each_the_reference_game(env_id, num_envs):
    # Several games in one vector environment, each against its own reference, including a game that plays
    # on into its next game (autoreset) while others are still in their first.
    ours = TrainEnvs(env_id, num_envs, seed=3, noop_max=0)
    played = play_against_references(ours, [reference_env(env_id) for _ in range(num_envs)], games=1)
    assert (played["life_losses"] > 0).all() and (played["forced"] > 0).all()
    assert len(set(played["first_lengths"])) > 1  # the games drifted apart


def noop_draws(env_id: str, num_envs: int, seed: int, resets: int) -> np.ndarray:
    """The no-op frames each game start of ``TrainEnvs(env_id, num_envs, seed)`` plays, (resets, num_envs):
    a twin vector environment seeded as TrainEnvs seeds its own, then reset unseeded, as an autoreset is
    (each reset draws once from its sub-environment's generator). ale-py reports the frames played since
    the game's reset as ``episode_frame_number``."""
    twin = make_vector_env(env_id, num_envs)
    draws = [twin.reset(seed=seed)[1]["episode_frame_number"]]
    draws += [twin.reset()[1]["episode_frame_number"] for _ in range(resets - 1)]
    twin.close()
    return np.array(draws)


@pytest.mark.parametrize("env_id,num_envs", [("BreakoutNoFrameskip-v4", 4), ("MsPacmanNoFrameskip-v4", 2)])
def test_noop_starts_each_game_the_reference_game_after_as_many_noop_frames(env_id, num_envs):
    # With no-op starts on, each game equals its reference when that reference plays, at each of its game
    # starts, as many raw NOOP frames (beneath the frame skip) as ale-py drew: every stack, from the first,
    # and through autoresets, which draw again. In both games one frame more or fewer gives another first
    # stack already, so the counts are pinned exactly.
    seed = 11
    draws = noop_draws(env_id, num_envs, seed, resets=16)
    ours = TrainEnvs(env_id, num_envs, seed=seed)  # its own no-op setting (NOOP_MAX), drawn as the twin's
    references = [reference_env(env_id, noop_frames=draws[:, i].tolist()) for i in range(num_envs)]
    played = play_against_references(ours, references, games=1)
    assert len(set(draws[0])) > 1 and len(set(draws[1])) > 1  # the games started apart, and restarted apart
    assert (played["life_losses"] > 0).all()


@pytest.mark.parametrize("env_id", ["BreakoutNoFrameskip-v4", "MsPacmanNoFrameskip-v4"])
def test_cleanrl_own_pixels_differ_only_slightly(env_id):
    # CleanRL max-pools RGB screens and converts after resizing; ale-py converts each screen with
    # ALE's grayscale palette first. Same game, same rewards and terminals; pixels differ by palette
    # rounding (1 level) and, where two colours of one gray swap, by the max-pool (up to ~40 levels in
    # Ms. Pac-Man). Measured over random play: under 0.2 gray levels on average, under 10% of pixels.
    ours = TrainEnvs(env_id, 1, seed=3, noop_max=0)
    reference = EpisodicLife(CleanRLFrames(gym.make(env_id)))
    if ours.fire:
        reference = FireReset(reference)
    rng = np.random.default_rng(0)
    obs = ours.reset()
    frame, _ = reference.reset(seed=3)
    differences = []
    while True:
        while not agent_acts_next(ours):
            obs = ours.step(np.zeros(1, dtype=np.int64)).next_obs
        differences.append(np.abs(obs[0, -1].astype(np.int64) - frame))
        action = int(rng.integers(ours.n_actions))
        step = ours.step(np.array([action]))
        frame, reward, terminated, truncated, _ = reference.step(action)
        assert step.raw_rewards[0] == reward and step.dones[0] == terminated
        obs = step.next_obs
        if step.ends[0]:
            break
        if terminated:
            frame, _ = reference.reset()
    ours.close()
    differences = np.stack(differences)
    assert len(differences) > 100
    assert differences.mean() < 0.2 and (differences > 0).mean() < 0.1 and differences.max() <= 64


def test_no_stack_spans_two_lives_and_fire_is_pressed_after_each_life_loss():
    envs = TrainEnvs("BreakoutNoFrameskip-v4", 1, seed=0)
    obs = envs.reset()
    pressed, lives_lost = [], 0
    while True:
        sent = envs.forced_actions[0, 0]
        step = envs.step(np.zeros(1, dtype=np.int64))
        if sent >= 0:
            pressed.append(int(sent))
        if step.dones[0] and not step.ends[0]:
            lives_lost += 1
        if agent_acts_next(envs) and not step.mask[0]:  # the first observation of a life: one frame, four times
            assert all(np.array_equal(step.next_obs[0, k], step.next_obs[0, -1]) for k in range(3))
        if step.ends[0]:
            break
        obs = step.next_obs
    envs.close()
    assert lives_lost == 4
    assert pressed == [1, 2] + [0, 1, 2] * 4  # FIRE, 2 at the start; NOOP, FIRE, 2 after each life loss
    assert obs.shape == (1, 4, 84, 84)


def test_always_noop_breakout_ends_by_itself_well_before_the_cap():
    envs = TrainEnvs("BreakoutNoFrameskip-v4", 1, seed=0)
    envs.reset()
    length = 0
    while True:
        step = envs.step(np.zeros(1, dtype=np.int64))
        length += 1
        if step.ends[0]:
            break
    envs.close()
    assert not step.truncations[0] and envs.lives[0] == 0  # all five lives played out, no time limit
    assert length < 3_000 and step.episode_returns[0][2] == length


def test_evaluating_a_constant_policy_on_breakout_plays_short_whole_games():
    # A barely trained agent often repeats one action: each game must still end by itself, quickly.
    for action in range(4):
        returns, lengths, histogram = play_episodes(
            "BreakoutNoFrameskip-v4", 4, 7, lambda obs, a=action: np.full(len(obs), a), 4, 0.0, np.random.default_rng(0)
        )
        assert max(lengths) < 3_000, (action, lengths)
        assert histogram[action] == histogram.sum() > 0  # forced steps are not counted as the agent's


def test_without_forced_steps_nothing_is_pressed_and_a_breakout_that_never_fires_runs_to_the_cap():
    """Dopamine's Atari 100k presses nothing for the agent (drq.py's default): every played step is the agent's own
    transition, and an agent that never presses FIRE waits, its lives intact, until the 27,000-step cap"""
    envs = TrainEnvs("BreakoutNoFrameskip-v4", 1, seed=0, forced_steps=False)
    envs.reset()
    length = 0
    while True:
        assert envs.forced_actions[0, 0] < 0
        step = envs.step(np.zeros(1, dtype=np.int64))
        length += 1
        assert step.mask[0]  # the agent's own action, every step
        if step.ends[0]:
            break
    envs.close()
    assert step.truncations[0] and not step.dones[0] and envs.lives[0] == 5
    assert length == 27_000 and step.episode_returns == [(0, 0.0, 27_000)]


@pytest.mark.parametrize("forced_steps", [True, False])
def test_the_evaluation_counts_every_step_as_the_agents_only_without_forced_steps(forced_steps):
    returns, lengths, histogram = play_episodes(
        "BreakoutNoFrameskip-v4", 3, 7, lambda obs: np.full(len(obs), 1), 4, 0.0, np.random.default_rng(0),
        forced_steps=forced_steps,
    )  # fmt: skip
    assert histogram[1] == histogram.sum()  # always FIRE: the ball is launched either way
    lives_lost = 4 * len(lengths)  # each game plays its 5 lives out
    forced = 2 * len(lengths) + 3 * lives_lost  # FIRE, 2 at the start; NOOP, FIRE, 2 after each life loss
    assert histogram.sum() == sum(lengths) - (forced if forced_steps else 0)


def test_noop_starts_draw_0_to_30_frames_uniformly():
    # 512 game starts: 4 games seeded 1000 to 1003, then unseeded resets, as autoresets are, which continue
    # each game's generator (few games: each loads its ROM twice, the costly part). ale-py's
    # episode_frame_number at a reset is the count of no-op frames played: test_noop_starts_each_game_...
    # plays each reference with that many and finds every stack equal, and one more or fewer differs. Each of the 31 counts is expected 16.5 times:
    # a draw from 1 to 30 or 0 to 29 fails, and a correct one misses an end with chance (30/31)^512 = 5e-8;
    # a constant draw fails, and so does a skewed one (chi-square, 30 degrees of freedom).
    assert NOOP_MAX == 30  # the protocol's number (Nature DQN, CleanRL)
    draws = noop_draws("BreakoutNoFrameskip-v4", 4, seed=1000, resets=128).ravel()
    assert min(draws) == 0 and max(draws) == NOOP_MAX and len(set(draws)) == NOOP_MAX + 1
    assert stats.chisquare(np.bincount(draws, minlength=NOOP_MAX + 1)).pvalue > 1e-3


class Scale(nn.Module):
    def forward(self, obs):
        return obs.float() / 255.0


def test_the_recorded_video_is_the_first_scored_game_and_changes_nothing(tmp_path):
    # --capture-video records the first of the evaluation's games as it is scored (through the same
    # TrainEnvs), not one more game: the result is the same with and without it, and the video has a
    # frame per step of that game plus its first frame. A random linear network with epsilon 0.2
    # draws from the evaluation's generator at every step, so any extra draw would change the games.
    torch.manual_seed(0)
    q_network = nn.Sequential(Scale(), nn.Flatten(), nn.Linear(4 * 84 * 84, 4))
    env_id, device = "BreakoutNoFrameskip-v4", torch.device("cpu")
    plain = evaluate(q_network, env_id, 4, device, episodes=3, epsilon=0.2, seed=23)
    path = tmp_path / "videos" / "eval_step_0.mp4"
    recorded = evaluate(q_network, env_id, 4, device, episodes=3, epsilon=0.2, seed=23, video_path=path)
    assert recorded == plain
    first, *others = plain["episodic_lengths"]
    assert first not in others  # the video's length is game 0's alone
    video = cv2.VideoCapture(str(path))
    frames = 0
    while True:
        ok, frame = video.read()
        if not ok:
            break
        assert frame.shape == (336, 336, 3)
        frames += 1
    video.release()
    assert frames == plain["episodic_lengths"][0] + 1


def test_play_episodes_records_the_frames_game_0_is_played_on():
    # The frames given to ``record`` are the newest frame of game 0's stacks, from its reset to its last
    # step: the same game as one played alone with the same seed and actions (a constant policy, no
    # exploration; ale-py seeds sub-environment i with seed + i).
    frames = []
    returns, lengths, _ = play_episodes(
        "BreakoutNoFrameskip-v4",
        3,
        5,
        lambda obs: np.full(len(obs), 3),
        4,
        0.0,
        np.random.default_rng(0),
        record=frames.append,
    )
    alone = TrainEnvs("BreakoutNoFrameskip-v4", 1, seed=5)
    expected = [alone.reset()[0, -1].copy()]
    while True:
        step = alone.step(np.array([3]))
        expected.append(step.next_obs[0, -1].copy())
        if step.ends[0]:
            break
    alone.close()
    assert len(frames) == lengths[0] + 1 == len(expected)
    assert step.episode_returns[0][1:] == (returns[0], lengths[0])
    for frame, reference in zip(frames, expected, strict=True):
        np.testing.assert_array_equal(frame, reference)


def dopamine_states(frames: list[np.ndarray], starts: list[bool]) -> list[np.ndarray]:
    """The stacks Dopamine's agent acts on, from each step's single newest frame and whether a game or a life starts
    there: ``_reset_state`` fills the state with zeros at ``begin_episode`` (labs/atari_100k/atari_100k_rainbow_agent.py
    lines 276-303), which the runner calls at a game's start and after every terminal, a life loss with
    ``terminal_on_life_loss`` (discrete_domains/run_experiment.py, ``_run_one_episode``), and ``_record_observation``
    rolls each new frame in"""
    state, states = np.zeros((4, 84, 84), dtype=np.uint8), []
    for frame, start in zip(frames, starts, strict=True):
        state = np.zeros_like(state) if start else state
        state = np.concatenate([state[1:], frame[None]])
        states.append(state)
    return states


def test_zero_stacks_start_games_and_lives_as_dopamines_agent_and_the_replay_memory_rebuilds_them():
    """drq.py's default protocol (no forced steps, zero-filled stacks) on Breakout at random play: every stack acted
    on is Dopamine's agent's state, and every transition the replay memory gives back has Dopamine's stacks: s
    exactly, s' exactly but at a terminal, where only its newest frame counts (discount 0)"""
    envs = TrainEnvs("BreakoutNoFrameskip-v4", 2, seed=4, noop_starts="steps", forced_steps=False, zero_stacks=True)
    rb = ReplayBuffer(10_000, 2, n_step=1, seed=0)
    rng = np.random.default_rng(1)
    obs = envs.reset()
    frames = [[obs[i, -1].copy()] for i in range(2)]
    starts = [[True] for _ in range(2)]
    acted = [[obs[i].copy()] for i in range(2)]
    transitions = [[] for _ in range(2)]  # (index of s in acted, terminal)
    for _ in range(1_500):
        step = envs.step(rng.integers(0, envs.n_actions, 2))
        rb.add(obs, step.next_obs, np.zeros(2), step.rewards, step.dones, step.ends, step.mask)
        for i in range(2):
            if step.mask[i]:
                transitions[i].append((len(acted[i]) - 1, bool(step.dones[i])))
            # a new game after an autoreset, a new life after a life loss that did not end the game
            frames[i].append(step.next_obs[i, -1].copy())
            starts[i].append(bool(not step.mask[i] or (step.dones[i] and not step.ends[i])))
            acted[i].append(step.next_obs[i].copy())
        obs = step.next_obs
    envs.close()
    terminals = 0
    for i in range(2):
        expected = dopamine_states(frames[i], starts[i])
        assert all(np.array_equal(a, e) for a, e in zip(acted[i], expected, strict=True))
        assert sum(starts[i]) > 8  # games and lives started: zero-filled stacks were acted on
        valid = np.flatnonzero(rb.valid[i])
        assert len(valid) == len(transitions[i])
        batch = rb.gather(np.full(len(valid), i), valid)
        for k, (t, terminal) in enumerate(transitions[i]):
            assert np.array_equal(batch.observations[k].numpy(), expected[t])
            if terminal:
                assert batch.discounts[k] == 0 and np.array_equal(
                    batch.next_observations[k, -1].numpy(), expected[t + 1][-1]
                )
            else:
                assert np.array_equal(batch.next_observations[k].numpy(), expected[t + 1])
        terminals += sum(terminal for _, terminal in transitions[i])
    assert terminals > 8


@pytest.mark.parametrize("zero_stacks", [True, False])
def test_the_evaluation_plays_zero_filled_stacks_at_each_game_and_life_start(zero_stacks):
    """the evaluation plays the training's protocol: with zero stacks, each Breakout game (5 lives, played out at
    random) shows its agent a stack of three black frames exactly 5 times, at its start and after each life loss"""
    seen = []

    def policy(obs):
        seen.extend(obs)
        return np.random.default_rng(len(seen)).integers(0, 4, len(obs))

    returns, lengths, _ = play_episodes(
        "BreakoutNoFrameskip-v4", 3, 5, policy, 4, 1.0, np.random.default_rng(0),
        forced_steps=False, zero_stacks=zero_stacks,
    )  # fmt: skip
    assert len(seen) == sum(lengths)
    blank = sum(not stack[:3].any() and stack[3].any() for stack in seen)
    assert blank == (5 * 3 if zero_stacks else 0)


def test_noop_starts_in_agent_steps_press_0_to_29_noops_before_the_agent_plays():
    """Dopamine's Atari 100k runner (labs/atari_100k/atari_100k_runner.py lines 204-212) starts each game with
    ``jax.random.randint(rng, (), 0, 30)`` calls of ``env.step(0)``: 0 to 29 NOOP agent steps of 4 frames. With
    ``noop_starts="steps"`` each game starts with that many steps pressed for the agent (not transitions, whatever
    it sends), drawn by the game's own generator: 128 games (32 rounds of 4 restarted at once) draw every count from
    0 to 29 and evenly, the same seed draws the same count in another environment, and the game then stands where
    a game without no-ops stands after as many NOOP steps of its agent"""
    from cleanrl_utils.envs import NOOP_STEPS_MAX

    def noops_then_agent(envs):
        """steps the games (their agents pressing FIRE) until each agent acts: per game, the no-op steps pressed
        for it, and the newest frame it then sees"""
        counts, first = np.zeros(envs.num_envs, dtype=int), np.zeros((envs.num_envs, 84, 84), dtype=np.uint8)
        waiting = np.ones(envs.num_envs, dtype=bool)
        while True:
            acting = waiting & (envs.forced_actions[:, 0] < 0)  # nothing more pressed for it: it acts next
            first[acting], waiting = envs.stacks[acting, -1], waiting & ~acting
            if not waiting.any():
                return counts, first
            pressed = envs.forced_actions[:, 0].copy()
            step = envs.step(np.full(envs.num_envs, 1))
            assert (pressed[waiting] == NOOP).all() and not step.mask[waiting].any() and not step.ends.any()
            counts[waiting] += 1

    assert NOOP_STEPS_MAX == 29
    envs = TrainEnvs("PongNoFrameskip-v4", 4, seed=0, forced_steps=False, zero_stacks=True, noop_starts="steps")
    envs.reset()
    draws, frames = [], {}
    for round_ in range(32):
        seeds = 1000 + 4 * round_ + np.arange(4)
        envs.restart(np.ones(4, dtype=bool), seeds)
        counts, first = noops_then_agent(envs)
        draws += counts.tolist()
        frames.update({int(seed): (int(k), f) for seed, k, f in zip(seeds, counts, first, strict=True)})
    envs.close()
    assert min(draws) == 0 and max(draws) == NOOP_STEPS_MAX and len(set(draws)) == NOOP_STEPS_MAX + 1
    assert stats.chisquare(np.bincount(draws, minlength=NOOP_STEPS_MAX + 1)).pvalue > 1e-3
    # game 1005 in environment 0 of another vector: the same count and the same frame
    other = TrainEnvs("PongNoFrameskip-v4", 1, seed=1005, forced_steps=False, noop_starts="steps")
    other.reset()
    (count,), (frame,) = noops_then_agent(other)
    other.close()
    assert count == frames[1005][0] and np.array_equal(frame, frames[1005][1])
    # and the games without no-op frames, their agent pressing NOOP as many steps: the same frame each time
    checked = 0
    for seed in (1000, 1001, 1002, 1003, 1004, 1005):
        count, frame = frames[seed]
        plain = TrainEnvs("PongNoFrameskip-v4", 1, seed=seed, noop_max=0, forced_steps=False)
        obs = plain.reset()
        for _ in range(count):
            obs = plain.step(np.array([NOOP])).next_obs
        plain.close()
        assert np.array_equal(obs[0, -1], frame)
        checked += count > 0
    assert checked >= 4
    distinct = {frame.tobytes() for _, frame in frames.values()}
    assert len(distinct) > 10  # the game moves while its agent waits: the count shows in the frame
