"""The run around an algorithm script, reached through one object at a few points:

    run = Run(args, __file__, check_args)   # --resume, the checks, device, threads, seeding, signals
    obs, global_step = run.own(envs, rb, policy=q_network, q_network=..., optimizer=..., rng=...)
    ... the algorithm's loop ...
        if run.step(global_step, obs, step, epsilon, metrics):  # log, progress, evaluate, checkpoint when due
            break                                                # a signal or a non-finite loss: stop
    sys.exit(run.finish())                   # final evaluation, saved model, closed record

What ``own`` is given is the one declaration of what the run owns: a checkpoint saves exactly that (with the
global random generators, the step, the games where they can be saved and the record so far), and ``--resume``
puts exactly that back (as the DQN Zoo's ``run_atari.py`` declares its checkpoint state once). The script keeps
the algorithm and the loop; the run never decides the loop: ``step`` says when to stop and the script breaks.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
import torch
import tyro
from tyro.constructors import ConstructorRegistry, StructConstructorSpec, StructFieldSpec, StructTypeInfo

from cleanrl_utils.buffer import CompressedFrames, ReplayBuffer, bytes_per_transition
from cleanrl_utils.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_parts,
    lock_run_dir,
    parts_state,
    refusal,
    resume_args,
    retire_newer,
    save_checkpoint,
)
from cleanrl_utils.checks import CpuThreads, check_memory, fail, pick_buffer_device, pick_device, validate_args
from cleanrl_utils.encoder import check_encoder
from cleanrl_utils.envs import EnvIdError, StepResult, TrainEnvs, check_env_id, random_play_frames
from cleanrl_utils.evaluation import evaluate
from cleanrl_utils.random_state import random_state, set_random_state
from cleanrl_utils.record import Record, nonfinite

METRICS_EVERY = 1000  # agent steps between TRAIN_METRICS lines: the loop's one read of device values
LOSSES_EVERY = 100  # agent steps between the losses/* points (CleanRL's), kept on the device until that read
PROGRESS_EVERY = 100  # agent steps between SPS, epsilon and progress updates


@dataclass
class RunFlags:
    """The flags every script shares for running, not for learning; each script's ``Args`` subclasses it, and
    ``--help`` lists them after the script's own (``parse_args``)."""

    torch_threads: int = 0
    """torch's CPU threads (0: automatic, printed at start; see docs/throughput.md)"""
    run_dir: str = "runs"
    """the folder that receives the run folder"""
    checkpoint_every: int = 100_000
    """agent steps between checkpoints, and one at the end of training (0: only on SIGINT/SIGTERM)"""
    checkpoint_buffer: bool = True
    """whether checkpoints hold the replay memory (written incrementally: each checkpoint adds the frames stored
    since the one before, and the disk holds about one memory); --no-checkpoint-buffer: a resume refills it"""
    checkpoint_keep: int = 3
    """how many of the newest checkpoints to keep"""
    resume: str | None = None
    """a run folder (its newest checkpoint) or one checkpoint folder to continue, in the same run folder; with a
    larger --total-timesteps, a finished run is extended (the exploration schedule keeps its end step)"""
    buffer_device: Literal["host", "cuda"] = "host"
    """where the replay frames live: host memory, or the training GPU (raw: about 7.1 GB per 1M transitions)"""
    compress_replay: bool = False
    """hold the replay frames compressed in host memory, each on its own (0.2-1.2 KB a transition instead of 7.1 KB,
    the same batches bit for bit; 0.90-0.96 of the raw memory's speed on a 2-core CPU, so not yet the default). With
    --buffer-device cuda the frames are raw"""


A = TypeVar("A", bound=RunFlags)
UPLOAD = "CleanRL's Hugging Face upload is not kept here: run with --save-model and upload the .cleanrl_model"
RETIRED_FLAGS = {  # CleanRL's flags not kept: --help does not list them; given, they stop a script with what to use
    "--cuda": "here --device picks the device: --device {}",
    "--upload-model": UPLOAD,
    "--hf-entity": UPLOAD,
}


