"""Reference scores for the Atari-57 benchmark and human-normalisation helpers.

Each game maps to a pair ``(random, human)``: the average undiscounted return
of an agent that picks actions uniformly at random, and that of a professional
human games tester. Both were measured under the "no-op starts" protocol
(every episode begins with a random number, 1 to 30, of no-op actions, and
episodes are capped at 108,000 frames).

The numbers are those shipped in DeepMind's DQN Zoo
(``dqn_zoo/atari_data.py``, https://github.com/google-deepmind/dqn_zoo).
They originally come from Mnih et al. (2015), "Human-level control through
deep reinforcement learning", and van Hasselt et al. (2016), "Deep
Reinforcement Learning with Double Q-learning", with the games added to
the benchmark later taken from Badia et al. (2020), "Agent57: Outperforming
the Atari Human Benchmark".

A human-normalised score is ``(score - random) / (human - random)``, so that 0
means random play and 1 means human-level play.
"""

from __future__ import annotations

import re

__all__ = ["REFERENCE_SCORES", "game_name", "human_normalized_score"]

# Game name (as in Gymnasium / ALE ids) -> (random score, human score).
REFERENCE_SCORES: dict[str, tuple[float, float]] = {
    "Alien": (227.8, 7127.7),
    "Amidar": (5.8, 1719.5),
    "Assault": (222.4, 742.0),
    "Asterix": (210.0, 8503.3),
    "Asteroids": (719.1, 47388.7),
    "Atlantis": (12850.0, 29028.1),
    "BankHeist": (14.2, 753.1),
    "BattleZone": (2360.0, 37187.5),
    "BeamRider": (363.9, 16926.5),
    "Berzerk": (123.7, 2630.4),
    "Bowling": (23.1, 160.7),
    "Boxing": (0.1, 12.1),
    "Breakout": (1.7, 30.5),
    "Centipede": (2090.9, 12017.0),
    "ChopperCommand": (811.0, 7387.8),
    "CrazyClimber": (10780.5, 35829.4),
    "Defender": (2874.5, 18688.9),
    "DemonAttack": (152.1, 1971.0),
    "DoubleDunk": (-18.6, -16.4),
    "Enduro": (0.0, 860.5),
    "FishingDerby": (-91.7, -38.7),
    "Freeway": (0.0, 29.6),
    "Frostbite": (65.2, 4334.7),
    "Gopher": (257.6, 2412.5),
    "Gravitar": (173.0, 3351.4),
    "Hero": (1027.0, 30826.4),
    "IceHockey": (-11.2, 0.9),
    "Jamesbond": (29.0, 302.8),
    "Kangaroo": (52.0, 3035.0),
    "Krull": (1598.0, 2665.5),
    "KungFuMaster": (258.5, 22736.3),
    "MontezumaRevenge": (0.0, 4753.3),
    "MsPacman": (307.3, 6951.6),
    "NameThisGame": (2292.3, 8049.0),
    "Phoenix": (761.4, 7242.6),
    "Pitfall": (-229.4, 6463.7),
    "Pong": (-20.7, 14.6),
    "PrivateEye": (24.9, 69571.3),
    "Qbert": (163.9, 13455.0),
    "Riverraid": (1338.5, 17118.0),
    "RoadRunner": (11.5, 7845.0),
    "Robotank": (2.2, 11.9),
    "Seaquest": (68.4, 42054.7),
    "Skiing": (-17098.1, -4336.9),
    "Solaris": (1236.3, 12326.7),
    "SpaceInvaders": (148.0, 1668.7),
    "StarGunner": (664.0, 10250.0),
    "Surround": (-10.0, 6.5),
    "Tennis": (-23.8, -8.3),
    "TimePilot": (3568.0, 5229.2),
    "Tutankham": (11.4, 167.6),
    "UpNDown": (533.4, 11693.2),
    "Venture": (0.0, 1187.5),
    # Under other evaluation protocols the random score on Video Pinball can
    # exceed the human one; these are the no-op starts values.
    "VideoPinball": (16256.9, 17667.9),
    "WizardOfWor": (563.5, 4756.5),
    "YarsRevenge": (3092.9, 54576.9),
    "Zaxxon": (32.5, 9173.3),
}


def _canonical(name: str) -> str:
    """Lower-case a name and drop separators, for loose comparison."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


_LOOKUP: dict[str, str] = {_canonical(key): key for key in REFERENCE_SCORES}

_VERSION_SUFFIX = re.compile(r"-v\d+$", re.IGNORECASE)
_VARIANT_SUFFIX = re.compile(r"(NoFrameskip|Deterministic)$", re.IGNORECASE)
_RAM_SUFFIX = re.compile(r"-ram$", re.IGNORECASE)


def game_name(env_id: str) -> str:
    """Return the table key for an environment id.

    Namespaces (``ALE/``), version tags (``-v4``), frame-skip variants
    (``NoFrameskip``, ``Deterministic``) and ``-ram`` are removed, then the
    rest is matched case-insensitively against :data:`REFERENCE_SCORES`,
    ignoring underscores and hyphens (so ``"ms_pacman"`` gives
    ``"MsPacman"``). A name not in the table comes back stripped but
    otherwise unchanged.

    >>> game_name("BreakoutNoFrameskip-v4")
    'Breakout'
    >>> game_name("ALE/MsPacman-v5")
    'MsPacman'
    """
    name = env_id.strip().rsplit("/", 1)[-1]
    name = _VERSION_SUFFIX.sub("", name)
    name = _VARIANT_SUFFIX.sub("", name)
    name = _RAM_SUFFIX.sub("", name)
    return _LOOKUP.get(_canonical(name), name)


def human_normalized_score(env_id: str, score: float) -> float | None:
    """Map a raw episodic return to a human-normalised score.

    Returns ``(score - random) / (human - random)``, or ``None`` when the
    game is not one of the 57 in :data:`REFERENCE_SCORES`.
    """
    reference = REFERENCE_SCORES.get(game_name(env_id))
    if reference is None:
        return None
    random_score, human_score = reference
    return (score - random_score) / (human_score - random_score)
