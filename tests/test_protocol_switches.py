"""Where each protocol switch acts, and where it must not, in training and in evaluation games alike.

The protocol's three switches (``forced_steps``, ``zero_stacks``, ``noop_starts``; drq.py's flags of the same
names) each act at a game's start and after a life loss, or at one of the two only. Every combination of the three
is played on Breakout (FIRE, five lives) against a reference written here apart from ``TrainEnvs``: Gymnasium's
AtariPreprocessing over the raw game (the same pixels as ale-py's path, test_protocol.py) and the protocol's rules
in a few lines each. Training games (two at a time, through autoresets) and evaluation games (``play_episodes``,
several in one slot, so through restarts) are compared step by step: what was pressed for the agent (the frames
show it), which steps are the agent's own, every learning terminal, and every stack the agent acts on. A switch
that acts where it must not, or fails to act where it must, changes one of those; each such wrong placement is
planted once in a copy of ``cleanrl_utils/envs.py`` and fails the comparison.

The fourth switch, drq.py's ``--shift-per``, acts on sampled batches only (tests/test_drq.py: one shift per batch
or per stack, s and s' apart, each planted); the frames the agent acts on are never augmented, which the stacks
compared here show for the games' side.
"""

import importlib.util
import itertools
import sys
import zlib
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import cleanrl_utils.envs as envs_module
from cleanrl_utils.envs import make_vector_env

ENV_ID = "BreakoutNoFrameskip-v4"
NOOP, FIRE, AFTER_FIRE = 0, 1, 2  # Breakout's minimal action set: NOOP, FIRE, RIGHT, LEFT
PROTOCOLS = [
    {"forced_steps": forced, "zero_stacks": zero, "noop_starts": noops}
    for forced, zero, noops in itertools.product((True, False), (True, False), ("frames", "steps"))
]


def protocol_id(protocol: dict) -> str:
    return "-".join(
        [
            "forced" if protocol["forced_steps"] else "unforced",
            "zero" if protocol["zero_stacks"] else "repeat",
            f"noop_{protocol['noop_starts']}",
        ]
    )


class NoopFramesFirst(gym.Wrapper):
    """On the raw game, beneath the frame skip: after each reset, the game's next count of NOOP frames
    (``noop_starts="frames"``; none under ``"steps"``)"""

    def __init__(self, env: gym.Env, game: "ReferenceGame"):
        super().__init__(env)
        self.game = game

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        for _ in range(next(self.game.noop_frames) if self.game.protocol["noop_starts"] == "frames" else 0):
            obs, _, terminated, truncated, info = self.env.step(NOOP)
            assert not (terminated or truncated)
        return obs, info


class ReferenceGame:
    """One environment's games as the protocol says they are played, written apart from ``TrainEnvs``.

    - A game starts with ``noop_frames[n]`` raw NOOP frames beneath the frame skip (``noop_starts="frames"``: the
      counts ale-py draws, given) or, with ``noop_starts="steps"``, with k NOOP agent steps pressed for the agent,
      k in 0..29 drawn per game start from a generator seeded as the environment's first game and continued.
    - With forced steps, FIRE and 2 are pressed after those, and NOOP, FIRE, 2 after each life loss that does not
      end the game. Without, nothing more is pressed.
    - The stack the agent acts on starts afresh (three black frames and the newest with zero stacks, the newest
      four times without) at a game's start and after any step pressed for it; after a life loss with nothing
      pressed, it starts afresh with zero stacks only, and goes on with the last four frames otherwise.
    """

    def __init__(self, seed: int, protocol: dict, noop_frames: list[int]):
        self.protocol = protocol
        self.noop_frames = iter(noop_frames)
        self.noop_steps = np.random.default_rng(seed)
        raw = NoopFramesFirst(gym.make(ENV_ID), self)  # NoFrameskip-v4: one frame per step, no sticky actions
        self.env = gym.wrappers.AtariPreprocessing(raw, noop_max=0, frame_skip=4, screen_size=84, grayscale_obs=True)
        self.seed = seed
        self.ended = False  # the game ended: the next step is the autoreset, which plays nothing
        self.fresh = True  # the next stack the agent sees starts afresh
        self.pressed: list[int] = []
        self.drawn_noop_steps = self.pressed_after_life_losses = 0  # what the comparison went through
        self.start(seed)

    def start(self, seed: int | None = None) -> None:
        frame, _ = self.env.reset(seed=seed)  # with the no-op frames beneath (NoopFramesFirst)
        self.lives = self.env.unwrapped.ale.lives()
        self.pressed = [NOOP] * int(self.noop_steps.integers(0, 30)) if self.protocol["noop_starts"] == "steps" else []
        self.drawn_noop_steps += len(self.pressed)
        self.pressed += [FIRE, AFTER_FIRE] if self.protocol["forced_steps"] else []
        self.frame, self.ended, self.fresh = frame, False, True
        self.stack = self.restacked()

    def restacked(self) -> np.ndarray:
        if self.fresh:
            first = (
                np.zeros((3, 84, 84), np.uint8) if self.protocol["zero_stacks"] else np.repeat(self.frame[None], 3, 0)
            )
            return np.concatenate([first, self.frame[None]])
        return np.concatenate([self.stack[1:], self.frame[None]])

    @property
    def agent_acts(self) -> bool:
        return not self.ended and not self.pressed

    def step(self, action: int) -> dict:
        """One step of ours: the autoreset after a game's end, a step pressed for the agent, or the agent's own."""
        if self.ended:
            self.start()
            return {"mask": False, "reward": 0.0, "done": False, "end": False}
        agents = not self.pressed
        played = action if agents else self.pressed.pop(0)
        self.frame, reward, terminated, truncated, _ = self.env.step(played)
        lives = self.env.unwrapped.ale.lives()
        life_lost = lives < self.lives
        self.lives = lives
        self.ended = terminated or truncated
        if life_lost and not self.ended and self.protocol["forced_steps"]:
            self.pressed = [NOOP, FIRE, AFTER_FIRE]
            self.pressed_after_life_losses += 3
        self.fresh = not agents or (life_lost and self.protocol["zero_stacks"])
        self.stack = self.restacked()
        return {"mask": agents, "reward": reward, "done": agents and (terminated or life_lost), "end": self.ended}


