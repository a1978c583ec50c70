"""Where DrQ(epsilon)'s update time goes, and what its two speed-ups bought, measured in one process.

    OMP_NUM_THREADS=1 python benchmarks/drq_update.py --threads 1 2 --baseline e8b6027~1 --json out.json

The update is algos/drq.py's own (its QNetwork, augment_batch, compute_loss, Adam with --fast's settings: fused
kernel, channels-last networks), on a replay memory of random frames (a batch's time does not depend on the frames).
Each round times, per update of batch 32, the sampling, the augmentation of s and s', and the loss, backward and
optimizer step, for each variant in turn (so a noisy machine slows all alike):

- now: algos/drq.py as it runs by default: the augmentation gathers the shifted pixels on uint8 into channels-last
  floats, and the online network is passed as the target (synced after every update, the target holds the online
  weights), so one forward of s' serves both;
- two_forwards: the same with a separate (synced) target network: its own forward of s';
- before (``--baseline REV``, e8b6027~1): that revision's augmentation (a padded float copy, then one crop per
  sample, in the plain memory layout) and two forwards of s', as the script ran before;
- bf16 (``--bf16``): now's update with its forwards under ``torch.autocast("cpu", dtype=torch.bfloat16)``, the
  lower-precision path that CPUs with AMX or AVX512-BF16 run fast. Not in drq.py: it changes the update (the
  benchmark prints by how much, beside float32's own rounding), so what it learns would need its own runs.

It first checks that the variants compute the same: the shared forward gives the same losses and weights after a
few updates, and the baseline's augmentation the same batch, bit for bit. Figures are printed and written as JSON
(``--json``); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.optim as optim

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.tools.evaluate import load_algorithm

REPO = Path(__file__).resolve().parents[1]


def filled_buffer(size: int, n_step: int, seed: int) -> ReplayBuffer:
    rb = ReplayBuffer(size, 1, n_step=n_step, gamma=0.99, seed=seed)
    rng = np.random.default_rng(seed)
    obs = rng.integers(0, 256, (1, 4, 84, 84), dtype=np.uint8)
    for t in range(size):
        next_obs = np.concatenate([obs[:, 1:], rng.integers(0, 256, (1, 1, 84, 84), dtype=np.uint8)], axis=1)
        done = np.array([t % 500 == 499])
        rb.add(obs, next_obs, rng.integers(0, 6, 1), rng.normal(size=1).astype(np.float32), done, done, ~done)
        obs = next_obs
    return rb


def make_learner(drq, n_actions: int, seed: int, **network):
    torch.manual_seed(seed)
    q_network = drq.QNetwork(n_actions, **network).to(memory_format=torch.channels_last)
    target_network = drq.QNetwork(n_actions, **network).to(memory_format=torch.channels_last)
    target_network.load_state_dict(q_network.state_dict())
    optimizer = optim.Adam(q_network.parameters(), lr=1e-4, eps=1.5e-4, fused=True)
    return q_network, target_network, optimizer


def one_update(drq, q_network, target_network, optimizer, data, args, bf16: bool = False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # --bf16's variant: the forwards in bfloat16
        loss, _ = drq.compute_loss(q_network, target_network, data, args)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def replay_updates(drq, rb, args, n_actions: int, updates: int, shared: bool = True, bf16: bool = False):
    """``updates`` updates from the same weights and batches every call (the learner, the buffer's and torch's
    generators seeded alike), the target synced after each as the script does; the weights before, the losses and
    the weights after"""
    q_network, target_network, optimizer = make_learner(drq, n_actions, seed=0)
    start = [p.detach().clone() for p in q_network.parameters()]
    rb.rng = np.random.default_rng(0)
    torch.manual_seed(1)
    losses = []
    for _ in range(updates):
        data = drq.augment_batch(rb.sample(32), 4, 0.05)
        target = q_network if shared else target_network
        losses.append(one_update(drq, q_network, target, optimizer, data, args, bf16))
        target_network.load_state_dict(q_network.state_dict())
    return start, torch.stack(losses), [p.detach().clone() for p in q_network.parameters()]


def same_result(drq, rb, args, n_actions: int, updates: int = 5) -> bool:
    """both ways, the online network as the target or a separate synced one, give the same bit for bit"""
    _, loss_a, weights_a = replay_updates(drq, rb, args, n_actions, updates, shared=False)
    _, loss_b, weights_b = replay_updates(drq, rb, args, n_actions, updates, shared=True)
    return torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(weights_a, weights_b, strict=True))


def bf16_drift(drq, rb, args, n_actions: int, updates: int = 20) -> dict[str, float]:
    """How far bfloat16 forwards move the update from float32's: from the same weights and batches, the largest
    relative difference of a loss, and the weights' distance after ``updates`` updates relative to how far
    float32's own updates moved them; beside it, the same distance for float32 at another thread count (only the
    order of the sums differs), the scale of float32's own rounding"""
    threads = torch.get_num_threads()
    start, loss32, weights32 = replay_updates(drq, rb, args, n_actions, updates)
    _, loss16, weights16 = replay_updates(drq, rb, args, n_actions, updates, bf16=True)
    torch.set_num_threads(2 if threads == 1 else 1)
    _, _, weights32_other = replay_updates(drq, rb, args, n_actions, updates)
    torch.set_num_threads(threads)

    def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)) ** 0.5

    moved = distance(weights32, start)
    return {
        "max_relative_loss_difference": float(((loss16 - loss32).abs() / loss32.abs()).max()),
        "weights_apart_over_weights_moved": distance(weights32, weights16) / moved,
        "float32_other_threads_apart_over_moved": distance(weights32, weights32_other) / moved,
    }


