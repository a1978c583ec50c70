"""Throughput and memory of the training loop: its parts, the end-to-end rate, and the replay's memory.

    python benchmarks/throughput.py --algo dqn --env-id BreakoutNoFrameskip-v4 --num-envs 8 --device cpu --compare

Two loops, built from the parts the scripts use (``TrainEnvs``, ``ReplayBuffer``, the script's
``QNetwork`` and target, ``benchmarks/fast_update.py``):
- plain (``--plain``): one environment, batch-1 acting every step, synchronous stepping, the eager update;
- fast (the default): ``--num-envs`` environments, batched acting, the environments stepping (ale-py's
  send/recv) while the learner updates, and the fast update (``--fast-update``, by default what
  ``FastSettings.for_device`` holds).
``--compare`` runs both in alternating rounds (so that a noisy machine slows both alike) and prints the ratio,
over all rounds and over the quiet ones: each round records how many cores other processes used meanwhile.
The parts are measured before each round, and their medians reported.

For each loop it prints the parts per agent step (environment alone, acting, storing, sampling, one update),
the limit they imply, 1 / (t_env + t_act + t_store + (t_sample + t_update) / train_frequency), the measured
end-to-end rate in the learning phase (one update of batch 32 per 4 agent steps, summed over environments)
and the efficiency, end-to-end / limit (above 1 when stepping overlaps the update). Then the update's
variants (eager, channels-last, fused optimizer, torch.compile, CUDA graph; a single forward over
observations and next observations together), each with its time and achieved GFLOP/s beside the
machine's measured matmul peak; and the replay memory, measured by filling a buffer in a fresh process
(resident memory growth per stored transition) with its projection to 1M transitions.
Figures are printed and written as JSON (``--json``); nothing is asserted.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.fast_update import FastSettings, prepare  # noqa: E402
from cleanrl_utils.buffer import ReplayBuffer  # noqa: E402
from cleanrl_utils.envs import TrainEnvs  # noqa: E402
from cleanrl_utils.tools.evaluate import load_algorithm  # noqa: E402

CLEANRL_BYTES_PER_TRANSITION = 4 * 84 * 84  # SB3 ReplayBuffer(optimize_memory_usage=True), observations only
FLAGS = ("channels_last", "compile", "fused", "cuda_graph")
QUIET_CORES = 0.05  # a round is quiet when the other processes used fewer cores than this


# ---------------------------------------------------------------- the algorithm's parts


def load_script(algo: str):
    """The script as a module, registered in sys.modules so that torch.compile can trace its functions."""
    path = REPO / "algos" / f"{algo}.py"
    if not path.exists():
        known = sorted(p.stem for p in (REPO / "algos").glob("*.py"))
        sys.exit(f"--algo {algo}: no algos/{algo}.py; known: {', '.join(known)}")
    module = load_algorithm(path)
    sys.modules[module.__name__] = module
    return module


def adam_eps(algo: str, args: Any) -> float:
    """The Adam epsilon each script uses (see its ``optim.Adam`` line)."""
    if hasattr(args, "adam_eps"):
        return args.adam_eps
    return 0.01 / args.batch_size if algo in ("c51", "qrdqn", "iqn") else 1e-8


def make_networks(module, algo: str, n_actions: int, args: Any, device: torch.device, seed: int = 0):
    torch.manual_seed(seed)
    names = list(inspect.signature(module.QNetwork).parameters)[1:]
    kwargs = {name: getattr(args, name) for name in names if hasattr(args, name)}
    q_network = module.QNetwork(n_actions, **kwargs).to(device)
    target_network = module.QNetwork(n_actions, **kwargs).to(device)
    target_network.load_state_dict(q_network.state_dict())
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, eps=adam_eps(algo, args))
    return q_network, target_network, optimizer


def make_loss(algo: str, module, q_network, target_network, args: Any, cat: bool = False) -> Callable:
    """``loss_fn(data) -> (loss, metrics, ...)``: the script's own ``compute_loss``, as its loop runs it. ``cat``:
    one forward over observations and next observations together where the algorithm runs one network on
    both (Double DQN's online network, Munchausen DQN's target network), a variant measured here only."""
    if not cat:
        return partial(module.compute_loss, q_network, target_network, args=args)
    B = args.batch_size
    if algo == "double_dqn":

        def loss_fn(data):  # the online network's two passes as one (the next half detached)
            q_both = q_network(torch.cat([data.observations, data.next_observations]))
            q_now, q_next = q_both[:B], q_both[B:].detach()
            with torch.no_grad():
                next_actions = q_next.argmax(dim=1, keepdim=True)
                target_max = target_network(data.next_observations).gather(1, next_actions).squeeze(1)
            td_target = data.rewards + args.gamma * target_max * (1 - data.dones)
            old_val = q_now.gather(1, data.actions.unsqueeze(1)).squeeze(1)
            loss = F.mse_loss(td_target, old_val)
            return loss, {"td_loss": loss, "q_values": old_val.mean()}, td_target - old_val

    elif algo == "mdqn":

        def loss_fn(data):  # the target network's two passes as one
            with torch.no_grad():
                both = target_network(torch.cat([data.observations, data.next_observations]))
                target_q, target_next_q = both[:B], both[B:]
                td_target, bonus = module.munchausen_target(
                    target_q, target_next_q, data.actions, data.rewards, data.dones,
                    args.gamma, args.m_alpha, args.m_tau, args.m_l0,
                )  # fmt: skip
            old_val = q_network(data.observations).gather(1, data.actions.unsqueeze(1)).squeeze(1)
            loss = F.smooth_l1_loss(td_target, old_val)
            entropy = module.policy_entropy(target_q, args.m_tau).mean()
            metrics = {"td_loss": loss, "q_values": old_val.mean(), "munchausen_bonus": bonus.mean()}
            return loss, metrics | {"policy_entropy": entropy}

    else:
        sys.exit(f"--algo {algo}: one forward over s and s' applies to double_dqn and mdqn only")
    return loss_fn


CAT_APPLIES = {"double_dqn": "the online network on s and s'", "mdqn": "the target network on s and s'"}


def parse_settings(text: str, device: torch.device) -> FastSettings:
    if text == "auto":
        return FastSettings.for_device(device)
    if text == "eager":
        return FastSettings()
    names = [n.strip().replace("-", "_") for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FLAGS]
    if unknown:
        sys.exit(f"--fast-update {text}: unknown {unknown}; use auto, eager or a comma list of {', '.join(FLAGS)}")
    if "cuda_graph" in names and device.type != "cuda":
        sys.exit("--fast-update cuda_graph needs --device cuda")
    return FastSettings(**{n: True for n in names})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the two loops


class Loop:
    """A training loop in its learning phase, without logging or evaluation, that can run in rounds."""

    def __init__(self, name: str, module, algo: str, args: Any, env_id: str, num_envs: int, device: torch.device,
                 settings: FastSettings, overlap: bool, buffer_size: int, buffer_device: str | None,
                 learning_starts: int, seed: int) -> None:  # fmt: skip
        self.name, self.args, self.device, self.settings, self.overlap = name, args, device, settings, overlap
        self.num_envs = num_envs
        self.envs = TrainEnvs(env_id, num_envs, seed=seed)
        self.q_network, self.target_network, self.optimizer = make_networks(
            module, algo, self.envs.n_actions, args, device
        )
        self.loss_fn = make_loss(algo, module, self.q_network, self.target_network, args)
        self.update = prepare([self.q_network, self.target_network], self.optimizer, self.loss_fn, settings)
        self.rb = ReplayBuffer(buffer_size, num_envs, device=device, seed=seed, storage_device=buffer_device)
        self.rng = np.random.default_rng(seed)
        self.epsilon = args.end_e  # the learning phase, mostly greedy: acting runs the network nearly every step
        self.obs = self.envs.reset()
        self.global_step = self.update_credit = 0
        self.metrics: list[float] = []
        self.updates = 0
        filled = 0
        while filled < learning_starts:  # random play fills the buffer (not timed)
            actions = self.rng.integers(0, self.envs.n_actions, num_envs)
            step = self.envs.step(actions)
            self.rb.add(self.obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
            self.obs = step.next_obs
            filled += num_envs

    def act(self, obs: np.ndarray) -> np.ndarray:
        actions = self.rng.integers(0, self.envs.n_actions, self.num_envs)
        greedy = self.rng.random(self.num_envs) >= self.epsilon
        if greedy.any():
            with torch.no_grad():
                q_values = self.q_network(torch.as_tensor(obs[greedy], device=self.device))
            actions[greedy] = q_values.argmax(dim=1).cpu().numpy()
        return actions

    def learn(self, steps_done: int) -> None:
        """The updates owed for ``steps_done`` more agent steps, and the target network's sync."""
        args = self.args
        previous = self.global_step
        self.global_step += steps_done
        self.update_credit += steps_done
        while self.update_credit >= args.train_frequency:
            self.update_credit -= args.train_frequency
            self.last = self.update(self.rb.sample(args.batch_size))
            self.updates += 1
        if self.global_step // args.target_network_frequency > previous // args.target_network_frequency:
            with torch.no_grad():
                for target_param, q_param in zip(
                    self.target_network.parameters(), self.q_network.parameters(), strict=True
                ):
                    target_param.copy_(args.tau * q_param + (1.0 - args.tau) * target_param)
        if self.global_step // 1000 > previous // 1000 and self.updates:  # metrics every 1000 steps
            self.metrics.append(float(self.last[0].item()))

    def store(self, actions: np.ndarray, step) -> None:
        self.rb.add(self.obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        self.obs = step.next_obs

    def run(self, agent_steps: int, seconds: float = float("inf")) -> float:
        """Run ``agent_steps`` agent steps, or fewer if ``seconds`` pass first; returns the seconds it took."""
        sync(self.device)
        start = time.perf_counter()
        deadline = start + seconds
        done = 0
        if not self.overlap:  # act, step, store, learn: the scripts' order
            while done < agent_steps and time.perf_counter() < deadline:
                actions = self.act(self.obs)
                step = self.envs.step(actions)
                self.store(actions, step)
                self.learn(self.num_envs)
                done += self.num_envs
        else:  # the environments step while the learner updates
            actions = self.act(self.obs)
            self.envs.send(actions)
            while True:
                done += self.num_envs
                self.learn(self.num_envs)  # overlapped with the environments' step
                step = self.envs.recv()
                self.store(actions, step)
                if done >= agent_steps or time.perf_counter() >= deadline:
                    break
                actions = self.act(self.obs)
                self.envs.send(actions)
        sync(self.device)
        return time.perf_counter() - start

    def close(self) -> None:
        self.envs.close()


# ---------------------------------------------------------------- measuring


def median_time(fn: Callable[[], Any], repeats: int, device: torch.device, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_parts(loop: Loop, repeats: int) -> dict[str, float]:
    """Seconds per agent step of each part, on the loop's own environments, network and buffer: a stretch
    of random play, stepped (timed) and then stored into the loop's buffer (timed), acting on its last
    observations, sampling, and one update on a fixed batch."""
    device, n = loop.device, loop.num_envs
    vector_steps = max(100, 800 // n)
    actions = [loop.rng.integers(0, loop.envs.n_actions, n) for _ in range(vector_steps)]
    start = time.perf_counter()
    steps = [loop.envs.step(a) for a in actions]
    t_env = (time.perf_counter() - start) / (vector_steps * n)
    start = time.perf_counter()
    for a, step in zip(actions, steps, strict=True):
        loop.store(a, step)
    sync(device)
    t_store = (time.perf_counter() - start) / (vector_steps * n)
    obs = loop.obs
    t_act = median_time(lambda: loop.act(obs), repeats * 5, device) / n
    batch = loop.rb.sample(loop.args.batch_size)
    t_sample = median_time(lambda: loop.rb.sample(loop.args.batch_size), repeats * 5, device)
    t_update = median_time(lambda: loop.update(batch), repeats, device, warmup=3)
    tf = loop.args.train_frequency
    limit = 1.0 / (t_env + t_act + t_store + (t_sample + t_update) / tf)
    return {"t_env": t_env, "t_act": t_act, "t_store": t_store, "t_sample": t_sample, "t_update": t_update,
            "env_steps_per_s": 1.0 / t_env, "limit_steps_per_s": limit}  # fmt: skip


def update_flops(loss_fn: Callable, batch) -> int:
    """Floating-point operations of one update's forward and backward passes (torch's flop counter;
    the optimizer's few elementwise operations per parameter are not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        loss = loss_fn(batch)[0]
        loss.backward()
    return counter.get_total_flops()


def matmul_peak(device: torch.device) -> float:
    """The machine's measured float32 matmul rate, GFLOP/s (the best of a few large products)."""
    n = 4096 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = min(median_time(lambda: a @ b, 3, device, 1) for _ in range(3))
    return 2 * n**3 / best / 1e9


def update_variants(module, algo: str, args: Any, n_actions: int, device: torch.device, batch, rounds: int,
                    with_compile: bool) -> list[dict[str, Any]]:  # fmt: skip
    """Each variant on fresh copies of the same networks and the same batch, timed in interleaved rounds."""
    variants: list[tuple[str, FastSettings, bool]] = [
        ("eager", FastSettings(), False),
        ("channels_last", FastSettings(channels_last=True), False),
        ("fused", FastSettings(fused=True), False),
        ("channels_last+fused", FastSettings(channels_last=True, fused=True), False),
    ]
    if algo in CAT_APPLIES:
        variants.append(("cat", FastSettings(), True))
        variants.append(("channels_last+fused+cat", FastSettings(channels_last=True, fused=True), True))
    if device.type == "cuda":
        variants.append(("fused+cuda_graph", FastSettings(fused=True, cuda_graph=True), False))
        variants.append(("channels_last+fused+cuda_graph", FastSettings(True, False, True, True), False))
    if with_compile:
        variants.append(("channels_last+fused+compile", FastSettings(True, True, True, False), False))
        if device.type == "cuda":
            variants.append(("fused+compile+cuda_graph", FastSettings(False, True, True, True), False))
    updates, compile_s = {}, {}
    for name, settings, cat in variants:
        q_network, target_network, optimizer = make_networks(module, algo, n_actions, args, device)
        loss_fn = make_loss(algo, module, q_network, target_network, args, cat=cat)
        update = prepare([q_network, target_network], optimizer, loss_fn, settings)
        start = time.perf_counter()
        try:
            update(batch)
            update(batch)
            sync(device)
        except Exception as error:  # a variant this machine cannot run is reported, not fatal
            print(f"  variant {name} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        compile_s[name] = time.perf_counter() - start
        updates[name] = update
    times: dict[str, list[float]] = {name: [] for name in updates}
    for _ in range(rounds):
        for name, update in updates.items():
            times[name].append(median_time(lambda u=update: u(batch), 5, device, warmup=1))
    q_network, target_network, _ = make_networks(module, algo, n_actions, args, device)
    flops = update_flops(make_loss(algo, module, q_network, target_network, args), batch)
    eager = statistics.median(times["eager"])
    rows = []
    for name in updates:
        t = statistics.median(times[name])
        rows.append({"variant": name, "ms": 1e3 * t, "speedup_vs_eager": eager / t, "gflops_per_s": flops / t / 1e9,
                     "first_two_calls_s": compile_s[name]})  # fmt: skip
    return rows


def forward_cat(module, algo: str, args: Any, n_actions: int, device: torch.device, batch, rounds: int) -> dict:
    """Two forwards of batch B (s, then s') against one of batch 2B (s and s' together), without gradient:
    what a single forward over both saves where one network sees both."""
    q_network = make_networks(module, algo, n_actions, args, device)[0]
    both = torch.cat([batch.observations, batch.next_observations])

    @torch.no_grad()
    def two():
        q_network(batch.observations), q_network(batch.next_observations)

    @torch.no_grad()
    def one():
        q_network(both)

    t_two, t_one = [], []
    for _ in range(rounds):
        t_two.append(median_time(two, 5, device))
        t_one.append(median_time(one, 5, device))
    return {"two_forwards_ms": 1e3 * statistics.median(t_two), "one_forward_ms": 1e3 * statistics.median(t_one)}


# ---------------------------------------------------------------- replay memory, in a fresh process


def memory_child(transitions: int, num_envs: int, storage_device: str | None) -> dict[str, Any]:
    import psutil

    process = psutil.Process()
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (64, 84, 84), dtype=np.uint8)  # a pool of Atari-sized frames
    base = process.memory_info().rss
    gpu_base = torch.cuda.memory_allocated() if storage_device == "cuda" else 0
    # noise frames do not compress: this measures the raw memory; benchmarks/replay_memory.py the compressed one
    rb = ReplayBuffer(transitions, num_envs, storage_device=storage_device, seed=0, compress=False)
    after_init = process.memory_info().rss
    obs = np.stack([frames[rng.integers(0, 64, 4)] for _ in range(num_envs)])
    actions, rewards = np.zeros(num_envs, np.int64), np.zeros(num_envs, np.float32)
    no = np.zeros(num_envs, dtype=bool)
    stored = 0
    while stored < transitions:
        next_obs = np.concatenate([obs[:, 1:], frames[rng.integers(0, 64, num_envs)][:, None]], axis=1)
        rb.add(obs, next_obs, actions, rewards, no, no)
        obs = next_obs
        stored += num_envs
    rss = process.memory_info().rss
    result = {
        "transitions": len(rb),
        "rss_before_bytes": base,
        "rss_after_init_bytes": after_init,
        "rss_after_fill_bytes": rss,
        "host_bytes_per_transition": (rss - base) / len(rb),
    }
    if storage_device == "cuda":
        result["gpu_bytes_per_transition"] = (torch.cuda.memory_allocated() - gpu_base) / len(rb)
    return result


def measure_memory(transitions: int, num_envs: int, storage_device: str | None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--memory-child", str(transitions), "--num-envs", str(num_envs)]
    if storage_device:
        command += ["--buffer-device", storage_device]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    per = result.get("gpu_bytes_per_transition", result["host_bytes_per_transition"])
    result["bytes_per_transition"] = per
    result["projected_1m_gb"] = per * 1e6 / 1e9
    result["cleanrl_1m_gb"] = CLEANRL_BYTES_PER_TRANSITION * 1e6 / 1e9
    return result


# ---------------------------------------------------------------- the machine


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
        info["cpu_pressure"] = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        pass
    try:
        import ale_py

        info["ale_py"] = ale_py.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True, check=False).stdout.strip()  # fmt: skip
    except OSError:
        pass
    return info


class CpuMeter:
    """The cores this process used and those the rest of the machine used (other processes, other
    virtual machines' steal) over a stretch of time: a shared machine's noise, measured."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.process = psutil.Process()
        self.start = self._now()

    def _now(self) -> tuple[float, float, float]:
        t = self.psutil.cpu_times()
        busy = sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))
        mine = self.process.cpu_times()
        return time.perf_counter(), busy, mine.user + mine.system

    def cores(self) -> tuple[float, float]:
        """(this process's cores, the other processes' cores) since the meter started"""
        (w0, b0, m0), (w1, b1, m1) = self.start, self._now()
        wall = max(w1 - w0, 1e-9)
        return (m1 - m0) / wall, max(0.0, (b1 - b0) - (m1 - m0)) / wall


def load_now() -> str:
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        pressure = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()[1]
        return f"load {load}, cpu pressure {pressure}"
    except OSError:
        return "load unknown"


# ---------------------------------------------------------------- main


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--algo", default="dqn", help="a script of algos/ (dqn, double_dqn, c51, qrdqn, mdqn, nc_qrdqn)"
    )
    parser.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    parser.add_argument("--num-envs", type=int, default=8, help="environments of the fast loop (the plain loop: 1)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--seconds", type=float, default=10, help="timed seconds per loop and round (learning phase)")
    parser.add_argument("--max-steps", type=int, default=10**9, help="at most this many agent steps per loop and round")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--plain", action="store_true", help="only the plain loop")
    mode.add_argument("--compare", action="store_true", help="the plain and the fast loop, in alternating rounds")
    mode.add_argument("--only-variants", action="store_true", help="no loops: only the update's variants")
    mode.add_argument(
        "--scripts",
        action="store_true",
        help="the shipped script itself, --no-fast --num-envs 1 against its default with --num-envs N",
    )
    parser.add_argument("--script-steps", type=int, default=3000, help="--scripts: learning-phase steps per run")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="--scripts: instead, this checkout's script (its defaults, --num-envs N) against another checkout's, "
        "e.g. a `git worktree` of the revision before a change",
    )
    parser.add_argument(
        "--against",
        default=None,
        help="--scripts: instead, the script with its defaults (--num-envs N) against the same plus these flags, "
        "e.g. --against=--no-compress-replay",
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each loop (alternating with --compare)")
    parser.add_argument("--fast-update", default="auto", help="auto, eager, or a comma list of " + ", ".join(FLAGS))
    parser.add_argument("--buffer-device", default=None, choices=["cpu", "cuda"],
                        help="where the fast loop's replay frames live (default: host memory, NumPy)")  # fmt: skip
    parser.add_argument("--no-overlap", action="store_true", help="the fast loop without asynchronous stepping")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch's CPU threads (0: torch's default)")
    parser.add_argument("--learning-starts", type=int, default=2000, help="random steps that fill each buffer first")
    parser.add_argument("--buffer-size", type=int, default=50_000)
    parser.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                        help="time the update's variants")  # fmt: skip
    parser.add_argument("--compile-variants", action=argparse.BooleanOptionalAction, default=True,
                        help="include torch.compile variants (a minute to compile on a cold cache)")  # fmt: skip
    parser.add_argument("--memory-transitions", type=int, default=100_000, help="0 skips the memory measure")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def print_loops(report: dict[str, Any], train_frequency: int) -> None:
    print()
    header = (f"{'loop':<6} {'envs':>4} {'update':<34} {'env/s':>7} {'t_env':>7} {'t_act':>7} {'t_store':>7} "
              f"{'t_sample':>8} {'t_update':>8} {'limit/s':>8} {'e2e/s':>7} {'eff':>5}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, f in report["loops"].items():
        ms = {k: 1e3 * f[k] for k in ("t_env", "t_act", "t_store", "t_sample", "t_update")}
        label = f["settings"] + ("+async" if f["overlap"] else "")
        label += f"+frames:{f['buffer_device']}" if f["buffer_device"] else ""
        print(f"{name:<6} {f['num_envs']:>4} {label:<34} {f['env_steps_per_s']:>7.0f} {ms['t_env']:>7.3f} "
              f"{ms['t_act']:>7.3f} {ms['t_store']:>7.3f} {ms['t_sample']:>8.3f} {ms['t_update']:>8.2f} "
              f"{f['limit_steps_per_s']:>8.0f} {f['end_to_end_steps_per_s']:>7.0f} {f['efficiency']:>5.2f}")  # fmt: skip
    print(f"(t_env, t_act, t_store: ms per agent step; t_sample, t_update: ms per update, one per {train_frequency} "
          f"agent steps; limit = 1 / (t_env + t_act + t_store + (t_sample + t_update) / {train_frequency}); "
          "e2e: measured agent steps/s in the learning phase; eff = e2e / limit)")  # fmt: skip
    if "fast_over_plain" in report:
        print(f"fast / plain, end to end: {report['fast_over_plain']:.2f}x over all rounds", end="")
        if "fast_over_plain_quiet_rounds" in report:
            print(f"; {report['fast_over_plain_quiet_rounds']:.2f}x (median) over the {report['quiet_rounds']} rounds "
                  f"in which other processes used under {QUIET_CORES} cores", end="")  # fmt: skip
        print()


def run_loops(cli: argparse.Namespace, module, args: Any, device: torch.device, settings: FastSettings,
              report: dict[str, Any]) -> tuple[int, Any]:  # fmt: skip
    """The loops' parts and end-to-end rates into ``report``; returns the number of actions and a batch."""
    loops: list[Loop] = []
    common = dict(module=module, algo=cli.algo, args=args, env_id=cli.env_id, device=device,
                  buffer_size=cli.buffer_size, learning_starts=cli.learning_starts, seed=cli.seed)  # fmt: skip
    if cli.plain or cli.compare:
        loops.append(Loop("plain", num_envs=1, settings=FastSettings(), overlap=False, buffer_device=None, **common))
    if not cli.plain:
        loops.append(Loop("fast", num_envs=cli.num_envs, settings=settings, overlap=not cli.no_overlap,
                          buffer_device=cli.buffer_device, **common))  # fmt: skip
    for loop in loops:
        loop.run(max(200, 40 * loop.num_envs))  # warm-up: the first updates, compilation, graph capture
    seconds = {loop.name: 0.0 for loop in loops}
    steps = {loop.name: 0 for loop in loops}
    parts: dict[str, list[dict[str, float]]] = {loop.name: [] for loop in loops}
    report["rounds"] = []
    for r in range(cli.rounds):  # each round: each loop's parts, then its end-to-end run, loop after loop
        rates, others = {}, {}
        for loop in loops:
            parts[loop.name].append(measure_parts(loop, repeats=9))
            before = loop.global_step
            meter = CpuMeter()
            took = loop.run(cli.max_steps, cli.seconds)
            others[loop.name] = meter.cores()[1]
            seconds[loop.name] += took
            steps[loop.name] += loop.global_step - before
            rates[loop.name] = (loop.global_step - before) / took
        report["rounds"].append({"steps_per_s": rates, "other_processes_cores": others, "load": load_now()})
        shown = ", ".join(f"{n} {rates[n]:.0f} steps/s (others using {others[n]:.2f} cores)" for n in rates)
        print(f"# round {r + 1}/{cli.rounds}: {shown}; {load_now()}", flush=True)
    report["loops"] = {}
    for loop in loops:  # the parts: medians over the rounds
        median = {k: statistics.median(p[k] for p in parts[loop.name]) for k in parts[loop.name][0]}
        median["env_steps_per_s"] = 1.0 / median["t_env"]
        tf = args.train_frequency
        median["limit_steps_per_s"] = 1.0 / (
            median["t_env"] + median["t_act"] + median["t_store"] + (median["t_sample"] + median["t_update"]) / tf
        )
        figures = {"num_envs": loop.num_envs, "settings": loop.settings.describe(), "overlap": loop.overlap,
                   "buffer_device": loop.rb.storage_device and str(loop.rb.storage_device), **median}  # fmt: skip
        figures["end_to_end_steps_per_s"] = steps[loop.name] / seconds[loop.name]
        figures["timed_agent_steps"] = steps[loop.name]
        figures["efficiency"] = figures["end_to_end_steps_per_s"] / figures["limit_steps_per_s"]
        figures["last_logged_loss"] = loop.metrics[-1] if loop.metrics else None
        report["loops"][loop.name] = figures
    if "plain" in report["loops"] and "fast" in report["loops"]:
        p, f = report["loops"]["plain"], report["loops"]["fast"]
        report["fast_over_plain"] = f["end_to_end_steps_per_s"] / p["end_to_end_steps_per_s"]
        quiet = [x for x in report["rounds"] if max(x["other_processes_cores"].values()) < QUIET_CORES]
        if quiet:  # the rounds in which the rest of the machine left both loops alone
            report["fast_over_plain_quiet_rounds"] = statistics.median(
                x["steps_per_s"]["fast"] / x["steps_per_s"]["plain"] for x in quiet
            )
        report["quiet_rounds"] = len(quiet)
    print_loops(report, args.train_frequency)
    n_actions, batch = loops[0].envs.n_actions, loops[-1].rb.sample(args.batch_size)
    for loop in loops:
        loop.close()
    return n_actions, batch


def script_rate(cli: argparse.Namespace, flags: list[str], run_dir: Path, repo: Path = REPO) -> dict[str, float]:
    """Run ``algos/ALGO.py`` as it ships, with ``flags``, and return its learning-phase agent steps/s, from the
    wall times of its own ``charts/SPS`` points (logged every 100 steps): between the first point at least 500
    steps after learning starts and the last point, rate = (s2 - s1) / (t2 - t1)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    total = cli.learning_starts + cli.script_steps
    command = [sys.executable, str(repo / "algos" / f"{cli.algo}.py"), "--env-id", cli.env_id,
               "--total-timesteps", str(total), "--learning-starts", str(cli.learning_starts),
               "--buffer-size", str(cli.buffer_size), "--eval-every", "0", "--eval-episodes", "1",
               "--eval-epsilon", "1", "--checkpoint-every", "0", "--seed", str(cli.seed),
               "--device", cli.device, "--run-dir", str(run_dir), *flags]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(repo))
    if cli.torch_threads:
        env["OMP_NUM_THREADS"] = str(cli.torch_threads)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    (events,) = run_dir.glob("*/events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    points = [(e.step, e.wall_time) for e in accumulator.Scalars("charts/SPS")]
    (s1, t1), (s2, t2) = next(p for p in points if p[0] >= cli.learning_starts + 500), points[-1]
    return {"steps": s2 - s1, "seconds": t2 - t1}


def run_scripts(cli: argparse.Namespace, report: dict[str, Any]) -> None:
    """The scripts themselves, end to end in their learning phase: plain (``--no-fast --num-envs 1``) against
    the shipped fast path with ``--num-envs N``, in alternating rounds (the order flips every round)."""
    import tempfile

    variants = {"plain": ["--no-fast", "--num-envs", "1"], "fast": ["--num-envs", str(cli.num_envs)]}
    repos = {"plain": REPO, "fast": REPO}
    if cli.baseline:  # the same flags, two checkouts: "plain" is the baseline's script, "fast" this one's
        variants["plain"], repos["plain"] = list(variants["fast"]), cli.baseline.resolve()
    if cli.against:  # one checkout, two sets of flags: "plain" adds --against's to the defaults of "fast"
        variants["plain"] = [*variants["fast"], *cli.against.split()]
    if cli.buffer_device:
        variants["fast"] += ["--buffer-device", "host" if cli.buffer_device == "cpu" else cli.buffer_device]
    totals = {name: {"steps": 0, "seconds": 0.0} for name in variants}
    report["script_rounds"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(cli.rounds):
            rates = {}
            for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
                got = script_rate(cli, variants[name], Path(tmp) / f"{name}{r}", repos[name])
                totals[name]["steps"] += got["steps"]
                totals[name]["seconds"] += got["seconds"]
                rates[name] = got["steps"] / got["seconds"]
            report["script_rounds"].append({"steps_per_s": rates, "load": load_now()})
            shown = ", ".join(f"{n} {rates[n]:.0f} steps/s" for n in variants)
            print(f"# script round {r + 1}/{cli.rounds}: {shown}; {load_now()}", flush=True)
    report["scripts"] = {
        name: {"flags": " ".join(variants[name]), "end_to_end_steps_per_s": t["steps"] / t["seconds"], **t}
        for name, t in totals.items()
    }
    ratio = report["scripts"]["fast"]["end_to_end_steps_per_s"] / report["scripts"]["plain"]["end_to_end_steps_per_s"]
    report["scripts_fast_over_plain"] = ratio
    per_round = [x["steps_per_s"]["fast"] / x["steps_per_s"]["plain"] for x in report["script_rounds"]]
    print(f"\nalgos/{cli.algo}.py end to end in the learning phase (charts/SPS), {cli.rounds} rounds:")
    labels = {"plain": f"baseline {cli.baseline}", "fast": "this checkout"} if cli.baseline else {}
    labels = {"plain": "against", "fast": "defaults"} if cli.against else labels
    for name, figures in report["scripts"].items():
        print(f"  {labels.get(name, name):<6} {figures['flags']:<32} {figures['end_to_end_steps_per_s']:>7.1f} steps/s")
    what = (
        "this checkout / baseline"
        if cli.baseline
        else f"defaults / with {cli.against}"
        if cli.against
        else "fast / plain"
    )
    print(f"  {what}: {ratio:.3f}x (per round: {', '.join(f'{x:.2f}' for x in per_round)})")
    if cli.baseline:
        report["baseline"] = str(cli.baseline.resolve())
    if cli.against:
        report["against"] = cli.against


def random_batch(cli: argparse.Namespace, args: Any, device: torch.device) -> tuple[int, Any]:
    """A batch of real frames from a short stretch of random play (for --only-variants)."""
    envs = TrainEnvs(cli.env_id, 1, seed=cli.seed)
    rb = ReplayBuffer(5_000, 1, device=device, seed=cli.seed)
    rng = np.random.default_rng(cli.seed)
    obs = envs.reset()
    for _ in range(300):
        actions = rng.integers(0, envs.n_actions, 1)
        step = envs.step(actions)
        rb.add(obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        obs = step.next_obs
    envs.close()
    return envs.n_actions, rb.sample(args.batch_size)


def run_variants(cli: argparse.Namespace, module, args: Any, device: torch.device, n_actions: int, batch,
                 report: dict[str, Any]) -> None:  # fmt: skip
    print(f"\n# the update's variants, batch {args.batch_size} ({load_now()})", flush=True)
    rows = update_variants(module, cli.algo, args, n_actions, device, batch, 5, cli.compile_variants)
    peak = matmul_peak(device)
    report["update_variants"] = rows
    report["matmul_peak_gflops"] = peak
    print(f"{'variant':<32} {'ms':>8} {'x eager':>8} {'GFLOP/s':>8} {'first 2 calls, s':>17}")
    for row in rows:
        print(f"{row['variant']:<32} {row['ms']:>8.2f} {row['speedup_vs_eager']:>8.2f} "
              f"{row['gflops_per_s']:>8.1f} {row['first_two_calls_s']:>17.1f}")  # fmt: skip
    print(f"(GFLOP/s: the update's forward and backward FLOPs, {rows[0]['gflops_per_s'] * rows[0]['ms'] / 1e3:.2f} "
          f"GFLOP, over its time; the machine's measured float32 matmul peak: {peak:.0f} GFLOP/s)")  # fmt: skip
    cat = forward_cat(module, cli.algo, args, n_actions, device, batch, rounds=3)
    report["forward_cat"] = cat
    where = CAT_APPLIES.get(cli.algo, f"not to {cli.algo}: its two forwards use different networks")
    print(f"forwards over s and s' without gradient: two of {args.batch_size}: {cat['two_forwards_ms']:.2f} ms; "
          f"one of {2 * args.batch_size}: {cat['one_forward_ms']:.2f} ms (applies to {where})")  # fmt: skip


def run_memory(cli: argparse.Namespace, report: dict[str, Any]) -> None:
    for storage in [None] + (["cuda"] if cli.buffer_device == "cuda" else []):
        memory = measure_memory(cli.memory_transitions, cli.num_envs, storage)
        report.setdefault("replay_memory", {})[storage or "host"] = memory
        if "error" in memory:
            print(f"\nreplay memory ({storage or 'host'}): failed\n{memory['error']}")
            continue
        where = "GPU memory" if storage == "cuda" else "resident memory"
        print(f"\nreplay memory ({where}), {memory['transitions']:,} transitions stored: "
              f"{memory['bytes_per_transition']:,.0f} bytes per transition; 1M transitions: "
              f"{memory['projected_1m_gb']:.2f} GB (CleanRL's buffer: {memory['cleanrl_1m_gb']:.1f} GB)")  # fmt: skip
        if storage is None:
            grown = (memory["rss_after_init_bytes"] - memory["rss_before_bytes"]) / 2**20
            print(f"  (resident memory right after allocating the buffer, before filling it: +{grown:.0f} MiB)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cli = parse_cli(argv)
    if cli.memory_child:
        print(json.dumps(memory_child(cli.memory_child, cli.num_envs, cli.buffer_device)))
        return {}
    if cli.torch_threads:
        torch.set_num_threads(cli.torch_threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cli.device == "auto" else cli.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")
    if cli.buffer_device == "cuda" and device.type != "cuda":
        sys.exit("--buffer-device cuda needs --device cuda")
    module = load_script(cli.algo)
    args = module.Args()
    settings = parse_settings(cli.fast_update, device)
    command = " ".join(["python", "benchmarks/throughput.py", *(sys.argv[1:] if argv is None else argv)])
    report: dict[str, Any] = {"command": command, "machine": machine(), "algo": cli.algo, "env_id": cli.env_id,
                              "device": str(device), "batch_size": args.batch_size,
                              "train_frequency": args.train_frequency, "load_at_start": load_now()}  # fmt: skip
    print(f"# {command}")
    print(f"# {report['machine']}")
    print(f"# {report['load_at_start']} at start", flush=True)
    if cli.scripts:
        run_scripts(cli, report)
    elif cli.only_variants:
        n_actions, batch = random_batch(cli, args, device)
    else:
        n_actions, batch = run_loops(cli, module, args, device, settings, report)
    if (cli.variants or cli.only_variants) and not cli.scripts:
        run_variants(cli, module, args, device, n_actions, batch, report)
    if cli.memory_transitions and not (cli.only_variants or cli.scripts):
        run_memory(cli, report)
    report["load_at_end"] = load_now()
    print(f"# {report['load_at_end']} at end")
    if cli.json:
        Path(cli.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.json).write_text(json.dumps(report, indent=2))
        print(f"# figures written to {cli.json}")
    return report


if __name__ == "__main__":
    main()