def parse_args(args_type: type[A], argv: list[str] | None = None) -> A:
    """``tyro.cli(args_type)`` on ``argv`` (default: the command line), with ``--help`` in CleanRL's order: the
    script's own flags, then the run flags as their own group, each under its own name; one flat ``args_type``
    comes back (``args.checkpoint_every``), as receipts and checkpoints store it. A retired flag stops here."""
    argv = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        name = name.replace("_", "-").replace("--no-", "--")
        if name in RETIRED_FLAGS:  # --cuda False is --device cpu, --cuda True is --device cuda
            said = (value or "".join(argv[i + 1 : i + 2])).lower()
            device = {"false": "cpu", "true": "cuda"}.get(said, "{auto,cuda,mps,cpu}")
            fail(f"{name} is CleanRL's flag; {RETIRED_FLAGS[name].format(device)}")
    with _run_flags_last:
        return tyro.cli(args_type, args=argv)


_run_flags_last = ConstructorRegistry()  # parse_args's rule for tyro
_asking: list[type] = []  # the type that rule is asking tyro's own dataclass rule about


@_run_flags_last.struct_rule
def _nest_run_flags(info: StructTypeInfo) -> StructConstructorSpec | None:
    """A ``RunFlags`` subclass as tyro's own dataclass rule reads it (each help text made one paragraph), but with
    the fields of ``RunFlags`` moved into one ``run`` field after the others: a nested ``RunFlags``, shown as its
    own group, without prefix, and flattened back into one ``info.type`` by ``instantiate``."""
    if not (isinstance(info.type, type) and issubclass(info.type, RunFlags)) or info.type in _asking:
        return None
    _asking.append(info.type)
    try:
        spec = ConstructorRegistry.get_struct_spec(info)
    finally:
        _asking.pop()
    assert isinstance(spec, StructConstructorSpec), spec
    own = [replace(f, helptext=_paragraph(f.helptext)) for f in spec.fields]
    if info.type is RunFlags:
        return replace(spec, fields=tuple(own))
    shared = {f.name for f in fields(RunFlags)}
    run = StructFieldSpec(
        name="run",
        type=Annotated[RunFlags, tyro.conf.OmitArgPrefixes],
        default=RunFlags(**{f.name: f.default for f in own if f.name in shared}),
        helptext="the flags for running, not for learning: the same in every script",
    )
    return StructConstructorSpec(
        instantiate=lambda run, **kwargs: spec.instantiate(**kwargs, **vars(run)),
        fields=(*[f for f in own if f.name not in shared], run),
    )


def _paragraph(text: Any) -> Any:
    """A help text (or tyro's lazy one) as one paragraph: a docstring's line breaks only wrap it in the source."""
    if callable(text):
        return lambda: _paragraph(text())
    return " ".join(text.split()) if isinstance(text, str) else text


class StopFlag:
    """Set by SIGINT/SIGTERM for the loop to read (``requested``). The first signal gives both signals back their
    default action, so that a second one ends the process at once; ``message`` is what it prints."""

    def __init__(self, message: str) -> None:
        self.requested: str | None = None  # the signal's name, once one came
        self.message = message

    def set(self, signum: int, frame: Any) -> None:
        self.requested = signal.Signals(signum).name
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        print(f"\n{self.requested}: {self.message}", file=sys.stderr, flush=True)


