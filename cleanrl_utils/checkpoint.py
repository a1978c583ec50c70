"""Checkpoints that let a run continue exactly: atomic writes, the last K kept, safe loading, signals.

A checkpoint is a folder ``RUN_DIR/checkpoints/step_000000123456/`` with ``state.pt`` (networks,
optimizer, counters, every RNG, environment state where the environments allow it, evaluations so
far; loaded with ``torch.load(weights_only=True)``, so it cannot run code) and, with
``--checkpoint-buffer``, ``replay/*.npy`` (plain arrays, loaded with ``allow_pickle=False``).
It is written as ``step_....tmp``, every file fsynced, then renamed: a checkpoint folder without
``.tmp`` is complete. SIGINT/SIGTERM ask the loop to finish its step, checkpoint and exit 0; a
second signal exits at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cleanrl_utils.checks import fail
from cleanrl_utils.run import write_json_atomic

FORMAT_VERSION = 1
PREFIX = "step_"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why and what to do."""


# ---------------------------------------------------------------- plain data <-> weights_only-safe data


def _encode(value: Any) -> Any:
    """NumPy arrays become tensors (``torch.load(weights_only=True)`` refuses NumPy objects)."""
    if isinstance(value, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.ascontiguousarray(value).copy())}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(v) for v in value)
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__ndarray__"}:
            return value["__ndarray__"].numpy()
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(v) for v in value)
    return value


def _older_replay_state(state: dict[str, Any]) -> dict[str, Any]:
    """Checkpoints written before the buffers had ``state_dict`` (same format version) kept the replay
    memory as ``{name: value}`` read off the buffer's attributes, its generator as ``{"__generator__": ...}``
    and the sum tree nested as ``{"__object__": ...}``: the same fields, flattened here."""
    flat: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, dict) and "__generator__" in value:
            flat[name] = value["__generator__"]
        elif isinstance(value, dict) and "__object__" in value:
            flat.update({f"{name}.{k}": v for k, v in value["__object__"].items()})
        else:
            flat[name] = value
    return flat


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_array(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def moments_like_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Give each per-parameter state tensor (Adam's moments) its parameter's memory layout. A checkpoint
    written where the networks were contiguous (CUDA) and loaded where they are channels-last (CPU), or
    the reverse, otherwise pairs NHWC parameters with NCHW moments, and the fused Adam kernel, which walks
    them in memory order, gets every update after the resume wrong (tests/test_checkpoint.py)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape and value.stride() != p.stride():
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)  # p's strides


def optimizers_in(module: Any) -> list[torch.optim.Optimizer]:
    """The optimizer itself, or those a ValueAlgorithm (the template) holds as attributes."""
    if isinstance(module, torch.optim.Optimizer):
        return [module]
    return [value for value in vars(module).values() if isinstance(value, torch.optim.Optimizer)]


# ---------------------------------------------------------------- environments


def continue_run(args: Any, script: str) -> tuple[Any, Resumed | None]:
    """With ``--resume``: the checkpoint (refused now if unusable, before anything is allocated) and the
    run's own arguments; flags given beside ``--resume`` that differ from them are ignored, with a word."""
    if not args.resume:
        return args, None
    resumed = find_checkpoint(args.resume, script)
    saved = {k: v for k, v in resumed.args.items() if k in vars(args) and k != "resume"}
    gone = {k: v for k, v in resumed.args.items() if k not in vars(args)}  # settings the script no longer has
    switched_on = [f"--{k.replace('_', '-')} {v}" for k, v in gone.items() if v is True or (k == "n_step" and v != 1)]
    if switched_on:
        fail(
            f"--resume {args.resume}: the run used {', '.join(switched_on)}, which {Path(script).name} no longer has "
            "(Rainbow's parts are in algos/rainbow.py); resume it with the version of the script that wrote it"
        )
    if gone:
        print(f"warning: --resume: settings this script no longer has, left at their off values: {sorted(gone)}")
    defaults = type(args)()
    ignored = [
        f"--{k.replace('_', '-')}"
        for k, v in saved.items()
        if getattr(args, k) != v and getattr(args, k) != getattr(defaults, k)
    ]
    if ignored:
        print(f"warning: --resume continues with the run's own settings; ignoring {', '.join(ignored)}", flush=True)
    return dataclasses.replace(args, **saved), resumed


# ---------------------------------------------------------------- finding and loading


@dataclass
class Resumed:
    """A checkpoint read back: where it is and everything in ``state.pt``."""

    path: Path
    run_dir: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["global_step"])

    @property
    def args(self) -> dict[str, Any]:
        return dict(self.state["original_args"])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run folder, newest first."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".tmp")]
    return sorted(found, key=lambda p: p.name, reverse=True)