def load_baseline(revision: str):
    source = subprocess.run(["git", "show", f"{revision}:algos/drq.py"], cwd=REPO, capture_output=True, check=True)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "drq_baseline.py"
        path.write_bytes(source.stdout)
        return load_algorithm(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--updates", type=int, default=100, help="timed updates per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default=None, help="a git revision whose algos/drq.py augmentation is timed too")
    parser.add_argument("--bf16", action="store_true", help="time bfloat16 autocast forwards too (AMX/AVX512-BF16)")
    parser.add_argument("--nature", action="store_true", help="time the update with --encoder nature --init torch too")
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args()

    drq = load_algorithm(REPO / "algos" / "drq.py")
    args = drq.Args()
    n_actions = 18  # Boxing's and Seaquest's action set, the largest head
    rb = filled_buffer(5_000, args.n_step, seed=0)
    identical = same_result(drq, rb, args, n_actions)
    print(f"one forward and two forwards give the same losses and weights bit for bit: {identical}")
    # (augmentation, whether the target forward is shared, bf16, the network: drq.py's default or the Nature encoder)
    variants = {"now": (drq, True, False, "dopamine")}
    variants["two_forwards"] = (drq, False, False, "dopamine")
    if options.nature:
        variants["nature_encoder"] = (drq, True, False, "nature")
    drift = None
    if options.bf16:
        drift = bf16_drift(drq, rb, args, n_actions)
        print(f"bfloat16 against float32 over 20 updates from the same weights and batches: {drift}")
        variants["bf16"] = (drq, True, True, "dopamine")
    if options.baseline:
        baseline = load_baseline(options.baseline)
        batch = rb.sample(32)
        pair = [m.augment_batch(batch, 4, 0.05, torch.Generator().manual_seed(7)) for m in (drq, baseline)]
        equal = all(
            torch.equal(getattr(pair[0], f), getattr(pair[1], f)) for f in ("observations", "next_observations")
        )
        print(f"the augmentation of {options.baseline} and this one's give the same batch bit for bit: {equal}")
        identical = identical and equal
        variants["before"] = (baseline, False, False, "dopamine")  # its augmentation, its two forwards

    figures: dict[str, dict[str, float]] = {}
    for threads in options.threads:
        torch.set_num_threads(threads)
        learners = {"dopamine": make_learner(drq, n_actions, seed=0)}
        if options.nature:
            learners["nature"] = make_learner(drq, n_actions, seed=0, same_padding=False, xavier=False)
        times: dict[str, list[float]] = {f"{name}_{part}": [] for name in variants for part in ("augment", "update")}
        times["sample"] = []
        for q_network, target_network, optimizer in learners.values():
            for _ in range(3):  # warm-up
                data = drq.augment_batch(rb.sample(32), 4, 0.05)
                one_update(drq, q_network, target_network, optimizer, data, args)
        for _ in range(options.rounds):
            for name, (module, shared, bf16, network) in variants.items():
                q_network, target_network, optimizer = learners[network]
                sample = augment = update = 0.0
                for _ in range(options.updates):
                    start = time.perf_counter()
                    batch = rb.sample(32)
                    sampled = time.perf_counter()
                    data = module.augment_batch(batch, 4, 0.05)
                    augmented = time.perf_counter()
                    one_update(drq, q_network, q_network if shared else target_network, optimizer, data, args, bf16)
                    done = time.perf_counter()
                    sample += sampled - start
                    augment += augmented - sampled
                    update += done - augmented
                times[f"{name}_augment"].append(augment / options.updates * 1e3)
                times[f"{name}_update"].append(update / options.updates * 1e3)
                times["sample"].append(sample / options.updates * 1e3)
        medians = {name: statistics.median(values) for name, values in times.items()}
        for name in variants:
            medians[f"{name}_total"] = medians["sample"] + medians[f"{name}_augment"] + medians[f"{name}_update"]
        figures[f"{threads}_threads"] = medians
        print(f"{threads} thread(s), ms per update, median of {options.rounds} rounds x {options.updates} updates:")
        print(f"  sample {medians['sample']:.2f}")
        for name in variants:
            print(
                f"  {name}: augment {medians[f'{name}_augment']:.2f}, loss + backward + step "
                f"{medians[f'{name}_update']:.2f}, in all {medians[f'{name}_total']:.2f} "
                f"({medians[f'{name}_total'] / medians['now_total']:.2f}x now's)"
            )

    if options.json:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "?")
        flags = next((line for line in cpu.splitlines() if line.startswith("Flags")), "")
        record = {
            "command": f"python benchmarks/drq_update.py --threads {' '.join(map(str, options.threads))} --updates "
            f"{options.updates} --rounds {options.rounds}"
            + (f" --baseline {options.baseline}" if options.baseline else "")
            + (" --bf16" if options.bf16 else "")
            + (" --nature" if options.nature else ""),
            "machine": {
                "cpu": model,
                "avx512": "avx512f" in flags,
                "amx_bf16": "amx_bf16" in flags,
                "cores": os.cpu_count(),
                "platform": platform.platform(),
            },
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "bit_identical": identical,
            "bf16_drift": drift,
            "ms_per_update": figures,
        }
        options.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
