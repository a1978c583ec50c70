"""The run record: run folder, TensorBoard, standard output lines, progress, receipt, timings. ``Run`` (run.py)
writes through it; it knows no algorithm."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.tensorboard import SummaryWriter

REPO_ROOT = Path(__file__).resolve().parents[1]
RATE_WINDOW_SECONDS = 60.0  # steps/s and the time left are measured over about the last minute


def write_json_atomic(path: Path, data: Any) -> None:
    """Write to a temporary file, fsync, rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def git_revision() -> dict[str, Any]:
    def git(*cmd: str) -> str | None:
        try:
            out = subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    revision = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"revision": revision, "dirty": None if status is None else bool(status)}


def versions() -> dict[str, str]:
    import ale_py
    import gymnasium

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gymnasium": gymnasium.__version__,
        "ale_py": ale_py.__version__,
        "numpy": np.__version__,
    }


def hardware(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def peak_memory_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def format_eta(seconds: float | None) -> str:
    """``12.5min`` below two hours, ``3.4h`` above; ``unknown`` without a rate."""
    if seconds is None:
        return "unknown"
    return f"{seconds / 60:.1f}min" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def nonfinite(values: dict[str, float], network: torch.nn.Module) -> str | None:
    """What is not finite: the values named (``values=nan``), or else the network's weights; None if all are."""
    bad = [f"{k}={v}" for k, v in values.items() if not np.isfinite(v)]
    if bad:
        return ", ".join(bad)
    if not all(torch.isfinite(p).all() for p in network.parameters()):
        return "network weights"
    return None


class Record:
    """Everything a run writes; it never decides what the run does."""

    def __init__(self, args: Any, script: str, device: torch.device, checkpoint: Any = None) -> None:
        """``checkpoint`` (a ``Checkpoint`` read back): continue in its run folder; TensorBoard drops what the
        interrupted run logged after it (``purge_step``), so curves have no duplicate steps. The record itself
        (counts, evaluations, ...) comes back with ``resumed``."""
        self.start = time.time()
        self.args = args
        self.script = str(Path(script).resolve())
        self.algo = Path(script).stem
        self.git = git_revision()  # the code this process runs, even if the checkout changes meanwhile
        self.device = device
        self.replay_memory: Callable[[], dict[str, Any]] | None = None  # what the replay memory takes, for the receipt
        if checkpoint is None:
            self.name = (
                f"{args.env_id.replace('/', '_').replace(':', '_')}__{args.exp_name}__{args.seed}__{int(self.start)}"
            )
            self.dir = Path(args.run_dir) / self.name
            self.dir.mkdir(parents=True, exist_ok=False)
        else:
            self.dir = checkpoint.run_dir
            self.name = self.dir.name
        self.last_checkpoint = None if checkpoint is None else checkpoint.path
        self.resumes: list[dict[str, Any]] = []
        self.wall_before = 0.0 if checkpoint is None else float(checkpoint.state["run"]["wall_seconds"])
        self.timings: dict[str, float] = defaultdict(float)
        self.counts = {
            "env_steps": 0,
            "transitions_stored": 0,
            "gradient_updates": 0,
            "train_episodes": 0,
            "eval_episodes": 0,
            "evaluations": 0,
            "skipped_updates": 0,
        }
        self.evaluations: list[dict[str, Any]] = []
        self.last_return: float | None = None
        self.status = "running"
        self.stdout_closed_at_step: int | None = None
        self.rate_samples: deque[tuple[float, int]] = deque()
        self.start_rate(0 if checkpoint is None else checkpoint.step)
        if args.track:
            self._start_wandb()
        if checkpoint is None:
            self.writer = SummaryWriter(str(self.dir))
            self.writer.add_text(
                "hyperparameters",
                "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()),
            )
        else:
            self.writer = SummaryWriter(str(self.dir), purge_step=checkpoint.step + 1)
        self.progress = None
        self.interactive = sys.stderr.isatty() and not os.environ.get("CI")
        self.last_progress_print = time.time()
        self.write_receipt()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of the run: the algorithm, its arguments and the record so far."""
        return {
            "algo": self.algo,
            "args": dict(vars(self.args)),
            "run": {
                "counts": dict(self.counts),
                "timings": dict(self.timings),
                "evaluations": self.evaluations,
                "last_return": self.last_return,
                "resumes": self.resumes,
                "wall_seconds": self.wall_before + time.time() - self.start,
            },
        }

    def resumed(
        self,
        checkpoint: Any,
        replay_restored: bool | None,
        games_restored: bool,
        learning_starts: int,
        extension: dict[str, int] | None = None,
    ) -> None:
        """Take the record back from ``checkpoint`` (``evaluations.json`` loses any evaluation written after it)
        and note this resume in the receipt."""
        saved = checkpoint.state["run"]
        self.counts.update(saved["counts"])
        self.timings.update(saved["timings"])
        self.evaluations = list(saved["evaluations"])
        self.last_return = saved["last_return"]
        write_json_atomic(self.dir / "evaluations.json", self.evaluations)
        self.resumes = list(saved["resumes"]) + [
            {
                "step": checkpoint.step,
                "checkpoint": str(checkpoint.path),
                "time": time.time(),
                "buffer_restored": replay_restored,
                "environments_restored": games_restored,
                "extended": extension,  # {"from": the run's total, "to": the new --total-timesteps}
            }
        ]
        if replay_restored is None:  # a script without replay memory (PQN)
            memory = ""
        elif replay_restored:
            memory = "replay memory restored, "
        else:
            memory = f"replay memory empty: learning waits until step {learning_starts}, "
        extended = f"; extended from {extension['from']:,} to {extension['to']:,} steps" if extension else ""
        self.print(
            f"resumed from {checkpoint.path} at step {checkpoint.step} ({memory}"
            f"{'games continued' if games_restored else 'new games started'}{extended})"
        )
        self.write_receipt()
        self.start_rate(checkpoint.step)  # steps/s counts this process's steps only

    def checkpoint_written(self, path: Path | None, global_step: int) -> None:
        """Say where the checkpoint went (None: not written, the networks hold non-finite values)."""
        if path is None:
            self.print(f"not checkpointing at step {global_step}: the network holds non-finite values")
            return
        self.last_checkpoint = path
        self.print(f"checkpoint written: {path}")
        self.flush()

    @property
    def resume_command(self) -> str:
        return f"python {os.path.relpath(self.script)} --resume {self.dir}"

    def what_is_kept(self) -> str:
        """The run's last good checkpoint and how to resume from it, for a message."""
        if self.last_checkpoint is None:
            return "no checkpoint was written before it"
        return f"the last good checkpoint is {self.last_checkpoint}; resume with: {self.resume_command}"

    def _start_wandb(self) -> None:
        import wandb  # checks.validate_args has made sure it is installed

        wandb.init(
            project=self.args.wandb_project_name,
            entity=self.args.wandb_entity,
            sync_tensorboard=True,
            config=vars(self.args),
            name=self.name,
            save_code=True,
            dir=str(self.dir),
        )

    def episode(self, global_step: int, episodic_return: float, length: int) -> None:
        self.counts["train_episodes"] += 1
        self.last_return = episodic_return
        self.print(f"global_step={global_step}, episodic_return={episodic_return}")
        self.writer.add_scalar("charts/episodic_return", episodic_return, global_step)
        self.writer.add_scalar("charts/episodic_length", length, global_step)

    def train_metrics(
        self, rows: list[tuple[int, dict[str, float | torch.Tensor]]], line: bool = True
    ) -> list[dict[str, float]]:
        """Log ``losses/*`` scalars at each row's step, read from the device at once (the training loop's one host
        synchronisation, every 1000 steps), and the TRAIN_METRICS line of the newest row; return each row's values."""
        tensors = [v.detach().float().reshape(()) for _, m in rows for v in m.values() if torch.is_tensor(v)]
        read = iter(torch.stack(tensors).cpu().tolist() if tensors else [])
        values = [{k: next(read) if torch.is_tensor(v) else float(v) for k, v in m.items()} for _, m in rows]
        for (step, _), row in zip(rows, values, strict=True):
            for key, value in row.items():
                self.writer.add_scalar(f"losses/{key}", value, step)
        if line:
            fields = " ".join(f"{k}={v:.6g}" for k, v in values[-1].items())
            self.print(f"TRAIN_METRICS step={rows[-1][0]} {fields}")
        return values

    def flush(self) -> None:
        self.writer.flush()
        self.write_receipt()

    def scalar(self, tag: str, value: float, global_step: int) -> None:
        self.writer.add_scalar(tag, value, global_step)

    def evaluation_game(self, ended: int, games: int, episodic_return: float, length: int, seed: int) -> None:
        """One evaluation game's end, as it ends (CleanRL prints each evaluation game): a long evaluation, whose
        games can each run to the 27,000-step cap, shows it is alive."""
        self.print(f"eval_episode={ended}/{games}, episodic_return={episodic_return:g}, length={length}, seed={seed}")

    def evaluation(self, global_step: int, result: dict[str, Any], final: bool = False) -> None:
        self.counts["evaluations"] += 1
        self.counts["eval_episodes"] += len(result["episodic_returns"])
        entry = {"step": global_step, "final": final, **result}
        self.evaluations.append(entry)
        write_json_atomic(self.dir / "evaluations.json", self.evaluations)
        self.writer.add_scalar("eval/episodic_return", result["mean"], global_step)
        if result["human_normalized_score"] is not None:
            self.writer.add_scalar("eval/human_normalized_score", result["human_normalized_score"], global_step)
        self.print(f"Eval episodic_return: {result['mean']}")
        self.print(f"  eval std={result['std']:.3f} actions={result['action_histogram']}")
        if final:
            self.print(f"Final eval return: {result['mean']}")
        self.writer.flush()

    def video_path(self, global_step: int) -> Path | None:
        """Where an evaluation's recorded game goes, None unless --capture-video."""
        return self.dir / "videos" / f"eval_step_{global_step}.mp4" if self.args.capture_video else None

    def print(self, line: str) -> None:
        """A line on standard output. When its reader has gone (``| head``), nothing more is printed there and
        the run goes on; stderr says so and the receipt records the step (``stdout_closed_at_step``)."""
        if self.stdout_closed_at_step is not None:
            return
        try:
            if self.progress is not None:
                self.progress.write(line)
            else:
                print(line, flush=True)
        except BrokenPipeError:
            self.stdout_closed_at_step = self.counts["env_steps"]
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # later writes, and the interpreter's last flush, go nowhere
            os.close(devnull)
            print(
                f"note: standard output was closed by its reader (e.g. `| head`) at step {self.stdout_closed_at_step}; "
                f"the run goes on without printing there (Ctrl-C stops it with a checkpoint); its record is in "
                f"{self.dir}",
                file=sys.stderr,
                flush=True,
            )
            self.write_receipt()

    def start_rate(self, global_step: int, now: float | None = None) -> None:
        """Count steps/s from here: the loop's first step, or a resumed run's checkpoint step (the steps
        made before it, by an earlier process, do not count toward this one's rate)."""
        self.rate_samples = deque([(time.time() if now is None else now, global_step)])

    def recent_sps(self, global_step: int, now: float | None = None) -> float:
        """Agent steps per second over about the last minute (``RATE_WINDOW_SECONDS``, from the newest sample
        at least that old), counting only this process's steps: the rate the run has now, not its average."""
        now = time.time() if now is None else now
        samples = self.rate_samples
        samples.append((now, global_step))
        while samples[1][0] <= now - RATE_WINDOW_SECONDS:
            samples.popleft()
        then, step = samples[0]
        return (global_step - step) / max(now - then, 1e-9)

    def show_progress(self, global_step: int, total: int, sps: float, learning_starts: int | None = None) -> None:
        """A progress bar on a terminal; a plain line every 30 s otherwise. ``sps`` (``recent_sps``) gives the
        time left; before learning starts (``learning_starts``: its step) random play's rate says nothing of the
        learning phase's, so the time left is given to the first update only."""
        if learning_starts is None:
            eta = format_eta((total - global_step) / sps if sps > 0 else None)
        else:
            eta = f"{format_eta((learning_starts - global_step) / sps if sps > 0 else None)} to learning"
        if self.interactive:
            if self.progress is None:
                from tqdm import tqdm

                self.progress = tqdm(
                    total=total,
                    initial=global_step,
                    unit="step",
                    dynamic_ncols=True,
                    file=sys.stderr,
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
                )
            self.progress.update(global_step - self.progress.n)
            self.progress.set_postfix_str(f"sps={int(sps)}, eta={eta}, last_return={self.last_return}", refresh=False)
        elif time.time() - self.last_progress_print >= 30:
            self.last_progress_print = time.time()
            self.print(
                f"progress step={global_step}/{total} ({100 * global_step / total:.1f}%) sps={int(sps)} "
                f"last_return={self.last_return} eta={eta}"
            )

    def save_model(
        self, q_network: torch.nn.Module, n_actions: int, protocol: dict[str, Any], **network_kwargs: Any
    ) -> Path:
        """Weights plus what rebuilds the network, ``QNetwork(n_actions, **network_kwargs)``, and the protocol its
        games were played under (``TrainEnvs.protocol``, for the evaluation command)."""
        path = self.dir / f"{self.args.exp_name}.cleanrl_model"
        tmp = path.with_name(path.name + ".tmp")
        torch.save(
            {
                "state_dict": q_network.state_dict(),
                "algo": self.algo,
                "algo_script": self.script,
                "env_id": self.args.env_id,
                "n_actions": n_actions,
                "network_kwargs": network_kwargs,
                "protocol": protocol,
            },
            tmp,
        )
        os.replace(tmp, path)
        self.print(f"model saved to {path}")
        return path

    def write_receipt(self) -> None:
        receipt = {
            "status": self.status,
            "algo": self.algo,
            "command": [sys.executable, *sys.argv],
            "args": dataclasses.asdict(self.args),
            "seed": self.args.seed,
            "run_dir": str(self.dir),
            "git": self.git,
            "versions": versions(),
            "device": str(self.device),
            "dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            "hardware": hardware(self.device),
            "counts": dict(self.counts),
            "timings_seconds": {k: round(v, 3) for k, v in self.timings.items()},
            "wall_seconds": round(self.wall_before + time.time() - self.start, 3),
            "peak_process_memory_bytes": peak_memory_bytes(),
            "replay_memory": None if self.replay_memory is None else self.replay_memory(),
            "final_eval_return": next((e["mean"] for e in reversed(self.evaluations) if e["final"]), None),
            "last_checkpoint": None if self.last_checkpoint is None else str(self.last_checkpoint),
            "resumes": self.resumes,
            "stdout_closed_at_step": self.stdout_closed_at_step,
        }
        if self.device.type == "cuda":
            receipt["peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        write_json_atomic(self.dir / "receipt.json", receipt)

    def close(self, status: str = "finished") -> None:
        self.status = status
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        self.write_receipt()
        self.writer.close()
        if self.args.track:
            import wandb

            wandb.finish()