def read_checkpoint(path: Path, script: str) -> Resumed:
    """Load ``state.pt`` safely and check it belongs to this script; CheckpointError says why not."""
    path = Path(path)
    state_file = path / "state.pt"
    if not state_file.is_file():
        raise CheckpointError(f"{path} has no state.pt (not a checkpoint folder, or an unfinished write)")
    try:
        state = _decode(torch.load(state_file, map_location="cpu", weights_only=True))
    except Exception as error:  # truncated, corrupted or foreign files all land here
        raise CheckpointError(f"{state_file} cannot be read ({type(error).__name__}: {str(error)[:200]})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{state_file} is not a value-atari checkpoint (format {FORMAT_VERSION})")
    algo = Path(script).stem
    if state["algo"] != algo:
        raise CheckpointError(
            f"{path} was written by {state['algo']}.py, not {algo}.py: resume it with algos/{state['algo']}.py"
        )
    if state["buffer_saved"]:
        missing = [name for name in state["replay_arrays"] if not (path / "replay" / f"{name}.npy").is_file()]
        if missing:
            raise CheckpointError(f"{path}/replay lacks {', '.join(missing)} (an incomplete copy?)")
    run_dir = path.parent.parent
    return Resumed(path=path, run_dir=run_dir, state=state)


def _run_summary(run: Path) -> str:
    try:
        receipt = json.loads((run / "receipt.json").read_text())
    except (OSError, ValueError):
        receipt = {}
    newest = list_checkpoints(run)
    where = f"newest checkpoint at step {int(newest[0].name[len(PREFIX) :])}" if newest else "no checkpoint"
    return f"{run}  ({receipt.get('algo', '?')}, {receipt.get('status', '?')}, {where})"


def _one_run_under(folder: Path, resume: str, algo: str) -> Path:
    """``--resume`` given a folder of runs (a ``--run-dir``): the one run of this script that has a
    checkpoint; otherwise stop and list the runs there."""
    runs = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "receipt.json").is_file())
    if not runs:
        fail(f"--resume {resume}: neither a run folder nor a folder of runs (no receipt.json there or one level down)")
    mine = []
    for run in runs:
        try:
            if json.loads((run / "receipt.json").read_text()).get("algo") == algo and list_checkpoints(run):
                mine.append(run)
        except (OSError, ValueError):
            continue
    if len(mine) == 1:
        print(f"--resume {resume}: the one {algo} run there with a checkpoint is {mine[0]}", flush=True)
        return mine[0]
    listing = "\n".join(f"  {_run_summary(run)}" for run in runs)
    fail(
        f"--resume {resume} is a folder of {len(runs)} runs, {len(mine)} of them {algo} runs with a checkpoint; "
        f"give one run folder, e.g. --resume {mine[0] if mine else runs[0]}:\n{listing}"
    )


def find_checkpoint(resume: str, script: str) -> Resumed:
    """``--resume`` takes a run folder (its newest checkpoint) or one checkpoint folder. An unreadable
    checkpoint is refused with the reason and the next older one offered; nothing is deleted."""
    path = Path(resume)
    if not path.exists():
        fail(f"--resume {resume}: no such run folder or checkpoint; give a folder under runs/ that has checkpoints/")
    if (path / "state.pt").exists() or path.name.startswith(PREFIX):
        candidates = [path]
        older = [p for p in list_checkpoints(path.parent.parent) if p.name < path.name]
    else:
        if not (path / "receipt.json").is_file() and not (path / "checkpoints").is_dir():
            path = _one_run_under(path, resume, Path(script).stem)  # a --run-dir folder: its one run
        candidates = list_checkpoints(path)
        if not candidates:
            fail(
                f"--resume {resume}: no complete checkpoint in {path / 'checkpoints'} (the run wrote none: "
                "it stopped before its first --checkpoint-every, or ran with --checkpoint-every 0)"
            )
        older = candidates[1:]
    try:
        return read_checkpoint(candidates[0], script)
    except CheckpointError as error:
        offer = (
            f"; the next older checkpoint is {older[0]}: resume with --resume {older[0]}"
            if older
            else "; no older checkpoint exists"
        )
        fail(f"--resume: refusing checkpoint {candidates[0]}: {error}{offer}")


# ---------------------------------------------------------------- writing


