"""Training and evaluation environments under the Nature DQN protocol, as CleanRL plays it.

ALE games (``*NoFrameskip-v4``) run in ale-py's native vector environment (C++ threads, with
no-op starts, frame skip 4 with max-pool, 84x84 grayscale and the 108,000-frame cap built in).
We ask it for raw rewards, whole games and single frames, and do the rest here, as CleanRL's
wrappers do (EpisodicLifeEnv with FireResetEnv inside, then a frame stack):

- the learning signal: the reward's sign, and a terminal at every life loss (``info["lives"]``
  drops) as well as at game over. The logged return stays the whole game in raw score.
- ``noop_starts="steps"`` plays no no-op frames of ale-py's but 0 to 29 NOOP agent steps pressed
  for the agent at each game's start, as Dopamine's Atari 100k runner does.
- after a game starts, FIRE then action 2 are pressed for the agent (FireResetEnv), and after a
  life loss NOOP, FIRE, action 2 (EpisodicLifeEnv's no-op, then FireResetEnv; NOOP alone in games
  without FIRE). These forced steps are not transitions (``StepResult.mask`` is False).
  ``forced_steps=False`` presses nothing: the agent plays every step, as Dopamine's Atari 100k.
- the frame stack starts afresh (the newest frame four times) after a game start and after a
  life loss, so no stack spans two lives (without forced steps, after a game start only: the
  first three stacks of a life then hold frames of the one before, docs/protocol.md).
  ``zero_stacks=True`` starts it as Dopamine's agent does, zero-filled (three black frames, then
  the newest), after a game start and after every life loss, forced steps or not.

Any other Gymnasium id whose observation is a uint8 stack of 4x84x84 frames runs through
Gymnasium's vector API as it is (``module:Id`` ids import their module first, so tests and users
can bring their own tasks).

Both use next-step autoreset: the step after a game ends returns the reset observation and
ignores its action, so it is not a transition either.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import ale_py
import gymnasium as gym
import numpy as np
from ale_py.vector_env import AtariVectorEnv
from gymnasium.vector import AutoresetMode

from cleanrl_utils.scores import game_name

gym.register_envs(ale_py)

OBSERVATION_SHAPE = (4, 84, 84)
MAX_FRAMES_PER_EPISODE = 108_000
NOOP_MAX = 30  # no-op frames at a game's start: 0 to 30 here, 1 to 30 in CleanRL (docs/protocol.md)
NOOP_STEPS_MAX = 29  # no-op agent steps at a game's start with noop_starts="steps": 0 to 29, Dopamine's runner's
# FIRE is 1 in every minimal action set that has it; 2 is what FireResetEnv presses next
NOOP, FIRE, AFTER_FIRE = 0, 1, 2


class EnvIdError(ValueError):
    pass


def atari_ids() -> list[str]:
    return sorted(k for k in gym.registry if k.endswith("NoFrameskip-v4"))


def ale_game(env_id: str) -> str | None:
    """The ROM name for a ``*NoFrameskip-v4`` id, None for any other id."""
    if not env_id.endswith("NoFrameskip-v4") or env_id not in gym.registry:
        return None
    return gym.registry[env_id].kwargs["game"]


@cache
def has_fire(env_id: str) -> bool:
    """Whether an ALE game's minimal action set has FIRE (then it is action 1, as FireResetEnv assumes)."""
    env = gym.make(env_id)
    meanings = env.unwrapped.get_action_meanings()
    env.close()
    return len(meanings) > 1 and meanings[FIRE] == "FIRE"


def forced_actions(fire: bool, life_lost: bool) -> list[int]:
    """What the protocol presses for the agent before it acts again: after a life loss, NOOP
    (EpisodicLifeEnv), then in games with FIRE, FIRE and action 2 (FireResetEnv), as at a game's start."""
    return ([NOOP] if life_lost else []) + ([FIRE, AFTER_FIRE] if fire else [])


