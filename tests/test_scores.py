import math

import pytest

from cleanrl_utils.scores import REFERENCE_SCORES, game_name, human_normalized_score


def test_table_has_57_games() -> None:
    assert len(REFERENCE_SCORES) == 57
    for random_score, human_score in REFERENCE_SCORES.values():
        assert human_score > random_score


@pytest.mark.parametrize(
    ("game", "random_score", "human_score"),
    [
        ("Pong", -20.7, 14.6),
        ("Breakout", 1.7, 30.5),
        ("BeamRider", 363.9, 16926.5),
        ("Seaquest", 68.4, 42054.7),
        ("Qbert", 163.9, 13455.0),
        ("SpaceInvaders", 148.0, 1668.7),
        ("Enduro", 0.0, 860.5),
        ("MsPacman", 307.3, 6951.6),
    ],
)
def test_sanity_values(game: str, random_score: float, human_score: float) -> None:
    assert REFERENCE_SCORES[game] == (random_score, human_score)


@pytest.mark.parametrize(
    ("env_id", "expected"),
    [
        ("BreakoutNoFrameskip-v4", "Breakout"),
        ("ALE/Breakout-v5", "Breakout"),
        ("Breakout-v4", "Breakout"),
        ("breakout", "Breakout"),
        ("Breakout", "Breakout"),
        ("BreakoutDeterministic-v4", "Breakout"),
        ("ALE/Breakout-ram-v5", "Breakout"),
        ("ms_pacman", "MsPacman"),
        ("MsPacmanNoFrameskip-v4", "MsPacman"),
        ("montezuma_revenge", "MontezumaRevenge"),
        ("ALE/MontezumaRevenge-v5", "MontezumaRevenge"),
        ("up_n_down", "UpNDown"),
        ("kung_fu_master", "KungFuMaster"),
        ("ALE/YarsRevenge-v5", "YarsRevenge"),
        ("CartPole-v1", "CartPole"),
        ("ALE/Tetris-v5", "Tetris"),
    ],
)
def test_game_name(env_id: str, expected: str) -> None:
    assert game_name(env_id) == expected


def test_every_key_round_trips() -> None:
    for key in REFERENCE_SCORES:
        assert game_name(f"{key}NoFrameskip-v4") == key
        assert game_name(f"ALE/{key}-v5") == key
        assert game_name(key.lower()) == key


def test_normalized_score_endpoints() -> None:
    assert human_normalized_score("PongNoFrameskip-v4", 14.6) == pytest.approx(1.0)
    assert human_normalized_score("ALE/Pong-v5", -20.7) == pytest.approx(0.0)
    assert human_normalized_score("pong", 0.0) == pytest.approx(20.7 / 35.3)


def test_normalized_score_hand_computation() -> None:
    # Breakout: (400 - 1.7) / (30.5 - 1.7) = 398.3 / 28.8
    value = human_normalized_score("BreakoutNoFrameskip-v4", 400.0)
    assert value is not None
    assert math.isclose(value, 398.3 / 28.8)


def test_unknown_game_returns_none() -> None:
    assert human_normalized_score("CartPole-v1", 500.0) is None
    assert human_normalized_score("ALE/Tetris-v5", 10.0) is None