def noop_frame_counts(num_envs: int, seed: int, starts: int) -> np.ndarray:
    """The raw no-op frames ale-py plays at each of the first ``starts`` game starts of environment i: a twin vector
    environment seeded alike, reset unseeded after the first as autoresets are (``episode_frame_number``)."""
    twin = make_vector_env(ENV_ID, num_envs)
    counts = [twin.reset(seed=seed)[1]["episode_frame_number"]]
    counts += [twin.reset()[1]["episode_frame_number"] for _ in range(starts - 1)]
    twin.close()
    return np.array(counts).reshape(starts, num_envs)


def policy(stack: np.ndarray) -> int:
    """A deterministic agent that plays on (it presses FIRE a quarter of the time): the reference can replay it"""
    return zlib.crc32(stack.tobytes()) % 4


def check_training(module, protocol: dict, num_envs: int = 2, seed: int = 3, games: int = 1) -> dict:
    """Play ``module.TrainEnvs`` against a reference per environment until each has ended ``games`` whole games and
    its agent has acted 30 times in the next (past an autoreset); every step's mask, frame, reward, terminal and end
    equal, every stack the agent acts on equal"""
    counts = noop_frame_counts(num_envs, seed, starts=games + 3)
    references = [ReferenceGame(seed + i, protocol, counts[:, i].tolist()) for i in range(num_envs)]
    ours = module.TrainEnvs(ENV_ID, num_envs, seed=seed, **protocol)
    obs = ours.reset()
    seen = {"life_losses": 0, "games": np.zeros(num_envs, int), "blank": 0, "acted_after": np.zeros(num_envs, int)}
    for _ in range(20_000):
        if seen["games"].min() >= games and seen["acted_after"].min() >= 30:
            break
        actions = np.array([policy(obs[i]) for i in range(num_envs)])
        for i, reference in enumerate(references):
            if reference.agent_acts:
                np.testing.assert_array_equal(obs[i], reference.stack, err_msg=f"the stack game {i} acts on")
                seen["blank"] += not reference.stack[0].any()
        step = ours.step(actions)
        for i, reference in enumerate(references):
            expected = reference.step(int(actions[i]))
            assert step.mask[i] == expected["mask"], (i, "the agent's own step", expected)
            np.testing.assert_array_equal(step.next_obs[i, -1], reference.frame, err_msg=f"game {i}'s frame")
            assert step.raw_rewards[i] == expected["reward"] and step.dones[i] == expected["done"], (i, expected)
            assert step.ends[i] == expected["end"], (i, expected)
            seen["life_losses"] += expected["done"] and not expected["end"]
            seen["acted_after"][i] += expected["mask"] and seen["games"][i] >= games
            seen["games"][i] += expected["end"]
        obs = step.next_obs
    else:
        raise AssertionError(f"{seen['games']} whole games after 20,000 steps")
    ours.close()
    assert seen["life_losses"] >= 4 * num_envs * games  # lives were lost, not only games started
    seen["noop_steps"] = sum(reference.drawn_noop_steps for reference in references)
    seen["pressed_after_life_losses"] = sum(reference.pressed_after_life_losses for reference in references)
    return seen