def check_env_id(env_id: str) -> None:
    """Fail early, with close matches, on an id that cannot give 4x84x84 uint8 stacks."""
    if ale_game(env_id) is not None:
        return
    if ":" in env_id:
        module = env_id.split(":")[0]
        try:
            __import__(module)
        except ImportError as error:
            raise EnvIdError(f"--env-id {env_id}: cannot import module {module!r} ({error})") from None
    name = env_id.split(":")[-1]
    from_ale = name in gym.registry and "ale_py" in str(gym.registry[name].entry_point)
    if name in gym.registry and not from_ale:  # one environment made and closed: its spaces and autoreset
        make_vector_env(env_id, 1).close()
        return
    if name.startswith("ALE/") or from_ale:
        game = game_name(name)
        raise EnvIdError(
            f"--env-id {env_id} is an ALE id without the training protocol (it gives RGB frames, "
            f"sticky actions or frame skipping of its own); use --env-id {game}NoFrameskip-v4"
        )
    # suggest Atari ids only (other registered ids, e.g. FrozenLake-v1, give no 4x84x84 frames), and after a
    # "module:" prefix that module's own ids, written as they must be given
    prefix = env_id[: len(env_id) - len(name)]
    own = [prefix + k for k, spec in gym.registry.items() if prefix and prefix[:-1] in str(spec.entry_point)]
    close = difflib.get_close_matches(env_id, atari_ids() + own, n=5, cutoff=0.5)
    if not close:  # a misspelt game name without the suffix, e.g. "Pongg" or "breakout"
        games = {i.removesuffix("NoFrameskip-v4").lower(): i for i in atari_ids()}
        close = [games[g] for g in difflib.get_close_matches(game_name(name).lower(), list(games), n=5)]
    hint = f"; did you mean {', '.join(close)}?" if close else "; Atari games look like BreakoutNoFrameskip-v4"
    raise EnvIdError(f"--env-id {env_id} is not a known environment{hint}")


@dataclass
class StepResult:
    next_obs: np.ndarray  # uint8 (num_envs, 4, 84, 84)
    rewards: np.ndarray  # float32, clipped to the reward's sign: what the learner sees
    raw_rewards: np.ndarray  # float64, the game score
    dones: np.ndarray  # learning terminal of a transition: game over or life lost (never a time limit)
    truncations: np.ndarray  # the game hit its time limit
    ends: np.ndarray  # the game ended: game over or time limit (on a forced step too)
    mask: np.ndarray  # this step was a transition: the agent's action, played (not an autoreset or forced step)
    episode_returns: list[tuple[int, float, int]]  # (env index, raw return, length) of ended games


