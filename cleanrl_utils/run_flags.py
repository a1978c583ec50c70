"""The flags every script shares for running, not for learning: threads, where the run goes, checkpoints and
resuming, where the replay frames live. Each script's ``Args`` adds them by subclassing, so the command line is
unchanged (``--checkpoint-every``, ``--resume``, ...) and the algorithm's own flags stay in the script."""

from dataclasses import dataclass
from typing import Literal


@dataclass
class RunFlags:
    torch_threads: int = 0
    """torch's CPU threads (0: automatic, printed at start; see docs/throughput.md)"""
    run_dir: str = "runs"
    """the folder that receives the run folder"""
    checkpoint_every: int = 250_000
    """agent steps between checkpoints (0: only on SIGINT/SIGTERM); shorter runs write none"""
    checkpoint_buffer: bool = False
    """whether checkpoints hold the replay memory too (exact resume; ~7 GB per 1M transitions)"""
    checkpoint_keep: int = 3
    """how many of the newest checkpoints to keep"""
    resume: str | None = None
    """a run folder (its newest checkpoint) or one checkpoint folder to continue, in the same run folder"""
    buffer_device: Literal["host", "cuda"] = "host"
    """where the replay frames live: host memory, or the training GPU (about 7.1 GB per 1M transitions)"""