class Run:
    """Everything about running a script's algorithm: start, the declared state, the per-step bookkeeping, finish."""

    def __init__(self, args: Any, script: str, check_args: Any = None) -> None:
        """Start: take ``--resume``'s checkpoint and the run's own settings (into ``args``, in place), check the
        flags (the shared ones, then ``check_args(args)``, the script's own, which returns a message or None), the
        game, the device and the replay memory's size, before anything large exists; set threads and seeds; catch
        SIGINT/SIGTERM. A bad input ends the process here with its message (exit status 2), no run folder made; so
        does a run folder that another process is writing (one writer per run folder: ``lock_run_dir``)."""
        self.setup_start = time.perf_counter()
        self.args, self.script = args, script
        self.checkpoint, self.extension = None, None
        self.lock: int | None = None  # the run folder's lock, held until the process ends
        if args.resume:
            try:  # the run's newest checkpoint and its own settings; a bad checkpoint stops here
                self.checkpoint = find_checkpoint(args.resume, script)
                resumed, self.extension = resume_args(args, self.checkpoint, sys.argv[1:])
                vars(args).update(vars(resumed))
            except CheckpointError as error:
                fail(str(error))
        self.has_replay = hasattr(args, "buffer_size")
        validate_args(args, replay=self.has_replay)
        problem = check_args(args) if check_args is not None else None
        if problem:
            fail(problem)
        try:
            check_env_id(args.env_id)
        except EnvIdError as error:
            fail(str(error))
        self.threads = CpuThreads(args.torch_threads)  # fewer torch threads while other processes hold cores
        torch.set_num_threads(self.threads.choose())
        self.device = pick_device(args.device)
        print(f"device: {self.device}", flush=True)
        self.buffer_device = None
        self.replay_estimate: int | None = None  # bytes a transition, as the check below estimates them
        if self.has_replay:
            self.buffer_device = pick_buffer_device(args.buffer_device, self.device)  # cuda: the frames on the GPU
            self.replay_estimate = bytes_per_transition()
            if args.compress_replay and self.buffer_device is None:  # what this game's frames compress to
                self.replay_estimate = CompressedFrames.estimate(random_play_frames(args.env_id, seed=args.seed))
                print(
                    f"replay memory: about {self.replay_estimate:,} bytes a transition with the frames compressed, "
                    f"{args.buffer_size * self.replay_estimate / 2**30:.2f} GiB for --buffer-size {args.buffer_size:,} "
                    "(estimated from random play; the receipt reports what it takes)",
                    flush=True,
                )
            check_memory(args.buffer_size, self.replay_estimate, self.buffer_device)
        elif args.buffer_device != "host":
            fail(f"--buffer-device is for replay memory; {Path(script).name} has none: leave it out")
        elif args.compress_replay:
            fail(f"--compress-replay is for replay memory; {Path(script).name} has none: leave it out")
        if self.checkpoint is not None:  # the inputs are good: this process becomes the run folder's writer
            try:
                self.lock = lock_run_dir(self.checkpoint.run_dir)
            except CheckpointError as error:
                fail(str(error))
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        self.stop = StopFlag("finishing the current step, then writing a checkpoint (signal again to exit at once)")
        signal.signal(signal.SIGINT, self.stop.set)
        signal.signal(signal.SIGTERM, self.stop.set)
        # after a resume without the replay memory, learning waits until it refills (the one home of this rule)
        self.learning_starts = getattr(args, "learning_starts", 0)
        self.record: Record | None = None
        self.stopped: str | None = None  # why the loop was told to stop
        self.exit_message: str | int = 0

    @property
    def fused(self) -> bool | None:
        """--fast: Adam's fused kernel on CPU and CUDA (None: torch's default), for ``optim.Adam(..., fused=)``."""
        return True if getattr(self.args, "fast", False) and self.device.type in ("cpu", "cuda") else None

    def fast(self, *networks: torch.nn.Module) -> None:
        """--fast on CPU: channels-last convolutions, which oneDNN runs faster (benchmarks/RESULTS.md)."""
        if getattr(self.args, "fast", False) and self.device.type == "cpu":
            for network in networks:
                network.to(memory_format=torch.channels_last)

    def own(
        self, envs: TrainEnvs, replay: ReplayBuffer | None = None, *, policy: torch.nn.Module, **parts: Any
    ) -> tuple[np.ndarray, int]:
        """Declare what the run owns: the games, the replay memory, the network that plays (evaluated, saved) and
        the named ``parts`` (networks, optimizers, NumPy generators, anything with ``state_dict``). Every network's
        ``encoder`` is checked (the fixed Nature CNN or a declared variant). The run folder appears now. Returns
        the first observation and step: a fresh start's, or where ``--resume``'s checkpoint left off. A resume
        reads the replay memory back first: a segment that fails its checks stops the process there, with the
        next older checkpoint offered, before the run folder is written to; then the checkpoints newer than the
        one resumed from are set aside (``retire_newer``)."""
        for name, part in parts.items():
            if isinstance(part, torch.nn.Module) and hasattr(part, "encoder"):
                try:
                    check_encoder(part.encoder)
                except ValueError as error:
                    fail(f"{name}: {error}")
        self.envs, self.replay, self.policy, self.parts = envs, replay, policy, parts
        args, checkpoint = self.args, self.checkpoint
        restored = None
        if checkpoint is not None and replay is not None:
            try:  # False with --no-checkpoint-buffer
                restored = checkpoint.restore_replay(replay)
            except CheckpointError as error:
                fail(str(refusal(checkpoint.path, error)))
        self.record = Record(args, self.script, self.device, checkpoint)
        if replay is not None:  # the receipt reports what the memory takes, beside the start-up's estimate
            self.record.replay_memory = lambda: {
                **replay.memory(),
                "estimated_bytes_per_transition": self.replay_estimate,
            }
        if self.lock is None:  # a new run folder, made just now
            self.lock = lock_run_dir(self.record.dir)
        # gradient updates are counted as optimizer steps, also of optimizers an algorithm object holds (in lists too)
        held = [
            vars(p).values() for p in parts.values() if hasattr(p, "__dict__") and not isinstance(p, torch.nn.Module)
        ]
        held = [v for values in held for value in values for v in (value.values() if isinstance(value, dict) else
                value if isinstance(value, (list, tuple)) else [value])]  # fmt: skip
        optimizers = {id(p): p for p in [*parts.values(), *held] if isinstance(p, torch.optim.Optimizer)}.values()
        self.updates_hooks = [optimizer.register_step_post_hook(self._count_update) for optimizer in optimizers]
        self.segments = None
        if checkpoint is None:
            obs, global_step = envs.reset(), 0
        else:  # where the checkpoint left off: everything declared, put back
            state = checkpoint.state
            load_parts(parts, state)
            set_random_state(state["random"])  # Python's, NumPy's and torch's generators
            global_step = state["global_step"]
            self.segments = checkpoint.segments if restored else None  # the frames' segments this run continues
            if state["games"] is not None:  # games that can be saved (the tests' toy games) continue
                envs.load_state_dict(state["games"])
                obs = state["obs"]
            else:  # Atari games cannot be saved: new ones, seeded apart from the first run's
                envs.seed = args.seed + 1_000_003 * (len(state["run"]["resumes"]) + 1)
                obs = envs.reset()
                if replay is not None:
                    replay.cut_episodes()  # the stored games end there: their last transitions bootstrap
            if replay is not None and not restored:  # an empty replay memory refills before learning again
                self.learning_starts = global_step + args.learning_starts
            retired = retire_newer(checkpoint)
            if retired is not None:
                self.record.print(
                    f"resuming from step {checkpoint.step:,}, older than the run's newest checkpoint: the newer ones "
                    f"({', '.join(sorted(p.name for p in retired.glob('step_*')))}) are moved to {retired}, so that "
                    f"--resume {self.record.dir} continues from here (delete that folder to free its space)"
                )
            self.record.resumed(checkpoint, restored, state["games"] is not None, self.learning_starts, self.extension)
            if restored is False and self.learning_starts >= args.total_timesteps:
                self.record.print(
                    f"warning: the run ends at step {args.total_timesteps:,} before its replay memory refills "
                    f"(--learning-starts {args.learning_starts:,} after step {global_step:,}): it will not learn "
                    "again. Extend it (--total-timesteps), or keep the replay memory in checkpoints (the default; "
                    "this run has --no-checkpoint-buffer)"
                )
        self.last_step = global_step  # the step of the previous ``step`` call: what each interval is counted from
        self.losses: list[tuple[int, dict]] = []  # the losses/* points not yet read from the device
        self.final_obs = obs
        self.env_seconds = envs.seconds
        self.record.timings["setup"] += time.perf_counter() - self.setup_start
        return obs, global_step

    def _count_update(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.record.counts["gradient_updates"] += 1

    @contextmanager
    def timed(self, phase: str):
        """Add the block's wall time to ``phase`` in the receipt (acting, learning, ...)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.record.timings[phase] += time.perf_counter() - t0

    def skip(self, loss: torch.Tensor) -> bool:
        """--on-nonfinite skip: True (and counted) for a non-finite loss, which the update then leaves out. This
        reads the loss (a host synchronisation), so only when that flag asks; the default stops the run instead,
        from the metrics ``step`` reads every 1000 steps."""
        if self.args.on_nonfinite == "skip" and not torch.isfinite(loss):
            self.record.counts["skipped_updates"] += 1
            return True
        return False

    def step(self, global_step: int, obs: np.ndarray, result: StepResult, epsilon: float, metrics: dict | None) -> bool:
        """After each environment step: ``log_step``, then ``due``. True: the loop must stop."""
        self.log_step(global_step, result, epsilon)
        return self.due(global_step, obs, metrics)

    def log_step(self, global_step: int, result: StepResult, epsilon: float) -> None:
        """Count the step, log finished games, and every 100 steps the SPS, epsilon and progress."""
        record = self.record
        previous, record.counts["env_steps"] = record.counts["env_steps"], global_step
        record.counts["transitions_stored"] += int(result.mask.sum())
        for _, episodic_return, length in result.episode_returns:
            record.episode(global_step, episodic_return, length)
        if previous <= self.learning_starts < global_step:  # the learning phase's rate, not random play's
            record.start_rate(global_step)
        if global_step // PROGRESS_EVERY > previous // PROGRESS_EVERY:
            record.timings["environment"] += self.envs.seconds - self.env_seconds  # the games' time, send to recv
            self.env_seconds = self.envs.seconds
            sps = record.recent_sps(global_step)  # steps/s over the last minute, this process's steps only
            torch.set_num_threads(self.threads.choose())  # re-read every 5 s
            record.scalar("charts/SPS", int(sps), global_step)
            record.scalar("charts/epsilon", epsilon, global_step)
            learning = self.learning_starts if global_step <= self.learning_starts else None
            record.show_progress(global_step, self.args.total_timesteps, sps, learning)

    def due(self, global_step: int, obs: np.ndarray, metrics: dict | None) -> bool:
        """What is due since the previous call: the metrics (every 1000 steps; a non-finite loss or weights stop
        the run, checkpoints kept), an evaluation, a checkpoint (or one after a signal). True: the loop must stop."""
        args, record, previous = self.args, self.record, self.last_step
        self.last_step, self.final_obs = global_step, obs

        def crossed(every: int) -> bool:
            return bool(every) and global_step // every > previous // every

        if crossed(LOSSES_EVERY) and metrics:  # detached (no graph kept), still on the device: no wait here
            self.losses.append((global_step, {k: v.detach() if torch.is_tensor(v) else v for k, v in metrics.items()}))
        if crossed(METRICS_EVERY) and self.losses:
            rows = record.train_metrics(self.losses)  # the ten points read at once: one host synchronisation
            self.losses = []
            stop = getattr(args, "on_nonfinite", "stop") == "stop"  # skip: the updates left non-finite ones out
            bad = nonfinite({k: v for row in rows for k, v in row.items() if not np.isfinite(v)} if stop else {},
                            self.policy)  # fmt: skip
            if bad:
                record.close(status=f"failed: non-finite {bad} at step {global_step}")
                self.stopped = "non-finite"
                self.exit_message = f"error: non-finite {bad} at step {global_step}; stopping: {record.what_is_kept()}"
                return True
        if crossed(args.eval_every) and global_step < args.total_timesteps:
            self.evaluate(global_step)
            record.write_receipt()
        if (crossed(args.checkpoint_every) and global_step < args.total_timesteps) or self.stop.requested:
            if not self.save(global_step, obs):
                return True
            if self.stop.requested:
                record.close(status="interrupted")
                if self.replay is None:  # PQN: no replay memory to speak of
                    kept = "the checkpoint is kept"
                elif args.checkpoint_buffer:
                    kept = "the checkpoint is kept with its replay memory"
                else:
                    kept = (
                        "the checkpoint is kept without the replay memory (--no-checkpoint-buffer): a resume refills "
                        "it for --learning-starts steps before learning; the default, --checkpoint-buffer, keeps it"
                    )
                record.print(
                    f"stopped at step {global_step} by {self.stop.requested}; {kept}; resume with: {record.resume_command}"
                )
                self.stopped = self.stop.requested
                return True
        return False

    def save(self, global_step: int, obs: np.ndarray) -> bool:
        """A checkpoint of everything declared, and the replay memory's new frames unless --no-checkpoint-buffer.
        The losses/* points not yet read are written first: a resume continues the curves after this step. False:
        the write failed (a full disk): the run is closed as failed, what it had written removed, the previous
        checkpoints kept, and the loop must stop (``exit_message`` says it in one line)."""
        args, record = self.args, self.record
        if self.losses:
            record.train_metrics(self.losses, line=False)
            self.losses = []
        with self.timed("checkpoint"):
            state = {
                **parts_state(self.parts),
                "random": random_state(),
                "global_step": global_step,
                "obs": obs,
                "games": self.envs.state_dict() if self.envs.games_can_be_saved else None,
                **record.state_dict(),  # the algorithm, its arguments, the record so far
            }
            replay = self.replay if args.checkpoint_buffer else None
            folder, keep = record.dir / "checkpoints", args.checkpoint_keep
            try:
                path, segments = save_checkpoint(folder, global_step, state, replay, keep, self.segments)
            except CheckpointError as error:
                self.stopped = "checkpoint failed"
                self.exit_message = f"error: {error}; stopping: {record.what_is_kept()}"
                try:
                    record.close(status=f"failed: {error}")
                except OSError as also:  # the disk that refused the checkpoint may refuse the receipt too
                    self.exit_message += f" (receipt.json could not be updated either: {also})"
                return False
        self.segments = segments if path is not None else self.segments
        record.checkpoint_written(path, global_step)
        return True

    def evaluate(self, global_step: int, final: bool = False) -> None:
        """One evaluation of the policy network (--eval-episodes whole games, --eval-epsilon), under the games'
        own protocol, on games seeded apart from training's and from the other evaluations'."""
        args, record = self.args, self.record
        seed = args.seed + 10_000 + 100 * record.counts["evaluations"]

        def show_game(game: int, ended: int, episodic_return: float, length: int) -> None:
            record.evaluation_game(ended, args.eval_episodes, episodic_return, length, seed + game)

        with self.timed("evaluation"):
            result = evaluate(
                self.policy,
                args.env_id,
                self.envs.n_actions,
                self.device,
                args.eval_episodes,
                args.eval_epsilon,
                seed=seed,
                video_path=record.video_path(global_step),
                protocol=self.envs.protocol,
                on_game_end=show_game,
            )
        record.evaluation(global_step, result, final=final)

    def finish(self, **network_kwargs: Any) -> str | int:
        """The end: after a stop, what to tell (the exit status or message); otherwise the final evaluation, the
        model saved with --save-model (``network_kwargs``: what rebuilds it, ``QNetwork(n_actions, **these)``), the
        record closed as finished. Returns what ``sys.exit`` takes."""
        for hook in self.updates_hooks:
            hook.remove()
        if self.stopped is not None:
            self.envs.close()
            return self.exit_message
        args, record, global_step = self.args, self.record, self.record.counts["env_steps"]
        self.stop.message = (
            f"training is done (step {global_step}); the final evaluation goes on to its end"
            f"{' and the model is saved' if args.save_model else ''}, then the run ends as finished; no other "
            "checkpoint than the end of training's is written (signal again to exit at once, without the final "
            "evaluation)"
        )
        if args.checkpoint_every:  # the end of training: what an extension (--total-timesteps) continues from
            if not self.save(global_step, self.final_obs):
                self.envs.close()
                return self.exit_message
        elif self.losses:
            record.train_metrics(self.losses, line=False)
        record.print(f"training done at step {global_step}; final evaluation of {args.eval_episodes} games")
        self.evaluate(global_step, final=True)
        if args.save_model:
            record.save_model(self.policy, self.envs.n_actions, self.envs.protocol, **network_kwargs)
        self.envs.close()
        record.close()
        return 0

    @property
    def dir(self) -> Path:
        return self.record.dir