class TrainEnvs:
    """A vector of environments that plays the protocol and reports its learning signal and whole games."""

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        seed: int,
        noop_max: int = NOOP_MAX,
        forced_steps: bool = True,
        zero_stacks: bool = False,
        noop_starts: str = "frames",
    ):
        if noop_starts not in ("frames", "steps"):
            raise ValueError(f"noop_starts={noop_starts!r}: 'frames' (ale-py's no-op frames) or 'steps' (agent steps)")
        self.env_id = env_id
        self.num_envs = num_envs
        self.noop_starts = noop_starts
        # "steps": the no-ops are NOOP agent steps pressed for the agent (forced steps), drawn per game by its own
        # generator (seeded as the game), so ale-py plays none of its own
        self.envs = make_vector_env(env_id, num_envs, noop_max if noop_starts == "frames" else 0)
        self.noop_rngs: list[np.random.Generator] = []  # per environment, seeded as its game by reset and restart
        self.single_action_space = self.envs.single_action_space
        self.n_actions = int(self.single_action_space.n)
        self.seed = seed
        self.ale = ale_game(env_id) is not None  # ALE games: forced steps and the frame stack are ours
        self.fire = self.ale and has_fire(env_id)
        self.forced_steps = forced_steps  # False: nothing pressed for the agent (Dopamine's Atari 100k)
        self.zero_stacks = zero_stacks  # True: a game's and a life's first stack zero-filled (Dopamine's agent)
        self.lives = np.zeros(num_envs, dtype=np.int64)
        self.pending_reset = np.zeros(num_envs, dtype=bool)
        # pressed for the agent next; -1: none
        self.forced_actions = np.full((num_envs, 3 + (NOOP_STEPS_MAX if noop_starts == "steps" else 0)), -1)
        self.returns = np.zeros(num_envs, dtype=np.float64)
        self.lengths = np.zeros(num_envs, dtype=np.int64)
        self.stacks: np.ndarray | None = None  # ALE games: the frame stacks last returned
        self.seconds = 0.0  # wall time spent in send and recv: the games' share of the run (receipt.json)
        self._sent: np.ndarray | None = None  # actions sent and not yet received

    @property
    def protocol(self) -> dict[str, Any]:
        """How these games are played for the agent: what the evaluations and a saved model's games repeat."""
        return {"forced_steps": self.forced_steps, "zero_stacks": self.zero_stacks, "noop_starts": self.noop_starts}

    def new_stacks(self, frames: np.ndarray) -> np.ndarray:
        """The first stacks of games or lives from their first frames (n, 1, 84, 84): the frame four times, or
        with ``zero_stacks`` three black frames before it"""
        if self.zero_stacks:
            return np.concatenate([np.zeros_like(frames).repeat(OBSERVATION_SHAPE[0] - 1, axis=1), frames], axis=1)
        return np.repeat(frames, OBSERVATION_SHAPE[0], axis=1)

    # What a checkpoint holds of this class's own bookkeeping, beside the games themselves.
    STATE_FIELDS = ("lives", "pending_reset", "forced_actions", "returns", "lengths")

    @property
    def games_can_be_saved(self) -> bool:
        """Whether ``state_dict`` can hold the games in progress: environments with ``get_state`` /
        ``set_state`` (the tests' toy games). ale-py's vector environment cannot save its games, so a
        resumed Atari run starts new ones."""
        inner = getattr(self.envs, "envs", None)  # Gymnasium's SyncVectorEnv keeps its environments here
        return inner is not None and all(hasattr(env.unwrapped, "get_state") for env in inner)

    def state_dict(self) -> dict[str, Any]:
        """The games in progress and this class's counters; only where ``games_can_be_saved``."""
        if not self.games_can_be_saved:
            raise ValueError(f"{self.env_id}'s environments cannot save their games (no get_state)")
        return {
            "train_envs": {name: getattr(self, name).copy() for name in self.STATE_FIELDS},
            # which environments reset at their next step: SyncVectorEnv keeps it in a private field only
            "autoreset": np.asarray(self.envs._autoreset_envs).copy(),
            "envs": [env.unwrapped.get_state() for env in self.envs.envs],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved games: the environments are built by a reset, then overwritten."""
        if not self.games_can_be_saved:
            raise ValueError(f"{self.env_id}'s environments cannot load saved games (no set_state)")
        self.reset()
        for name in self.STATE_FIELDS:
            getattr(self, name)[...] = state["train_envs"][name]
        self.envs._autoreset_envs = np.asarray(state["autoreset"]).copy()
        for env, env_state in zip(self.envs.envs, state["envs"], strict=True):
            env.unwrapped.set_state(env_state)

    def reset(self) -> np.ndarray:
        if self._sent is not None:  # a step in flight: finish it (its result is dropped)
            self.recv()
        obs, info = self.envs.reset(seed=self.seed)
        self.noop_rngs = [np.random.default_rng(self.seed + i) for i in range(self.num_envs)]  # env i's game: seed + i
        self.lives[:] = _lives(info, self.num_envs)
        self.pending_reset[:] = False
        self.forced_actions[:] = -1
        self.returns[:] = 0.0
        self.lengths[:] = 0
        if self.ale:
            self._force(np.ones(self.num_envs, dtype=bool), life_lost=False)
            self.stacks = self.new_stacks(obs)
            return self.stacks
        return obs

    def restart(self, games: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """Start new games in the environments where ``games`` (a boolean mask) is true, seeded
        ``seeds`` (one per chosen environment, in order), between steps; the others play on. A game
        seeded s is the same wherever and whenever it starts: the game a fresh ``TrainEnvs`` seeded s
        starts in its environment 0. Returns the observations, as ``reset`` and ``step`` do."""
        if self._sent is not None:
            raise RuntimeError("TrainEnvs.restart called with a step in flight")
        chosen = np.flatnonzero(games)
        if isinstance(self.envs, AtariVectorEnv):
            obs, info = self.envs.reset(seed=np.asarray(seeds, dtype=np.int64), options={"reset_mask": games})
        else:  # Gymnasium's vector environments take a seed per environment, None where none is reset
            per_env: list[int | None] = [None] * self.num_envs
            for env, seed in zip(chosen, seeds, strict=True):
                per_env[env] = int(seed)
            obs, info = self.envs.reset(seed=per_env, options={"reset_mask": games})
        for env, seed in zip(chosen, seeds, strict=True):
            self.noop_rngs[env] = np.random.default_rng(int(seed))
        self.lives[games] = _lives(info, self.num_envs)[games]
        self.pending_reset[games] = False
        self.forced_actions[games] = -1
        self.returns[games] = 0.0
        self.lengths[games] = 0
        if self.ale:
            self._force(games, life_lost=False)
            self.stacks[games] = self.new_stacks(obs[games])
            return self.stacks
        return obs

    def _force(self, envs: np.ndarray, life_lost: bool) -> None:
        """What is pressed for the agent in ``envs`` after a life loss or at a game's start: the forced steps, and
        at a game's start with ``noop_starts="steps"`` first 0 to 29 NOOP agent steps, drawn by the game's
        generator (Dopamine's runner: ``jax.random.randint(rng, (), 0, 30)`` times ``env.step(0)``)"""
        for env in np.flatnonzero(envs):
            actions = forced_actions(self.fire, life_lost) if self.forced_steps else []
            if self.noop_starts == "steps" and not life_lost:
                actions = [NOOP] * int(self.noop_rngs[env].integers(0, NOOP_STEPS_MAX + 1)) + actions
            if actions:
                self.forced_actions[env] = -1
                self.forced_actions[env, : len(actions)] = actions

    def step(self, actions: np.ndarray) -> StepResult:
        self.send(actions)
        return self.recv()

    def send(self, actions: np.ndarray) -> None:
        """Start a step and return at once. ale-py's environments step in their own C++ threads until
        ``recv``, so the learner can update meanwhile (Gymnasium's AsyncVectorEnv too, in its processes;
        other vector environments step inside ``recv``). ``send`` then ``recv`` is exactly ``step``.
        Where the protocol presses a button for the agent (after a game start or a life loss), that
        environment's action is replaced and the step is not a transition."""
        if self._sent is not None:
            raise RuntimeError("TrainEnvs.send called twice without recv in between")
        start = time.perf_counter()
        actions = np.array(actions, dtype=np.int64)  # a copy: the caller may reuse its array
        if actions.shape != (self.num_envs,):
            raise ValueError(f"expected {self.num_envs} actions, got an array of shape {actions.shape}")
        forced = self.forced_actions[:, 0] >= 0
        actions[forced] = self.forced_actions[forced, 0]
        if isinstance(self.envs, AtariVectorEnv):
            self.envs.send(actions)
        elif hasattr(self.envs, "step_async"):
            self.envs.step_async(actions)
        self._sent = actions
        self.seconds += time.perf_counter() - start

    def recv(self) -> StepResult:
        """Wait for the step that ``send`` started and return its result."""
        if self._sent is None:
            raise RuntimeError("TrainEnvs.recv called without a step sent")
        actions, self._sent = self._sent, None
        start = time.perf_counter()
        if isinstance(self.envs, AtariVectorEnv):
            # its batch_size is num_envs, so ale-py returns the results in environment order (info["env_id"] is
            # 0, 1, ...: its result staging writes environment i's result to slot i)
            next_obs, raw, terminated, truncated, info = self.envs.recv()
        elif hasattr(self.envs, "step_wait"):
            next_obs, raw, terminated, truncated, info = self.envs.step_wait()
        else:
            next_obs, raw, terminated, truncated, info = self.envs.step(actions)
        lives = _lives(info, self.num_envs)
        raw = np.asarray(raw, dtype=np.float64)
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        played = ~self.pending_reset  # the action was played (not ignored by an autoreset)
        forced = played & (self.forced_actions[:, 0] >= 0)
        mask = played & ~forced
        life_lost = (lives < self.lives) & played
        ends = (terminated | truncated) & played
        dones = (terminated | life_lost) & mask
        self.returns[played] += raw[played]
        self.lengths[played] += 1
        finished = [(int(i), float(self.returns[i]), int(self.lengths[i])) for i in np.flatnonzero(ends)]
        self.returns[ends] = 0.0
        self.lengths[ends] = 0
        self.lives = lives
        if self.ale:
            self.forced_actions[forced] = np.roll(self.forced_actions[forced], -1, axis=1)
            self.forced_actions[forced, -1] = -1
            self._force(life_lost & ~ends, life_lost=True)
            self._force(self.pending_reset, life_lost=False)  # a new game starts: FIRE (where it has it), 2
            self.forced_actions[ends] = -1  # the next step is the reset
            fresh = ~mask  # after an autoreset or forced step, the stack starts afresh
            if self.zero_stacks and not self.forced_steps:  # and after a life loss, where no forced step follows
                fresh |= life_lost & ~ends
            self.stacks = np.concatenate([self.stacks[:, 1:], next_obs], axis=1)
            self.stacks[fresh] = self.new_stacks(next_obs[fresh])
            next_obs = self.stacks
        self.pending_reset = ends
        self.seconds += time.perf_counter() - start
        return StepResult(
            next_obs=next_obs,
            rewards=np.sign(raw).astype(np.float32),
            raw_rewards=raw,
            dones=dones,
            truncations=truncated & played,
            ends=ends,
            mask=mask,
            episode_returns=finished,
        )

    def close(self) -> None:
        if self._sent is not None:
            self.recv()
        self.envs.close()


def _lives(info: dict, num_envs: int) -> np.ndarray:
    lives = info.get("lives")
    if lives is None:
        return np.zeros(num_envs, dtype=np.int64)
    return np.asarray(lives, dtype=np.int64)


def make_vector_env(env_id: str, num_envs: int, noop_max: int = NOOP_MAX) -> gym.vector.VectorEnv:
    """Whole games with raw rewards; for ALE games single frames (TrainEnvs stacks them) and up to
    ``noop_max`` no-op frames at a game's start. TrainEnvs derives life loss and clipping."""
    game = ale_game(env_id)
    if game is not None:
        return AtariVectorEnv(
            game,
            num_envs,
            max_num_frames_per_episode=MAX_FRAMES_PER_EPISODE,
            repeat_action_probability=0.0,
            frameskip=4,
            maxpool=True,
            stack_num=1,
            img_height=84,
            img_width=84,
            grayscale=True,
            noop_max=noop_max + 1,  # ale-py draws 0 to noop_max - 1 no-op frames
            use_fire_reset=False,  # TrainEnvs presses FIRE as CleanRL does, after the no-ops, for 4 frames
            episodic_life=False,
            life_loss_info=False,
            reward_clipping=False,
            autoreset_mode=AutoresetMode.NEXT_STEP,
        )
    envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync")
    space = envs.single_observation_space
    if space.shape != OBSERVATION_SHAPE or space.dtype != np.uint8:
        raise EnvIdError(
            f"--env-id {env_id} gives observations {space.shape} {space.dtype}; the algorithms need "
            f"uint8 {OBSERVATION_SHAPE} frame stacks (Atari games: use a *NoFrameskip-v4 id)"
        )
    if not isinstance(envs.single_action_space, gym.spaces.Discrete):
        raise EnvIdError(f"--env-id {env_id} has a {envs.single_action_space} action space; need Discrete")
    if envs.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP) != AutoresetMode.NEXT_STEP:
        raise EnvIdError(f"--env-id {env_id}: only next-step autoreset is supported")
    return envs


EVAL_PARALLEL_GAMES = 10  # games an evaluation plays at a time (benchmarks/evaluation_cost.py measured it)


def play_episodes(
    env_id: str,
    num_episodes: int,
    seed: int,
    select_actions,
    n_actions: int,
    epsilon: float,
    rng: np.random.Generator,
    record: Callable[[np.ndarray], None] | None = None,
    forced_steps: bool = True,
    parallel: int = EVAL_PARALLEL_GAMES,
    zero_stacks: bool = False,
    noop_starts: str = "frames",
    on_game_end: Callable[[int, int, float, int], None] | None = None,
) -> tuple[list[float], list[int], np.ndarray]:
    """Play ``num_episodes`` whole games under the training protocol (forced steps, fresh stacks
    after a life loss) but with raw rewards and no life-loss ending, with epsilon-greedy actions
    from ``select_actions``. Returns the per-game returns, lengths (agent steps, forced ones
    included) and the histogram of the actions the agent chose and played.

    Game i is seeded ``seed + i`` and draws its exploration from its own generator (the i-th that
    ``rng`` spawns), so it is the same game whichever environment plays it and when. At most
    ``parallel`` games are played at a time, each finished game making room for the next one
    (every game is played to its end, so short games are not over-represented), and only the
    games being played are forwarded: the evaluation costs what its games cost, not
    ``num_episodes`` times its longest game.

    ``record``, if given, is called with game 0's frames as its agent sees them: the newest 84x84
    frame of its stack at the start, then after each of its steps, the last one being the game's
    end: its length + 1 frames. Recording changes nothing.
    ``on_game_end``, if given, is called as each game ends, in the order they end, with the game's index, how many
    games have ended (this one included), its return and its length: what shows a long evaluation is alive.
    ``forced_steps``, ``zero_stacks``, ``noop_starts``: the protocol, as ``TrainEnvs``'s (``TrainEnvs.protocol``)."""
    if parallel < 1:
        raise ValueError(f"parallel={parallel}: at least one game must be played at a time")
    slots = min(num_episodes, parallel)
    game_rngs = rng.spawn(num_episodes)
    # slot k starts game k, seed + k
    envs = TrainEnvs(
        env_id, slots, seed=seed, forced_steps=forced_steps, zero_stacks=zero_stacks, noop_starts=noop_starts
    )
    try:
        obs = envs.reset()
        if record is not None:
            record(obs[0, -1].copy())
        game = np.arange(slots)  # the game each slot plays; -1: none left for it
        next_game, ended = slots, 0
        returns = np.zeros(num_episodes)
        lengths = np.zeros(num_episodes, dtype=np.int64)
        histogram = np.zeros(n_actions, dtype=np.int64)
        while (game >= 0).any():
            playing = game >= 0
            actions = np.zeros(slots, dtype=np.int64)
            actions[playing] = np.asarray(select_actions(obs[playing]), dtype=np.int64)
            for slot in np.flatnonzero(playing):
                game_rng = game_rngs[game[slot]]
                if game_rng.random() < epsilon:
                    actions[slot] = game_rng.integers(0, n_actions)
            step = envs.step(actions)
            histogram += np.bincount(actions[playing & step.mask], minlength=n_actions)
            if record is not None and game[0] == 0:
                record(step.next_obs[0, -1].copy())
            obs = step.next_obs
            starting = np.zeros(slots, dtype=bool)
            for slot, episodic_return, length in step.episode_returns:
                if game[slot] < 0:
                    continue
                returns[game[slot]], lengths[game[slot]] = episodic_return, length
                ended += 1
                if on_game_end is not None:
                    on_game_end(int(game[slot]), ended, float(episodic_return), int(length))
                game[slot], starting[slot] = (next_game, True) if next_game < num_episodes else (-1, False)
                next_game += starting[slot]
            if starting.any():
                obs = envs.restart(starting, seed + game[starting])
        return returns.tolist(), lengths.tolist(), histogram
    finally:
        envs.close()


def random_play_frames(env_id: str, steps: int = 256, seed: int = 0) -> np.ndarray:
    """The frames of ``steps`` agent steps of uniform random play in one game under the training protocol (the
    first stack's newest frame, then each step's): what estimates that depend on a game's look are made from."""
    envs = TrainEnvs(env_id, 1, seed=seed)
    try:
        rng = np.random.default_rng(seed)
        frames = [envs.reset()[0, -1]]
        for _ in range(steps):
            frames.append(envs.step(rng.integers(0, envs.n_actions, 1)).next_obs[0, -1])
    finally:
        envs.close()
    return np.stack(frames)