class Checkpointer:
    """Writes and restores everything a run needs to continue; handles SIGINT/SIGTERM."""

    def __init__(
        self,
        run: Any,
        resumed: Resumed | None,
        *,
        replay: Any,
        envs: Any,
        rng: np.random.Generator | None = None,
        **modules: Any,
    ) -> None:
        """``modules``: what has ``state_dict()``/``load_state_dict()`` (networks, optimizer, or a whole
        ValueAlgorithm), saved under their keyword names; ``rng``: the loop's acting generator."""
        self.run = run
        self.args = run.args
        self.resumed = resumed
        self.modules = modules
        self.replay = replay
        self.envs = envs
        self.rng = rng
        self.folder = run.dir / "checkpoints"
        self.original_args = resumed.args if resumed is not None else dict(vars(run.args))
        self.stop_requested = False
        self.signals = 0
        self.training_done = False  # the loop has reached --total-timesteps: the final evaluation comes next
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        if self.args.checkpoint_buffer:
            self._check_disk()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        step = self.run.counts["env_steps"]
        if self.signals > 1:
            when = "during the final evaluation" if self.training_done else f"at step {step}"
            self.run.status = f"killed by a second {name} {when}"
            try:
                self.run.write_receipt()
            except Exception:  # exiting matters more than the record
                pass
            print(f"\n{name} again: exiting at once, no checkpoint; receipt.json says so", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.stop_requested = True
        if self.training_done:
            saved = " and the model is saved" if self.args.save_model else ""
            message = (
                f"training is done (step {step}); the final evaluation goes on to its end{saved}, then the run "
                "ends as finished; no checkpoint is written (signal again to exit at once, without the final "
                "evaluation)"
            )
        else:
            message = "finishing the current step, then writing a checkpoint (signal again to exit at once)"
        print(f"\n{name}: {message}", file=sys.stderr, flush=True)

    def _check_disk(self) -> None:
        need = self.replay.frames.nbytes * min(self.args.checkpoint_keep + 1, 2)
        free = shutil.disk_usage(self.run.dir).free
        if need > free:
            print(
                f"warning: --checkpoint-buffer needs about {need / 2**30:.1f} GiB per checkpoint on disk, "
                f"{free / 2**30:.1f} GiB are free under {self.run.dir}: checkpoints may fail",
                file=sys.stderr,
                flush=True,
            )

    def restore(self) -> tuple[np.ndarray, int, int, float, bool]:
        """Put the checkpoint back (networks, optimizer, RNGs, counters, the games where they can be saved,
        the replay memory if it was saved) and return the loop's ``obs, global_step, update_credit,
        start_time`` and whether the replay memory was restored. Games that cannot be saved (ale-py's)
        start anew, seeded apart from the first run's."""
        state = self.resumed.state
        for name, module in self.modules.items():
            module.load_state_dict(state[name])
            for buffer_name, value in state["module_buffers"].get(name, {}).items():  # e.g. NoisyLinear's noise
                module.get_buffer(buffer_name).copy_(value)
            for optimizer in optimizers_in(module):
                moments_like_parameters(optimizer)
        set_rng_state(state["rng"])
        if self.rng is not None:
            self.rng.bit_generator.state = state["loop_rng"]
        run = self.run
        run.counts.update(state["counts"])
        run.timings.update(state["timings"])
        run.evaluations = list(state["evaluations"])
        run.last_return = state["last_return"]
        write_json_atomic(run.dir / "evaluations.json", run.evaluations)  # drops any written after the checkpoint
        resume_count = len(state["resumes"]) + 1
        envs_restored = state["environments"] is not None and self.envs.games_can_be_saved
        if envs_restored:
            self.envs.load_state_dict(state["environments"])
            obs = state["obs"]
        else:  # the saved games are gone: new games, seeded apart from the first run's
            self.envs.seed = self.args.seed + 1_000_003 * resume_count
            obs = self.envs.reset()
        buffer_restored = bool(state["buffer_saved"])
        if buffer_restored:
            arrays = {
                n: np.load(self.resumed.path / "replay" / f"{n}.npy", allow_pickle=False)
                for n in state["replay_arrays"]
            }
            try:
                self.replay.load_state_dict(_older_replay_state(_rebuild(state["replay_state"], arrays)))
            except ValueError as error:
                fail(f"--resume {self.resumed.path}: {error}")
        if not envs_restored and buffer_restored:
            self.replay.cut_episodes()  # the saved games are gone: their transitions end there (bootstrapping)
        step = self.resumed.step
        self.training_done = step >= self.args.total_timesteps  # stopped by a signal in the loop's last step
        run.resumes = list(state["resumes"]) + [
            {
                "step": step,
                "checkpoint": str(self.resumed.path),
                "time": time.time(),
                "buffer_restored": buffer_restored,
                "environments_restored": envs_restored,
            }
        ]
        run.print(
            f"resumed from {self.resumed.path} at step {step} (replay memory "
            f"{'restored' if buffer_restored else 'empty: learning waits until step ' + str(step + self.args.learning_starts)}, "
            f"{'games continued' if envs_restored else 'new games started'})"
        )
        run.write_receipt()
        run.start_rate(step)  # steps/s counts this process's steps only
        return obs, step, int(state["update_credit"]), time.time() - float(state["train_seconds"]), buffer_restored

    def due(self, global_step: int, previous_step: int) -> bool:
        """Whether to checkpoint now; called last in every step of the loop, so it also says when training ends."""
        if self.stop_requested:
            return True
        total = self.args.total_timesteps
        if global_step >= total and not self.training_done:
            self.training_done = True
            self.run.print(f"training done at step {global_step}; final evaluation of {self.args.eval_episodes} games")
        every = self.args.checkpoint_every
        return every > 0 and global_step // every > previous_step // every and global_step < total

    def save(self, global_step: int, obs: np.ndarray, update_credit: int, start_time: float) -> Path | None:
        """Write a checkpoint (unless the networks hold non-finite values); after a signal, also close the run
        as interrupted and print the resume command (the script then exits 0: ``stop_requested``)."""
        run = self.run
        finite = all(_finite(module.state_dict()) for module in self.modules.values())
        path = None
        if finite:
            with run.timed("checkpoint"):
                path = self._write(global_step, obs, update_credit, time.time() - start_time)
            run.last_checkpoint = path
            run.print(f"checkpoint written: {path}")
        else:
            run.print(f"not checkpointing at step {global_step}: the network holds non-finite values")
        if self.stop_requested:
            run.close(status="interrupted")
            script = os.path.relpath(run.script)
            where = path.parent.parent if path is not None else run.dir
            run.print(f"stopped at step {global_step} by a signal; resume with: python {script} --resume {where}")
        return path

    def _write(self, global_step: int, obs: np.ndarray, update_credit: int, train_seconds: float) -> Path:
        run = self.run
        self.folder.mkdir(exist_ok=True)
        final = self.folder / f"{PREFIX}{global_step:012d}"
        tmp = final.with_name(final.name + ".tmp")
        for stale in self.folder.glob(f"{PREFIX}*.tmp"):  # left by a kill during an earlier write
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        replay_state = self.replay.state_dict() if self.args.checkpoint_buffer else {}
        arrays: dict[str, np.ndarray] = {}
        replay_state = _split_arrays(replay_state, arrays)
        if arrays:
            (tmp / "replay").mkdir()
            for name, array in arrays.items():
                _save_array(tmp / "replay" / f"{name}.npy", array)
            _fsync_dir(tmp / "replay")
        state = {
            "format": FORMAT_VERSION,
            "algo": run.algo,
            "env_id": self.args.env_id,
            "global_step": global_step,
            "update_credit": update_credit,
            "train_seconds": train_seconds,
            "original_args": self.original_args,
            "counts": dict(run.counts),
            "timings": dict(run.timings),
            "evaluations": run.evaluations,
            "last_return": run.last_return,
            "resumes": run.resumes,
            "wall_seconds": run.wall_before + time.time() - run.start,
            "rng": rng_state(),
            "loop_rng": None if self.rng is None else self.rng.bit_generator.state,
            "obs": np.asarray(obs),
            "environments": self.envs.state_dict() if self.envs.games_can_be_saved else None,
            "buffer_saved": bool(arrays),
            "replay_arrays": sorted(arrays),
            "replay_state": replay_state,
            **{name: module.state_dict() for name, module in self.modules.items()},
            # buffers left out of state_dict (persistent=False, e.g. NoisyLinear's current noise) continue too
            "module_buffers": {
                name: {k: v.detach().cpu().clone() for k, v in module.named_buffers()}
                for name, module in self.modules.items()
                if isinstance(module, torch.nn.Module)
            },
        }
        with open(tmp / "state.pt", "wb") as f:
            torch.save(_encode(state), f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step written twice (a signal right after a periodic checkpoint)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.folder)
        for old in list_checkpoints(run.dir)[self.args.checkpoint_keep :]:
            shutil.rmtree(old, ignore_errors=True)
        run.flush()
        return final


def _finite(state: Any) -> bool:
    """Every floating-point tensor in a (nested) state dict is finite."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_finite(v) for v in state)
    return True


def _split_arrays(state: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Move large arrays out of ``state`` (into ``arrays``, saved as .npy) leaving their names."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, np.ndarray) and value.nbytes > 4096:
            arrays[name] = value
            out[name] = {"__npy__": name}
        else:
            out[name] = value
    return out


def _rebuild(state: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """``_split_arrays`` undone (and the nesting of older checkpoints' sum tree kept for
    ``_older_replay_state``)."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, dict) and "__npy__" in value:
            out[name] = arrays[value["__npy__"]]
        elif isinstance(value, dict) and "__object__" in value:
            out[name] = {"__object__": _rebuild(value["__object__"], arrays)}
        else:
            out[name] = value
    return out
