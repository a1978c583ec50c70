"""The game as CleanRL plays it, checked against an independent reference.

The reference is Gymnasium's own AtariPreprocessing (frame skip 4 with max-pool, 84x84 grayscale)
with EpisodicLifeEnv and FireResetEnv written here as OpenAI baselines and SB3 write them, composed
as CleanRL's ``make_env`` composes them (FireResetEnv around EpisodicLifeEnv), under a frame stack
that starts with the first frame four times. CleanRL converts to grayscale and resizes with its own
wrappers, which do not match ale-py's C++ path byte for byte; AtariPreprocessing does the same
operations in the same order as ale-py (ALE's grayscale palette, max-pool, cv2 INTER_AREA), so the
comparison is byte-exact: every observation the agent acts on, every clipped reward, every learning
terminal and every whole game's return and length. No-op starts are off in both (their draws come
from different generators); their range is checked on its own below.
"""

import cv2
import gymnasium as gym
import numpy as np
import pytest

from cleanrl_utils.envs import NOOP_MAX, TrainEnvs, make_vector_env, play_episodes


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


def reference_env(env_id: str) -> gym.Env:
    env = gym.make(env_id)  # NoFrameskip-v4: one frame per step, no sticky actions
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


def agent_acts_next(envs: TrainEnvs) -> bool:
    return envs.forced_actions[0, 0] < 0 and not envs.pending_reset[0]


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


def test_noop_starts_draw_0_to_30_frames():
    envs = make_vector_env("BreakoutNoFrameskip-v4", 16)
    envs.reset(seed=1000)
    draws = []
    for _ in range(32):  # 512 draws; unseeded resets continue each game's generator (no ROM reload)
        _, info = envs.reset()
        draws += list(info["episode_frame_number"])
    envs.close()
    assert min(draws) == 0 and max(draws) == NOOP_MAX and len(set(draws)) == NOOP_MAX + 1