def check_evaluation(module, protocol: dict, episodes: int = 3, seed: int = 7) -> None:
    """``module.play_episodes`` with one game at a time (game k seeded seed + k, started by a restart after the
    first) against a reference game per game: every stack its agent is shown, and each game's return and length
    (steps pressed for the agent included), and the histogram of the agent's own actions"""
    shown: list[np.ndarray] = []

    def select_actions(obs: np.ndarray) -> np.ndarray:
        shown.extend(obs.copy())
        return np.array([policy(stack) for stack in obs])

    returns, lengths, histogram = module.play_episodes(
        ENV_ID, episodes, seed, select_actions, 4, 0.0, np.random.default_rng(0), parallel=1, **protocol
    )
    expected_shown, expected_histogram = [], np.zeros(4, int)
    for k in range(episodes):
        [[count]] = noop_frame_counts(1, seed + k, starts=1)
        reference = ReferenceGame(seed + k, protocol, [count])
        total, length = 0.0, 0
        while True:  # one game at a time: the agent is shown a stack at every step, its action played or not
            expected_shown.append(reference.stack if reference.agent_acts else None)
            action = policy(reference.stack) if reference.agent_acts else NOOP
            expected = reference.step(action)
            expected_histogram[action] += expected["mask"]
            total, length = total + expected["reward"], length + 1
            if expected["end"]:
                break
        assert (returns[k], lengths[k]) == (total, length), (k, returns, lengths)
    assert len(shown) == len(expected_shown) == sum(lengths)
    for k, (stack, expected_stack) in enumerate(zip(shown, expected_shown, strict=True)):
        if expected_stack is not None:  # a stack the agent acts on
            np.testing.assert_array_equal(stack, expected_stack, err_msg=f"the stack of step {k}")
    np.testing.assert_array_equal(histogram, expected_histogram)


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=protocol_id)
def test_training_games_play_each_switch_where_it_acts_and_nowhere_else(protocol):
    seen = check_training(envs_module, protocol)
    # the comparison went through each switch where it acts: steps pressed after life losses, no-op steps drawn at
    # game starts, zero-filled stacks acted on
    assert (seen["pressed_after_life_losses"] > 0) == protocol["forced_steps"]
    assert (seen["noop_steps"] > 0) == (protocol["noop_starts"] == "steps")
    assert (seen["blank"] > 0) == protocol["zero_stacks"]


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=protocol_id)
def test_evaluation_games_play_each_switch_as_training_does(protocol):
    check_evaluation(envs_module, protocol)


def planted_envs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, original: str | tuple, changed: str | tuple):
    """a copy of cleanrl_utils/envs.py with one wrong placement planted, imported under its own name (in
    sys.modules for the test's time: its dataclasses look their module up)"""
    source = Path(envs_module.__file__).read_text()
    originals, changes = (original, changed) if isinstance(original, tuple) else ((original,), (changed,))
    for before, after in zip(originals, changes, strict=True):  # a plant may need a second line to run at all
        if source.count(before) != 1:  # not an AssertionError: a lost plant must not pass as caught
            pytest.fail(f"the plant's text is not in envs.py once: {before}")
        source = source.replace(before, after)
    path = tmp_path / "planted_envs.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("planted_envs", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "planted_envs", module)
    spec.loader.exec_module(module)
    return module


