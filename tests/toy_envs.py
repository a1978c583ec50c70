"""Small visual tasks with Atari-shaped observations (uint8 stacks of 4x84x84 frames).

The algorithm scripts reach them as ``--env-id tests.toy_envs:ImageBandit-v0`` (Gymnasium
imports the module before making the environment), with the repository root on PYTHONPATH.

- ``ImageBandit-v0``: one step per episode. The newest frame lights the left or the right half;
  action 0 pays 1 for left, action 1 pays 1 for right. Optimal return 1, random 0.5.
- ``DelayedImage-v0``: two steps. The first frame shows the cue and pays nothing; the matching
  action leads to a "good" frame whose every action pays 1, the other to a "bad" frame that pays
  0. Optimal return 1 (Q* = gamma at the cue), random 0.5: the cue's value only arrives through
  bootstrapping, so a learner without a working target fails it.
- ``CrashingBandit-v0``: ImageBandit that raises after 150 steps (a failing run).
- ``ScaledBandit-v0``: ImageBandit paying 5 and -3 instead of 1 and 0 (reward clipping shows).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

SIZE = 84


def _frame(kind: str) -> np.ndarray:
    frame = np.zeros((SIZE, SIZE), dtype=np.uint8)
    if kind == "left":
        frame[:, : SIZE // 2] = 255
    elif kind == "right":
        frame[:, SIZE // 2 :] = 255
    elif kind == "good":
        frame[SIZE // 4 : 3 * SIZE // 4, SIZE // 4 : 3 * SIZE // 4] = 200
    elif kind == "bad":
        frame[::4, :] = 100
    return frame


class _StackedTask(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, (4, SIZE, SIZE), dtype=np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        self.stack = np.zeros((4, SIZE, SIZE), dtype=np.uint8)

    def _push(self, frame: np.ndarray) -> np.ndarray:
        self.stack = np.concatenate([self.stack[1:], frame[None]])
        return self.stack.copy()

    # Checkpoints save and restore an environment that offers these (cleanrl_utils.checkpoint).
    def get_state(self) -> dict:
        state = {k: v for k, v in vars(self).items() if k in ("cue", "phase", "good")}
        return {**state, "stack": self.stack.copy(), "rng": self.np_random.bit_generator.state}

    def set_state(self, state: dict) -> None:
        for key in ("cue", "phase", "good"):
            if key in state:
                setattr(self, key, state[key])
        self.stack = state["stack"].copy()
        self.np_random.bit_generator.state = state["rng"]

    def _start(self, seed: int | None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.cue = int(self.np_random.integers(2))
        self.stack = np.zeros((4, SIZE, SIZE), dtype=np.uint8)
        return self._push(_frame("left" if self.cue == 0 else "right")), {}


class ImageBandit(_StackedTask):
    def reset(self, *, seed=None, options=None):
        return self._start(seed)

    def step(self, action):
        reward = 1.0 if int(action) == self.cue else 0.0
        return self._push(_frame("blank")), reward, True, False, {}


class DelayedImage(_StackedTask):
    def reset(self, *, seed=None, options=None):
        self.phase = 0
        return self._start(seed)

    def step(self, action):
        if self.phase == 0:
            self.phase = 1
            self.good = int(action) == self.cue
            return self._push(_frame("good" if self.good else "bad")), 0.0, False, False, {}
        return self._push(_frame("blank")), 1.0 if self.good else 0.0, True, False, {}


class CrashingBandit(ImageBandit):
    """ImageBandit that raises after 150 steps: a run that fails, for the launcher's tests."""

    steps = 0

    def step(self, action):
        CrashingBandit.steps += 1
        if CrashingBandit.steps > 150:
            raise RuntimeError("CrashingBandit: deliberate failure for the tests")
        return super().step(action)


gym.register(id="ImageBandit-v0", entry_point=ImageBandit)
gym.register(id="CrashingBandit-v0", entry_point=CrashingBandit)
gym.register(id="DelayedImage-v0", entry_point=DelayedImage)


class ScaledBandit(ImageBandit):
    """ImageBandit paying 5 for the cue's action and -3 for the other: rewards outside [-1, 1], so that the
    learner's clipped rewards and the logged raw returns differ."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, 5.0 if reward > 0 else -3.0, terminated, truncated, info


gym.register(id="ScaledBandit-v0", entry_point=ScaledBandit)
