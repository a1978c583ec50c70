"""Checkpoints as a plain store: save a dictionary of state at a step, atomically, keep the newest K; find and
load the newest. What goes in the dictionary, and what is done with it on ``--resume``, is the script's.

A checkpoint is a folder ``RUN_DIR/checkpoints/step_000000123456/`` with ``state.pt`` (the dictionary; loaded
with ``torch.load(weights_only=True)``, so it cannot run code). It is written as ``step_....tmp``, every file
fsynced, then renamed: a checkpoint folder without ``.tmp`` is complete.

A replay memory is saved incrementally. Its frames (all but a few bytes of each transition) go to
``RUN_DIR/checkpoints/replay_frames/`` as append-only segments, one file per environment's ring and checkpoint,
holding only the frames written since the checkpoint before (raw uint8 frames, zstandard level 1: Atari frames
shrink tens of times, faster than the disk takes them; benchmarks/RESULTS.md); the rest of the memory (actions, rewards, flags,
the rings' counters: about 11 bytes a transition) goes whole into ``state.pt`` with the list of segments that
rebuild its frames. A segment is complete before the checkpoint that lists it is renamed into place, and a
segment is deleted only when no kept checkpoint lists it: a kill at any moment leaves the newest complete
checkpoint whole, and the disk holds about one replay memory plus the intervals between the kept checkpoints.
Each segment's entry records its frame count, size and sha256, checked with zstandard's frame checksum on restore.
A write that fails (a full disk) removes what it had written and raises ``CheckpointError``. One process writes a
run folder at a time (``lock_run_dir``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

FORMAT_VERSION = 3  # 3: incremental replay frames; 2 (whole replay arrays per checkpoint) is still read; 1 refused
READABLE_FORMATS = (2, 3)
PREFIX = "step_"
FRAMES = "replay_frames"  # RUN_DIR/checkpoints/replay_frames/: the replay memory's frames, each written once
SEGMENT_CHUNK = 10_000  # frames compressed or restored at a time (70 MB of 84x84 frames)
MANIFEST = "replay_segments.json"  # in each checkpoint folder: the segments it needs (read when deleting)
# CleanRL's flags that the scripts answered but did not use, stored (at their defaults) by checkpoints written
# before issue 59 took them out of RunFlags; a resume leaves them out
RETIRED_ARGS = ("cuda", "upload_model", "hf_entity")
LOCK = "writer.lock"  # in each run folder: held (flock) by the one process that writes it
RETIRED = "retired-"  # checkpoints/retired-<unix time>/: the checkpoints a resume from an older one set aside


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, or written; the message says why and what to do. ``segment``: the name of
    the replay segment at fault, if one is."""

    def __init__(self, message: str, segment: str | None = None) -> None:
        super().__init__(message)
        self.segment = segment


