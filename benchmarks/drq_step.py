"""One learning step of DrQ(epsilon) with a real game: does stepping the game during the update pay on this CPU?

    python benchmarks/drq_step.py --steps 200 --rounds 3 --json out.json

A learning step as algos/drq.py runs it by default (its QNetwork with Dopamine's network, augment_batch,
compute_loss with the online network as its own target, fused Adam, channels-last networks) on Pong through
``TrainEnvs`` with drq.py's protocol, every action greedy (the acting forward every step, as after epsilon's
decay). Variants, alternating in rounds so that a noisy machine slows all alike:

- overlapped: ``envs.send`` before the update, ``envs.recv`` after it (the game steps in ale-py's thread while
  the learner updates), as drq.py;
- serial: the game stepped (``envs.step``) before the update, nothing running beside the update;
- update_only: the sampling and update alone, no acting, no game.

The replay memory is filled with random frames first (a batch's time does not depend on its frames) and the
game's transitions are added to it as the loop does. Prints milliseconds per step and writes them as JSON;
nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from drq_update import filled_buffer, make_learner  # benchmarks/, the script's folder

from cleanrl_utils.envs import TrainEnvs
from cleanrl_utils.tools.evaluate import load_algorithm

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as many as cores)")
    parser.add_argument("--env-id", default="PongNoFrameskip-v4")
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args()
    torch.set_num_threads(options.threads or os.cpu_count())

    drq = load_algorithm(REPO / "algos" / "drq.py")
    args = drq.Args()
    rb = filled_buffer(5_000, args.n_step, seed=0)
    protocol = dict(forced_steps=args.forced_steps, zero_stacks=args.zero_stacks, noop_starts=args.noop_starts)
    envs = TrainEnvs(options.env_id, 1, seed=1, **protocol)  # drq.py's defaults, read from its Args
    q_network, _, optimizer = make_learner(drq, envs.n_actions, seed=0)
    obs = envs.reset()

    def update() -> None:
        data = drq.augment_batch(rb.sample(32), args.augmentation_pad, args.intensity_scale, shift_per=args.shift_per)
        loss, _ = drq.compute_loss(q_network, q_network, data, args)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return q_network(torch.as_tensor(obs)).argmax(dim=1).numpy()

    def step(variant: str, obs: np.ndarray) -> np.ndarray:
        if variant == "update_only":
            update()
            return obs
        actions = act(obs)
        if variant == "overlapped":
            envs.send(actions)
            update()
            result = envs.recv()
        else:
            result = envs.step(actions)
            update()
        rb.add(obs, result.next_obs, actions, result.rewards, result.dones, result.ends, result.mask)
        return result.next_obs

    variants = ("overlapped", "serial", "update_only")
    for variant in variants:  # warm-up
        for _ in range(5):
            obs = step(variant, obs)
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for _ in range(options.rounds):
        for variant in variants:
            start = time.perf_counter()
            for _ in range(options.steps):
                obs = step(variant, obs)
            times[variant].append((time.perf_counter() - start) / options.steps * 1e3)
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    for variant in variants:
        print(f"{variant:12s} {medians[variant]:6.1f} ms per step  rounds {[round(t, 1) for t in times[variant]]}")
    print(f"serial / overlapped: {medians['serial'] / medians['overlapped']:.3f}")
    if options.json:
        record = {
            "command": "python benchmarks/drq_step.py "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(options).items() if k != "json"),
            "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "ms_per_step": times,
            "medians": medians,
        }
        options.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
