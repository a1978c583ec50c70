"""The global random generators (Python's, NumPy's, torch's CPU and CUDA ones), saved and put back.

A checkpoint saves them so that a resumed run draws what the uninterrupted run would have drawn, and
the template's start-up checks (cleanrl_utils/tools/template_rules.py) put them back after trying the
algorithm, so that the checks change nothing of the run.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def random_state() -> dict[str, Any]:
    """The state of every global generator: ``python``, ``numpy``, ``torch`` and, where CUDA is
    initialised (asking otherwise would initialise it), ``cuda`` (one state per device)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_random_state(state: dict[str, Any]) -> None:
    """Put back what ``random_state`` returned, also after a round trip through a checkpoint (which
    turns the tuple inside Python's state into a list)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
