"""Evaluation under the protocol: whole games, raw score, epsilon-greedy, separately seeded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from torch import nn

from cleanrl_utils.envs import OBSERVATION_SHAPE, play_episodes
from cleanrl_utils.scores import human_normalized_score


def evaluate(
    q_network: nn.Module,
    env_id: str,
    n_actions: int,
    device: torch.device,
    episodes: int = 10,
    epsilon: float = 0.01,
    seed: int = 0,
    video_path: Path | None = None,
    protocol: dict[str, Any] | None = None,
    on_game_end: Callable[[int, int, float, int], None] | None = None,
) -> dict[str, Any]:
    """Play ``episodes`` whole games with the network's greedy action (argmax of its forward
    output, the Q-values) taken with probability 1 - ``epsilon``. With ``video_path``, the first of
    these games (seeded ``seed``) is recorded as MP4 as it is played and scored (``mp4_recorder``).
    ``protocol``: how the games are played for the agent, as the training's ``TrainEnvs.protocol`` (forced steps,
    zero-filled stacks, no-op starts); None: ``TrainEnvs``'s defaults, the Nature DQN protocol.
    ``on_game_end``: called as each game ends with its index (its seed is ``seed`` + index), how many games have
    ended, its return and its length."""
    was_training = q_network.training
    q_network.eval()

    @torch.no_grad()
    def greedy(obs: np.ndarray) -> np.ndarray:
        return q_network(torch.as_tensor(obs, device=device)).argmax(dim=1).cpu().numpy()

    try:
        with contextlib.nullcontext() if video_path is None else mp4_recorder(video_path) as record:
            rng = np.random.default_rng(seed)  # the evaluation's own exploration draws
            returns, lengths, histogram = play_episodes(
                env_id,
                episodes,
                seed,
                greedy,
                n_actions,
                epsilon,
                rng,
                record=record,
                on_game_end=on_game_end,
                **(protocol or {}),
            )
    finally:
        q_network.train(was_training)
    mean = float(np.mean(returns))
    return {
        "episodic_returns": returns,
        "episodic_lengths": lengths,
        "mean": mean,
        "std": float(np.std(returns)),
        "action_histogram": histogram.tolist(),
        "human_normalized_score": human_normalized_score(env_id, mean),
        "epsilon": epsilon,
        "seed": seed,
    }


VIDEO_SCALE = 4  # each 84x84 frame shown 336x336, pixel for pixel
VIDEO_FPS = 15  # an agent step is 4 frames of the game's 60: real time


@contextlib.contextmanager
def mp4_recorder(path: Path) -> Iterator[Callable[[np.ndarray], None]]:
    """A ``record`` for ``play_episodes`` that writes the frames it is given to ``path`` as MP4 with
    OpenCV (no extra dependency). The frames are the scored game's own observations, the 84x84
    grayscale frames the agent acts on (in ALE games max-pooled over two screens), enlarged:
    ale-py's vector environment gives no RGB screen of one of its games, and a second, RGB
    environment would play another game than the scored one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = (VIDEO_SCALE * n for n in OBSERVATION_SHAPE[1:])
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), VIDEO_FPS, (width, height))

    def record(frame: np.ndarray) -> None:
        frame = cv2.resize(frame, (width, height), interpolation=cv2.INTER_NEAREST)
        writer.write(cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR))

    try:
        yield record
    finally:
        writer.release()
