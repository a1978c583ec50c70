"""Where DrQ(epsilon)'s update time goes, and what one forward fewer buys, measured in one process.

    OMP_NUM_THREADS=1 python benchmarks/drq_update.py --threads 1 2 --updates 300

The update is algos/drq.py's own (its QNetwork, augment_batch, compute_loss, Adam with --fast's settings: fused
kernel, channels-last), on a replay memory filled with random frames (the time of a batch does not depend on the
frames). Each round times, per update of batch 32:

- sample: ReplayBuffer.sample (n-step 10);
- augment: augment_batch on s and s' (random shifts with edge padding, intensity noise);
- update (two target forwards): compute_loss with a separate target network, zero_grad, backward, step; the way
  the script ran before its target forward was shared;
- update (one forward): the same with the target network being the online network, what algos/drq.py passes when
  the target is synced at every agent step (its defaults): the target network then holds the online weights at
  every update, so its forward of s' is the online one's and is read once.

The rounds alternate the variants so a noisy machine slows both alike. It also checks that the two ways give the
same loss and the same weights after a few updates, bit for bit. Figures are printed and written as JSON
(``--json``); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import torch.optim as optim

from cleanrl_utils.buffer import ReplayBuffer
from cleanrl_utils.evaluation import load_algorithm

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


def make_learner(drq, n_actions: int, seed: int):
    torch.manual_seed(seed)
    q_network = drq.QNetwork(n_actions).to(memory_format=torch.channels_last)
    target_network = drq.QNetwork(n_actions).to(memory_format=torch.channels_last)
    target_network.load_state_dict(q_network.state_dict())
    optimizer = optim.Adam(q_network.parameters(), lr=1e-4, eps=1.5e-4, fused=True)
    return q_network, target_network, optimizer


def one_update(drq, q_network, target_network, optimizer, data, args):
    loss, _ = drq.compute_loss(q_network, target_network, data, args)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def same_result(drq, rb, args, n_actions: int, updates: int = 5) -> bool:
    """both ways, from the same weights and batches, the target synced after every update as the script does"""
    results = []
    for shared in (False, True):
        q_network, target_network, optimizer = make_learner(drq, n_actions, seed=0)
        rb.rng = np.random.default_rng(0)
        torch.manual_seed(1)
        losses = []
        for _ in range(updates):
            data = drq.augment_batch(rb.sample(32), 4, 0.05)
            losses.append(one_update(drq, q_network, q_network if shared else target_network, optimizer, data, args))
            target_network.load_state_dict(q_network.state_dict())
        results.append((torch.stack(losses), [p.detach().clone() for p in q_network.parameters()]))
    (loss_a, weights_a), (loss_b, weights_b) = results
    return torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(weights_a, weights_b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--updates", type=int, default=300, help="timed updates per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args()

    drq = load_algorithm(REPO / "algos" / "drq.py")
    args = drq.Args()
    n_actions = 18  # Boxing's and Seaquest's action set, the largest head
    rb = filled_buffer(5_000, args.n_step, seed=0)
    identical = same_result(drq, rb, args, n_actions)
    print(f"one forward and two forwards give the same losses and weights bit for bit: {identical}")

    figures: dict[str, dict[str, float]] = {}
    for threads in options.threads:
        torch.set_num_threads(threads)
        q_network, target_network, optimizer = make_learner(drq, n_actions, seed=0)
        times: dict[str, list[float]] = {
            "sample": [],
            "augment": [],
            "update_two_forwards": [],
            "update_one_forward": [],
        }
        for _ in range(3):  # warm-up
            data = drq.augment_batch(rb.sample(32), 4, 0.05)
            one_update(drq, q_network, target_network, optimizer, data, args)
        for _ in range(options.rounds):
            for name in ("update_two_forwards", "update_one_forward"):
                sample = augment = update = 0.0
                for _ in range(options.updates):
                    start = time.perf_counter()
                    batch = rb.sample(32)
                    sampled = time.perf_counter()
                    data = drq.augment_batch(batch, 4, 0.05)
                    augmented = time.perf_counter()
                    target = q_network if name == "update_one_forward" else target_network
                    one_update(drq, q_network, target, optimizer, data, args)
                    done = time.perf_counter()
                    sample, augment, update = (
                        sample + sampled - start,
                        augment + augmented - sampled,
                        update + done - augmented,
                    )
                times[name].append(update / options.updates * 1e3)
                times["sample"].append(sample / options.updates * 1e3)
                times["augment"].append(augment / options.updates * 1e3)
        medians = {name: statistics.median(values) for name, values in times.items()}
        figures[f"{threads}_threads"] = medians
        print(
            f"{threads} thread(s), ms per update (median of {options.rounds} rounds x {options.updates}): sample "
            f"{medians['sample']:.2f}, augment {medians['augment']:.2f}, update with two forwards of s' "
            f"{medians['update_two_forwards']:.2f}, with one {medians['update_one_forward']:.2f} "
            f"({medians['update_two_forwards'] / medians['update_one_forward']:.2f}x)"
        )

    if options.json:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "?")
        record = {
            "command": "python benchmarks/drq_update.py " + " ".join(f"--threads {t}" for t in options.threads),
            "machine": {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform()},
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "bit_identical": identical,
            "ms_per_update": figures,
        }
        options.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