def lock_run_dir(run_dir: Path) -> int:
    """Make this process the one writer of ``run_dir``: an exclusive ``flock`` on its lock file, which the kernel
    releases when the process ends, however it ends (a dead process's file does not block). Returns the file
    descriptor, to keep open for the process's life; raises CheckpointError, naming the holder, if another
    process holds it."""
    fd = os.open(Path(run_dir) / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
        os.close(fd)
        pid = holder.split()[0] if holder[:1].isdigit() else None
        raise CheckpointError(
            f"{run_dir} is being written by process {holder}: one process writes a run folder at a time; wait for "
            f"it to end{f', or stop it (kill {pid})' if pid else ''}, then resume"
        ) from None
    try:  # who holds it, for the message of the next one; the lock holds without it (a full disk)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} ({' '.join([Path(sys.executable).name, *sys.argv])})\n".encode())
    except OSError:
        pass
    return fd


# ---------------------------------------------------------------- the store


def save_checkpoint(
    folder: Path,
    step: int,
    state: dict[str, Any],
    replay: Any = None,
    keep: int = 3,
    segments: list[dict[str, Any]] | None = None,
) -> tuple[Path | None, list[dict[str, Any]] | None]:
    """Write ``state`` as the checkpoint of ``step`` under ``folder``, with ``replay`` (a replay memory, or None):
    its frames written since ``segments`` (the segment list of the checkpoint this process last wrote or resumed
    from) appended as new segments, the rest of it whole. Then delete all but the newest ``keep`` checkpoints and
    the segments none of them lists. Returns the checkpoint's path and its segment list; (None, None), writing
    nothing, when a floating-point tensor in ``state`` is not finite (such weights are no good to resume from).
    A write that fails (``OSError``: a full disk) removes what it had written and raises CheckpointError; the
    checkpoints before it stay whole. The caller is the folder's one writer (``lock_run_dir``)."""
    if not _finite(state):
        return None, None
    folder = Path(folder)
    final = folder / f"{PREFIX}{step:012d}"
    tmp = final.with_name(final.name + ".tmp")
    try:
        if not folder.is_dir():
            folder.mkdir(parents=True)
            _fsync_dir(folder.parent)
        _tidy(folder)  # a killed or failed write's leftovers: room for this one
        tmp.mkdir()
        listed = None if replay is None else _write_frames(folder / FRAMES, replay, segments or [])
        stored = {
            **state,
            "format": FORMAT_VERSION,
            "step": step,
            "replay": None if replay is None else {"small": replay.state_dict(frames=False), "segments": listed},
        }
        packed = io.BytesIO()  # serialized first: a failed write is then a plain OSError, not one inside torch's
        torch.save(_encode(stored), packed)
        _write_file(tmp / "state.pt", packed.getbuffer())
        _write_file(tmp / MANIFEST, json.dumps([s["file"] for s in listed or []]).encode())
        _fsync_dir(tmp)
    except OSError as error:
        _tidy(folder)  # the .tmp folder and the segments no complete checkpoint lists: this write's
        raise CheckpointError(
            f"the checkpoint of step {step} could not be written ({error}); what it had written is removed"
        ) from error
    if final.exists():  # the same step written twice (a signal right after a periodic checkpoint)
        _remove(final)
    os.replace(tmp, final)
    _fsync_dir(folder)
    for old in _complete(folder)[keep:]:
        _remove(old)
    _tidy(folder)
    return final, listed


def _write_file(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _remove(checkpoint: Path) -> None:
    """Delete a checkpoint folder: renamed to ``.tmp`` first, so that a kill midway leaves no complete-looking
    folder with part of its files."""
    doomed = checkpoint.with_name(checkpoint.name + ".old.tmp")
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _tidy(folder: Path) -> None:
    """Remove what no complete checkpoint needs: ``.tmp`` folders (a write or a deletion killed midway) and the
    segments none lists; all segments are kept while a checkpoint's list cannot be read."""
    for stale in folder.glob(f"{PREFIX}*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    if (folder / FRAMES).is_dir():
        lists = [_listed(path) for path in _complete(folder)]
        if any(names is None for names in lists):
            return
        kept = {name for names in lists for name in names}
        for segment in (folder / FRAMES).iterdir():
            if segment.name not in kept:
                segment.unlink(missing_ok=True)


class _Hashed:
    """A file written or read through this: the bytes that pass are counted and hashed (sha256)."""

    def __init__(self, file: Any) -> None:
        self.file, self.bytes, self.sha256 = file, 0, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.bytes += len(data)
        self.sha256.update(data)
        return self.file.write(data)

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.bytes += len(data)
        self.sha256.update(data)
        return data


def _write_frames(frames_dir: Path, replay: Any, segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append the frames each ring wrote since ``segments`` and return the segments that rebuild every ring's
    frames now (each ring's written indices ``[written - capacity, written)``), each with its frame count, size
    and sha256."""
    frames_dir.mkdir(exist_ok=True)
    token = uuid.uuid4().hex[:8]  # a resume from an older checkpoint writes other frames for the same indices
    listed = []
    for env in range(replay.num_envs):
        written = int(replay.written[env])
        oldest = max(0, written - replay.capacity)
        mine = [s for s in segments if s["env"] == env and oldest < s["stop"] <= written]
        start = max([oldest, *(s["stop"] for s in mine)])
        if start < written:
            name = f"env{env}_{start:012d}_{written:012d}_{token}.zst"
            with open(frames_dir / name, "wb") as f:
                hashed = _Hashed(f)
                with zstandard.ZstdCompressor(level=1, write_checksum=True).stream_writer(hashed, closefd=False) as z:
                    for first in range(start, written, SEGMENT_CHUNK):  # a chunk at a time: no copy of the whole
                        z.write(
                            np.ascontiguousarray(replay.frames_written(env, first, min(first + SEGMENT_CHUNK, written)))
                        )
                f.flush()
                os.fsync(f.fileno())
            mine.append(
                {
                    "env": env,
                    "start": start,
                    "stop": written,
                    "file": name,
                    "frames": written - start,
                    "bytes": hashed.bytes,
                    "sha256": hashed.sha256.hexdigest(),
                }
            )
        listed += mine
    _fsync_dir(frames_dir)
    return listed


def read_segment(path: Path, segment: dict[str, Any], replay: Any) -> None:
    """Put a segment's frames back into ``replay``, a chunk at a time (its raw uint8 frames, zstandard-packed),
    checked as they come: zstandard's frame checksum, the frame count and, where its entry records them (all
    but checkpoints written before issue 57), the file's size and sha256. A segment that fails a check raises
    CheckpointError naming the file."""
    frame_shape = tuple(replay.frame_shape)
    frame_bytes = int(np.prod(frame_shape))
    count = segment["stop"] - segment["start"]

    def refused(why: str) -> CheckpointError:
        return CheckpointError(f"the replay segment {path} {why}: a corrupted or truncated file", segment["file"])

    if segment.get("frames", count) != count:
        raise refused(f"is listed with {segment['frames']} frames for indices holding {count}")
    with open(path, "rb") as f:
        hashed = _Hashed(f)
        try:
            with zstandard.ZstdDecompressor().stream_reader(hashed, closefd=False) as unpacked:
                for first in range(segment["start"], segment["stop"], SEGMENT_CHUNK):
                    size = min(SEGMENT_CHUNK, segment["stop"] - first) * frame_bytes
                    data = unpacked.read(size)
                    while len(data) < size:  # a stream may return less than asked
                        more = unpacked.read(size - len(data))
                        if not more:
                            raise refused(
                                f"ends early, at frame {(first - segment['start']) + len(data) // frame_bytes} of {count}"
                            )
                        data += more
                    frames = np.frombuffer(data, dtype=np.uint8).reshape(-1, *frame_shape)
                    replay.load_frames_written(segment["env"], first, frames)
                if unpacked.read(1):  # also reads the frame's end, where zstandard checks its checksum
                    raise refused(f"holds more than its {count} frames")
        except zstandard.ZstdError as error:
            raise refused(f"cannot be unpacked ({error})") from None
        while hashed.read(1 << 20):  # the whole file, for its size and hash
            pass
    if "sha256" in segment and (hashed.bytes, hashed.sha256.hexdigest()) != (segment["bytes"], segment["sha256"]):
        raise refused(f"is not the file written ({hashed.bytes:,} bytes, not {segment['bytes']:,}, or another sha256)")


def _listed(checkpoint: Path) -> list[str] | None:
    """The segments a checkpoint needs; None if its list cannot be read (then no segment is known to be free:
    a checkpoint of format 2 has no list, and needs none, until it is deleted in turn)."""
    try:
        return json.loads((checkpoint / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Checkpoint:
    """A checkpoint read back: where it is and the dictionary it holds."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def run_dir(self) -> Path:
        return self.path.parent.parent

    def replay(self) -> dict[str, Any] | None:
        """The saved replay memory's ``state_dict()`` without its frames, or None if none was saved."""
        saved = self.state["replay"]
        if saved is None:
            return None
        return saved["small"] if "segments" in saved else self._format2_replay()

    def restore_replay(self, replay: Any) -> bool:
        """Put the saved replay memory back into ``replay`` (its frames read from their segments); False if the
        checkpoint holds none."""
        saved = self.state["replay"]
        if saved is None:
            return False
        if "segments" not in saved:  # format 2: the whole memory's arrays in this checkpoint
            replay.load_state_dict(self._format2_replay())
            return True
        replay.load_state_dict(saved["small"], frames=False)
        for segment in saved["segments"]:
            read_segment(self.path.parent / FRAMES / segment["file"], segment, replay)
        return True

    @property
    def segments(self) -> list[dict[str, Any]] | None:
        saved = self.state["replay"]
        return None if saved is None else saved.get("segments")

    def _format2_replay(self) -> dict[str, Any]:
        saved = self.state["replay"]
        arrays = {name: np.load(self.path / "replay" / f"{name}.npy", allow_pickle=False) for name in saved["arrays"]}
        return {**saved["small"], **arrays}


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run folder, newest first."""
    return _complete(Path(run_dir) / "checkpoints")


def load_checkpoint(path: Path, script: str) -> Checkpoint:
    """Load ``state.pt`` safely and check that it is complete, of this format and ``script``'s (the algorithm's
    file, or its name)."""
    algo, path = Path(script).stem, Path(path)
    state_file = path / "state.pt"
    if not state_file.is_file():
        raise CheckpointError(f"{path} has no state.pt (not a checkpoint folder, or an unfinished write)")
    try:
        state = _decode(torch.load(state_file, map_location="cpu", weights_only=True))
    except Exception as error:  # truncated, corrupted or foreign files all land here
        said = str(error).strip().split(". ")[0].rstrip(".")  # torch's first sentence, whole; the rest is advice
        raise CheckpointError(
            f"{state_file} cannot be read: a truncated, corrupted or foreign file ({type(error).__name__}: {said})"
        ) from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"{state_file} is not a value-atari checkpoint")
    if state["format"] not in READABLE_FORMATS:
        raise CheckpointError(
            f"{path} is a checkpoint of format {state['format']}, written by an earlier version of value-atari; "
            f"this version reads formats {READABLE_FORMATS[0]} to {READABLE_FORMATS[-1]}: resume it with the version that wrote it "
            "(its receipt.json names the git revision) or start a new run"
        )
    if state["algo"] != algo:
        raise CheckpointError(
            f"{path} was written by {state['algo']}.py, not {algo}.py: resume it with algos/{state['algo']}.py"
        )
    if state["replay"] is not None:
        if "segments" in state["replay"]:
            files = [path.parent / FRAMES / s["file"] for s in state["replay"]["segments"]]
        else:
            files = [path / "replay" / f"{n}.npy" for n in state["replay"]["arrays"]]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{path}: the replay memory's files {', '.join(missing[:3])} are missing (an incomplete copy?)"
            )
        for segment in state["replay"].get("segments", []):  # their contents are checked as they are restored
            size = (path.parent / FRAMES / segment["file"]).stat().st_size
            if segment.get("bytes", size) != size:
                raise CheckpointError(
                    f"the replay segment {path.parent / FRAMES / segment['file']} has {size:,} bytes, not the "
                    f"{segment['bytes']:,} written: a truncated or corrupted file",
                    segment["file"],
                )
    return Checkpoint(path=path, state=state)


def find_checkpoint(resume: str, script: str) -> Checkpoint:
    """The checkpoint that ``--resume`` names for ``script`` (the algorithm's file). ``--resume`` takes a run folder (its newest checkpoint), one checkpoint folder, or a folder of runs that
    holds one ``algo`` run with a checkpoint. An unreadable checkpoint is refused with the reason and the next
    older one offered; nothing is deleted."""
    algo, path = Path(script).stem, Path(resume)
    if not path.exists():
        raise CheckpointError(
            f"--resume {resume}: no such run folder or checkpoint; give a folder under runs/ that has checkpoints/"
        )
    if (path / "state.pt").exists() or path.name.startswith(PREFIX):
        if path.parent.name != "checkpoints":  # the run folder is the checkpoints/ folder's parent
            raise CheckpointError(
                f"--resume {resume}: not in a run folder's checkpoints/ (one set aside in checkpoints/{RETIRED}*/ "
                "resumes once moved back: docs/checkpoints.md)"
            )
        candidates = [path]
    else:
        if not (path / "receipt.json").is_file() and not (path / "checkpoints").is_dir():
            path = _one_run_under(path, resume, algo)  # a --run-dir folder: its one run
        candidates = list_checkpoints(path)
        if not candidates:
            raise CheckpointError(
                f"--resume {resume}: no complete checkpoint in {path / 'checkpoints'} (the run wrote none: "
                "it stopped before its first --checkpoint-every, or ran with --checkpoint-every 0)"
            )
    try:
        return load_checkpoint(candidates[0], script)
    except CheckpointError as error:
        raise refusal(candidates[0], error) from None


def refusal(checkpoint: Path, error: CheckpointError) -> CheckpointError:
    """``error`` about ``checkpoint`` as ``--resume`` says it: the checkpoint refused, and the next older one
    offered that does not need the segment at fault."""
    older = [p for p in list_checkpoints(checkpoint.parent.parent) if p.name < checkpoint.name]
    if error.segment is not None:
        older = [p for p in older if error.segment not in (_listed(p) or [])]
    if older:
        offer = f"the next older checkpoint is {older[0]}: resume with --resume {older[0]}"
    else:
        offer = "no older checkpoint exists" + (" without that segment" if error.segment else "")
    return CheckpointError(f"--resume: refusing checkpoint {checkpoint}: {error}; {offer}", error.segment)


def retire_newer(checkpoint: Checkpoint) -> Path | None:
    """Set aside the checkpoints newer than ``checkpoint``, whose timeline a resume from it abandons (else
    ``--resume RUN``, which takes the newest, would go back to it): moved into ``checkpoints/retired-<unix
    time>/`` with links to the segments they need, so that folder holds them whole. Returns it; None if none is
    newer."""
    folder = checkpoint.path.parent
    newer = [p for p in _complete(folder) if p.name > checkpoint.path.name]
    if not newer:
        return None
    retired = folder / f"{RETIRED}{int(time.time())}"
    (retired / FRAMES).mkdir(parents=True)
    for name in {name for p in newer for name in _listed(p) or []}:
        if (folder / FRAMES / name).is_file():
            try:
                os.link(folder / FRAMES / name, retired / FRAMES / name)
            except OSError:  # a file system without hard links
                shutil.copy2(folder / FRAMES / name, retired / FRAMES / name)
    for path in newer:
        os.replace(path, retired / path.name)
    _fsync_dir(retired)
    _fsync_dir(folder)
    return retired


# How a run is carried out, not what it learns: given beside --resume, they apply to the resumed process.
CHANGEABLE_ON_RESUME = ("torch_threads", "compress_replay")


def resume_args(args: Any, checkpoint: Checkpoint, argv: list[str]) -> tuple[Any, dict[str, int] | None]:
    """The run's own arguments, as the checkpoint holds them, and the extension asked for, if any. Flags given
    beside ``--resume`` (``argv``) that differ from them are ignored, with a word, but for ``--total-timesteps``
    above the run's: that extends the run (the exploration schedule keeps its end step: --exploration-fraction
    is scaled), and those of ``CHANGEABLE_ON_RESUME`` (torch's threads, the replay memory's compression), which
    apply. A finished run is resumed only so, from its final checkpoint; a setting the script does not have
    refuses the checkpoint."""
    saved = {k: v for k, v in checkpoint.state["args"].items() if k not in RETIRED_ARGS}
    named = {a.split("=")[0].replace("_", "-").replace("--no-", "--") for a in argv}
    for name in CHANGEABLE_ON_RESUME:
        if f"--{name.replace('_', '-')}" in named and name in vars(args):
            saved[name] = getattr(args, name)
    unknown = sorted(set(saved) - set(vars(args)))
    if unknown:
        raise CheckpointError(
            f"--resume {args.resume}: the run has settings this script does not have ({', '.join(unknown)}): it was "
            "written by another version of the script; resume it with that version (receipt.json names it)"
        )
    del saved["resume"]
    total, asked = saved["total_timesteps"], args.total_timesteps
    given = any(a.split("=")[0] in ("--total-timesteps", "--total_timesteps") for a in argv)
    extension = {"from": total, "to": asked} if given and asked != total else None
    run, finished = checkpoint.run_dir, _receipt(checkpoint.run_dir).get("status") == "finished"
    if extension and asked < total:
        raise CheckpointError(
            f"--total-timesteps {asked:,} is below the run's {total:,}: a resume continues or extends a run, never "
            f"shortens it; leave --total-timesteps out to continue it to {total:,}"
        )
    if finished and (extension is None or checkpoint.step < total):
        final = [p for p in list_checkpoints(run) if int(p.name[len(PREFIX) :]) == total]
        how = (
            f"to train it further, extend it from its final checkpoint: --resume {run} --total-timesteps {2 * total}"
            if final
            else "it kept no checkpoint of its end (--checkpoint-every 0): start a new run to train further"
        )
        older = (
            f" from step {checkpoint.step:,}, which would retrain it and replace them"
            if checkpoint.step < total
            else ""
        )
        raise CheckpointError(
            f"--resume {args.resume}: this run finished at step {total:,}; its model and evaluations stay as they "
            f"are, and it is not resumed{older}; {how}"
        )
    defaults = type(args)()
    ignored = [
        f"--{k.replace('_', '-')}"
        for k, v in saved.items()
        if k != "total_timesteps" and getattr(args, k) != v and getattr(args, k) != getattr(defaults, k)
    ]
    if ignored:
        print(f"warning: --resume continues with the run's own settings; ignoring {', '.join(ignored)}", flush=True)
    if extension:  # epsilon reaches its end at the same step as before: exploration_fraction * total
        saved["total_timesteps"] = asked
        if "exploration_fraction" in saved:
            saved["exploration_fraction"] = saved["exploration_fraction"] * total / asked
    return dataclasses.replace(args, **saved), extension


# ---------------------------------------------------------------- what the scripts save and put back


def parts_state(parts: dict[str, Any]) -> dict[str, Any]:
    """Each part's state, by name: ``state_dict()`` of networks and optimizers (or a whole ValueAlgorithm), with a
    network's buffers that its ``state_dict`` leaves out (NoisyLinear's current noise); a NumPy generator's
    ``bit_generator.state``."""
    state = {}
    for name, part in parts.items():
        if isinstance(part, np.random.Generator):
            state[name] = part.bit_generator.state
        elif isinstance(part, torch.nn.Module):
            buffers = {k: v.detach().cpu().clone() for k, v in part.named_buffers()}
            state[name] = {"state_dict": part.state_dict(), "buffers": buffers}
        else:
            state[name] = part.state_dict()
    return state


def load_parts(parts: dict[str, Any], state: dict[str, Any]) -> None:
    """``parts_state`` undone; an optimizer's moments take their parameters' memory layout."""
    for name, part in parts.items():
        if isinstance(part, np.random.Generator):
            part.bit_generator.state = state[name]
        elif isinstance(part, torch.nn.Module):
            part.load_state_dict(state[name]["state_dict"])
            for buffer_name, value in state[name]["buffers"].items():
                part.get_buffer(buffer_name).copy_(value)
        else:
            part.load_state_dict(state[name])
        if isinstance(part, torch.optim.Optimizer):
            moments_like_parameters(part)


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


# ---------------------------------------------------------------- internals


def _complete(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".tmp")]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _one_run_under(folder: Path, resume: str, algo: str) -> Path:
    """``--resume`` given a folder of runs (a ``--run-dir``): the one run of ``algo`` that has a checkpoint."""
    runs = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "receipt.json").is_file())
    if not runs:
        raise CheckpointError(
            f"--resume {resume}: neither a run folder nor a folder of runs (no receipt.json there or one level down)"
        )
    receipts = {run: _receipt(run) for run in runs}
    mine = [run for run in runs if receipts[run].get("algo") == algo and list_checkpoints(run)]
    if len(mine) == 1:
        print(f"--resume {resume}: the one {algo} run there with a checkpoint is {mine[0]}", flush=True)
        return mine[0]
    listing = []
    for run in runs:
        newest = list_checkpoints(run)
        where = f"newest checkpoint at step {int(newest[0].name[len(PREFIX) :])}" if newest else "no checkpoint"
        listing.append(f"  {run}  ({receipts[run].get('algo', '?')}, {receipts[run].get('status', '?')}, {where})")
    raise CheckpointError(
        f"--resume {resume} is a folder of {len(runs)} runs, {len(mine)} of them {algo} runs with a checkpoint; "
        f"give one run folder, e.g. --resume {mine[0] if mine else runs[0]}:\n" + "\n".join(listing)
    )


def _receipt(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / "receipt.json").read_text())
    except (OSError, ValueError):
        return {}


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


def _finite(state: Any) -> bool:
    """Every floating-point tensor in a (nested) state dict is finite."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_finite(v) for v in state)
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