FORCED = {"forced_steps": True, "zero_stacks": False, "noop_starts": "frames"}  # the other scripts' protocol
UNFORCED = {"forced_steps": False, "zero_stacks": False, "noop_starts": "frames"}
DRQ = {"forced_steps": False, "zero_stacks": True, "noop_starts": "frames"}  # drq.py's default
DOPAMINE_TODAY = {"forced_steps": False, "zero_stacks": True, "noop_starts": "steps"}
FORCED_NOOP_STEPS = {"forced_steps": True, "zero_stacks": False, "noop_starts": "steps"}
FORCED_ZERO = {"forced_steps": True, "zero_stacks": True, "noop_starts": "frames"}
FORCE = "actions = forced_actions(self.fire, life_lost) if self.forced_steps else []"
NOOP_STEPS = 'if self.noop_starts == "steps" and not life_lost:'
ZERO_AFTER_LIFE_LOSS = "if self.zero_stacks and not self.forced_steps:"
FRESH = "fresh = ~mask  # after an autoreset or forced step, the stack starts afresh"
WIDTH = '3 + (NOOP_STEPS_MAX if noop_starts == "steps" else 0)'  # room for the steps pressed for the agent
PASS_PROTOCOL = "env_id, slots, seed=seed, forced_steps=forced_steps, zero_stacks=zero_stacks, noop_starts=noop_starts"
PLANTS = [
    # forced steps
    ("pressed after a life loss without forced steps", FORCE, FORCE.replace("if self.forced_steps", "if self.forced_steps or life_lost"), UNFORCED),
    ("pressed at a game's start without forced steps", FORCE, FORCE.replace("if self.forced_steps", "if self.forced_steps or not life_lost"), DRQ),
    ("not pressed after a life loss", "self._force(life_lost & ~ends, life_lost=True)", "pass", FORCED),
    ("not pressed at an autoreset's game start", "self._force(self.pending_reset, life_lost=False)", "pass", FORCED),
    # no-op starts
    ("no-op steps after a life loss too", NOOP_STEPS, 'if self.noop_starts == "steps":', DOPAMINE_TODAY),
    ("no-op steps under noop_starts=frames", (NOOP_STEPS, WIDTH), ("if not life_lost:", "3 + NOOP_STEPS_MAX"), DRQ),
    ("no-op steps only where forced steps are pressed", NOOP_STEPS, NOOP_STEPS.replace(":", " and self.forced_steps:"), DOPAMINE_TODAY),
    ("no-op steps after the forced steps", "[NOOP] * int(self.noop_rngs[env].integers(0, NOOP_STEPS_MAX + 1)) + actions", "actions + [NOOP] * int(self.noop_rngs[env].integers(0, NOOP_STEPS_MAX + 1))", FORCED_NOOP_STEPS),
    ("no-op frames under noop_starts=steps, none under frames", 'noop_max if noop_starts == "frames" else 0', '0 if noop_starts == "frames" else noop_max', DRQ),
    # zero stacks
    ("no zero stack after a life loss without forced steps", "fresh |= life_lost & ~ends", "pass", DRQ),
    ("a fresh stack after a life loss without zero stacks", ZERO_AFTER_LIFE_LOSS, "if not self.forced_steps:", UNFORCED),
    ("zero-filled stacks without zero stacks", "        if self.zero_stacks:\n            return", "        if True:\n            return", FORCED),
    ("no zero-filled stack after the forced steps", FRESH, "fresh = ~mask & ~forced", FORCED_ZERO),
    ("a game's first stack carried over from the last game", FRESH, "fresh = ~mask & ~self.pending_reset", DRQ),
]  # fmt: skip


@pytest.mark.parametrize("bug,original,changed,protocol", PLANTS, ids=[plant[0] for plant in PLANTS])
def test_a_switch_planted_in_the_wrong_place_fails_the_training_comparison(
    bug, original, changed, protocol, tmp_path, monkeypatch
):
    module = planted_envs(tmp_path, monkeypatch, original, changed)
    with pytest.raises(AssertionError):
        check_training(module, protocol)


EVALUATION_PLANTS = [
    ("the evaluation presses the default's forced steps", "forced_steps=forced_steps, zero_stacks", "forced_steps=True, zero_stacks", DRQ),
    ("the evaluation plays without zero stacks", "zero_stacks=zero_stacks, noop_starts", "zero_stacks=False, noop_starts", DRQ),
    ("the evaluation plays no-op frames under steps", "noop_starts=noop_starts\n", 'noop_starts="frames"\n', DOPAMINE_TODAY),
    ("a restarted game's first stack carried over", "self.stacks[games] = self.new_stacks(obs[games])", "self.stacks[games] = np.concatenate([self.stacks[games, 1:], obs[games]], axis=1)", DRQ),
    ("no no-op steps at a restarted game's start", "self._force(games, life_lost=False)", "pass", DOPAMINE_TODAY),
    ("not pressed at a restarted game's start", "self._force(games, life_lost=False)", "pass", FORCED),
]  # fmt: skip


@pytest.mark.parametrize("bug,original,changed,protocol", EVALUATION_PLANTS, ids=[p[0] for p in EVALUATION_PLANTS])
def test_a_switch_planted_in_the_wrong_place_fails_the_evaluation_comparison(
    bug, original, changed, protocol, tmp_path, monkeypatch
):
    assert PASS_PROTOCOL in Path(envs_module.__file__).read_text()  # play_episodes passes its protocol on here
    module = planted_envs(tmp_path, monkeypatch, original, changed)
    with pytest.raises(AssertionError):
        check_evaluation(module, protocol)
