# Your value-based algorithm, compared fairly with the reference scripts; docs in docs/custom_algorithms.md.
# Copy this file (e.g. to algos/my_algo.py) and edit ONLY the EDITABLE block: a QNetwork (a head over the
# fixed Nature encoder) and a ValueAlgorithm (networks, optimizer, select_action, update). Everything marked
# FIXED (arguments, environments, replay, exploration schedule, loop, logging, evaluation) is what every
# algorithm shares, and cleanrl_utils.tools.template_rules checks the rules at start-up. As shipped: DQN, as algos/dqn.py.
import os
import random
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: F401 (the shipped DQN uses it; your block may not)
import torch.optim as optim
import tyro
from cleanrl_utils.run_flags import RunFlags

from cleanrl_utils.buffer import ReplayBuffer, bytes_per_transition
from cleanrl_utils.checkpoint import (
    CheckpointError,
    StopFlag,
    find_checkpoint,
    load_parts,
    parts_state,
    resume_args,
    save_checkpoint,
)
from cleanrl_utils.checks import CpuThreads, check_memory, fail, pick_buffer_device, pick_device, validate_common_args
from cleanrl_utils.encoder import NatureCNN
from cleanrl_utils.envs import OBSERVATION_SHAPE, EnvIdError, TrainEnvs, check_env_id
from cleanrl_utils.evaluation import evaluate
from cleanrl_utils.random_state import random_state, set_random_state
from cleanrl_utils.run import Run, nonfinite
from cleanrl_utils.tools.template_rules import (
    TemplateRuleError,
    ValueAlgorithmBase,
    check_actions,
    check_algorithm,
    check_metrics,
)


# FIXED: the arguments every algorithm shares (CleanRL's dqn_atari.py defaults)
@dataclass
class Args(RunFlags):  # + the shared flags for running: threads, run folder, checkpoints, resume
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    device: str = "auto"
    """auto (CUDA, then MPS, then CPU), cuda, mps or cpu"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "value-atari"
    """the wandb's project name"""
    wandb_entity: str | None = None
    """the entity (team) of wandb's project"""
    capture_video: bool = False
    """whether to record the evaluation games as MP4 in the run folder"""
    save_model: bool = False
    """whether to save the model into the run folder"""
    fast: bool = True
    """the fast update, same loss and gradients to float tolerance (benchmarks/RESULTS.md): Adam's fused kernel on
    CPU and CUDA, channels-last convolutions on CPU; --no-fast: the plain update"""

    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the environment"""
    total_timesteps: int = 10_000_000
    """total agent steps of the experiment, summed over environments"""
    learning_rate: float = 1e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 1000
    """the agent steps it takes to update the target network"""
    batch_size: int = 32
    """the batch size of sample from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    learning_starts: int = 80_000
    """agent steps to start learning"""
    train_frequency: int = 4
    """agent steps per gradient update, whatever the number of environments"""
    eval_every: int = 500_000
    """agent steps between evaluations (0: only the final one)"""
    eval_episodes: int = 10
    """whole games per evaluation"""
    eval_epsilon: float = 0.01
    """epsilon of the evaluation policy (0: greedy)"""
    adam_eps: float = 1e-8
    """the epsilon of the Adam optimizer (Adam's default, as CleanRL)"""
    parameter_budget: int | None = None
    """trainable parameters allowed (default: the Nature encoder + the largest head among the reference
    algorithms for the game's action count, printed at start-up); another value is not a fair comparison"""


# ======================= EDITABLE: your algorithm (everything else is FIXED) =======================
# QNetwork(envs): a head over the fixed Nature encoder (512 features); forward(x) -> (batch, n_actions)
# Q-values, which evaluation acts on greedily. ValueAlgorithm(envs, device, args): owns the networks
# (freeze target networks with .requires_grad_(False): every parameter that requires gradients counts
# against the budget) and the optimizer; select_action(obs, epsilon) -> one integer action per
# environment; update(batch, global_step) -> dict of metrics with at least td_loss and q_values (floats or
# one-element tensors: loss.detach() spares the GPU a wait at every update); update_target_network(tau), which
# the loop calls each time the step passes a multiple of --target-network-frequency (a pass if you have none).
# batch: observations, actions, rewards, next_observations, dones (tensors on the device).
class QNetwork(nn.Module):
    def __init__(self, envs):
        super().__init__()
        self.encoder = NatureCNN()
        self.head = nn.Linear(512, envs.single_action_space.n)

    def forward(self, x):
        return self.head(self.encoder(x))


class ValueAlgorithm(ValueAlgorithmBase):
    """DQN (Mnih et al. 2015): MSE TD loss towards r + gamma * max_a' Q_target(s', a')."""

    def __init__(self, envs, device, args):
        self.args, self.device = args, device
        self.n_actions = envs.single_action_space.n
        self.q_network = QNetwork(envs).to(device)
        self.target_network = QNetwork(envs).to(device).requires_grad_(False)
        self.target_network.load_state_dict(self.q_network.state_dict())
        if args.fast and device.type == "cpu":  # --fast: channels-last convolutions, which oneDNN runs faster on CPU
            self.q_network.to(memory_format=torch.channels_last)
            self.target_network.to(memory_format=torch.channels_last)
        fused = args.fast and device.type in ("cpu", "cuda")  # --fast: Adam's fused kernel (None: torch's default)
        self.optimizer = optim.Adam(
            self.q_network.parameters(), lr=args.learning_rate, eps=args.adam_eps, fused=fused or None
        )
        self.rng = np.random.default_rng(args.seed)  # the acting generator, seeded as algos/dqn.py's loop's

    def select_action(self, obs, epsilon):
        actions = self.rng.integers(0, self.n_actions, len(obs))
        greedy = self.rng.random(len(obs)) >= epsilon
        if greedy.any():
            with torch.no_grad():
                q_values = self.q_network(torch.as_tensor(obs[greedy], device=self.device))
            actions[greedy] = q_values.argmax(dim=1).cpu().numpy()
        return actions

    def update(self, data, global_step):
        with torch.no_grad():
            target_max, _ = self.target_network(data.next_observations).max(dim=1)
            td_target = data.rewards + self.args.gamma * target_max * (1 - data.dones)
        old_val = self.q_network(data.observations).gather(1, data.actions.unsqueeze(1)).squeeze(1)
        loss = F.mse_loss(td_target, old_val)

        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"td_loss": loss.detach(), "q_values": old_val.detach().mean()}

    def update_target_network(self, tau):
        for target_param, q_param in zip(self.target_network.parameters(), self.q_network.parameters(), strict=True):
            target_param.data.copy_(tau * q_param.data + (1.0 - tau) * target_param.data)


# ==================================== end of EDITABLE ====================================


# FIXED: the exploration schedule
def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


# FIXED: everything below
if __name__ == "__main__":
    setup_start = time.perf_counter()
    args = tyro.cli(Args)
    try:  # --resume: the run's newest checkpoint and its own settings; a bad checkpoint stops here
        checkpoint = find_checkpoint(args.resume, __file__) if args.resume else None
        args = resume_args(args, checkpoint) if checkpoint else args
    except CheckpointError as error:
        fail(str(error))
    validate_common_args(args)
    cpu_threads = CpuThreads(args.torch_threads)  # fewer torch threads while other processes hold cores
    torch.set_num_threads(cpu_threads.choose())
    if not (np.isfinite(args.adam_eps) and args.adam_eps > 0):
        fail(f"--adam-eps {args.adam_eps} must be > 0 and finite (this script's default: {Args.adam_eps})")
    if args.parameter_budget is not None and args.parameter_budget <= 0:
        fail(f"--parameter-budget {args.parameter_budget} must be a positive integer (or left out for the default)")
    try:
        check_env_id(args.env_id)
    except EnvIdError as error:
        fail(str(error))
    device = pick_device(args.device)
    buffer_device = pick_buffer_device(args.buffer_device, device)  # --buffer-device cuda: frames on the GPU
    check_memory(args.buffer_size, bytes_per_transition(), buffer_device)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    try:
        envs = TrainEnvs(args.env_id, args.num_envs, seed=args.seed)
    except EnvIdError as error:
        fail(str(error))
    algorithm = ValueAlgorithm(envs, device, args)
    # the rules: unmodified encoder, parameter budget, Q-values and actions of the right shape (tried on blank
    # frames: the games are reset once, below, as algos/dqn.py resets them)
    blank = np.zeros((args.num_envs, *OBSERVATION_SHAPE), dtype=np.uint8)
    try:
        q_network = check_algorithm(algorithm, QNetwork, envs, blank, device, args.parameter_budget)
    except TemplateRuleError as error:  # before the run folder exists: nothing to close
        fail(str(error))
    rb = ReplayBuffer(args.buffer_size, args.num_envs, device=device, seed=args.seed, storage_device=buffer_device)
    run = Run(args, __file__, device, checkpoint)  # the run folder appears once everything is allocated
    parts = {"algorithm": algorithm}  # its networks, optimizers, generators and counters (ValueAlgorithmBase)
    stop = StopFlag("finishing the current step, then writing a checkpoint (signal again to exit at once)")
    signal.signal(signal.SIGINT, stop.set)  # the loop reads stop.requested at the end of each step
    signal.signal(signal.SIGTERM, stop.set)
    run.timings["setup"] += time.perf_counter() - setup_start

    learning_starts = args.learning_starts  # agent steps of random play before the first update
    if checkpoint is None:
        obs, global_step, update_credit = envs.reset(), 0, 0
    else:  # where the checkpoint left off: everything the loop owns, put back
        state = checkpoint.state
        load_parts(parts, state)  # networks, optimizer, the acting generator
        set_random_state(state["random"])  # Python's, NumPy's and torch's generators
        global_step, update_credit = state["global_step"], state["update_credit"]
        replay = checkpoint.replay()  # None unless the run had --checkpoint-buffer
        if replay is not None:
            rb.load_state_dict(replay)
        if state["games"] is not None:  # games that can be saved (the tests' toy games) continue
            envs.load_state_dict(state["games"])
            obs = state["obs"]
        else:  # Atari games cannot be saved: new ones, seeded apart from the first run's
            envs.seed = args.seed + 1_000_003 * (len(state["run"]["resumes"]) + 1)
            obs = envs.reset()
            rb.cut_episodes()  # the stored games end there: their last transitions bootstrap
        run.resumed(checkpoint, replay_restored=replay is not None, games_restored=state["games"] is not None)
        if replay is None:  # an empty replay memory refills before learning again
            learning_starts += global_step
    metrics = None  # the latest update's metrics (tensors), read when logged
    while global_step < args.total_timesteps:
        previous_step = global_step
        epsilon = linear_schedule(
            args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step
        )
        with run.timed("acting"):
            try:
                actions = check_actions(algorithm.select_action(obs, epsilon), args.num_envs, envs.n_actions)
            except TemplateRuleError as error:  # the receipt says failed: invalid actions
                run.close(status=f"failed: {error.status}")
                fail(str(error))
        with run.timed("environment"):
            envs.send(actions)  # the games step in their own threads while the learner updates, below
        global_step += args.num_envs
        run.counts["env_steps"] = global_step

        if global_step > learning_starts:
            update_credit += args.num_envs
            while update_credit >= args.train_frequency:  # one update per train_frequency agent steps
                update_credit -= args.train_frequency
                with run.timed("learning"):
                    data = rb.sample(args.batch_size)
                    metrics = algorithm.update(data, global_step)
                    try:
                        metrics = check_metrics(metrics, global_step, sync=run.counts["gradient_updates"] == 0)
                    except TemplateRuleError as error:  # e.g. failed: non-finite metrics
                        run.close(status=f"failed: {error.status}")
                        fail(str(error))
                run.counts["gradient_updates"] += 1

            if global_step // 1000 > previous_step // 1000 and metrics is not None:
                values = run.train_metrics(global_step, metrics)  # the only host synchronisation of the loop
                bad = nonfinite(values, q_network)
                if bad:  # a non-finite loss or weights stop the run; the checkpoints written so far stay
                    run.close(status=f"failed: non-finite {bad} at step {global_step}")
                    sys.exit(f"error: non-finite {bad} at step {global_step}; stopping: {run.what_is_kept()}")

            # update target network
            if global_step // args.target_network_frequency > previous_step // args.target_network_frequency:
                algorithm.update_target_network(args.tau)

        with run.timed("environment"):
            step = envs.recv()
        for _, episodic_return, length in step.episode_returns:
            run.episode(global_step, episodic_return, length)
        # the step after a game ends returns the reset observation: not a transition (mask)
        rb.add(obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        run.counts["transitions_stored"] += int(step.mask.sum())
        obs = step.next_obs

        if global_step // 100 > previous_step // 100:
            sps = run.recent_sps(global_step)  # steps/s over the last minute, this process's steps only
            torch.set_num_threads(cpu_threads.choose())  # re-read every 5 s
            run.scalar("charts/SPS", int(sps), global_step)
            run.scalar("charts/epsilon", epsilon, global_step)
            run.show_progress(global_step, args.total_timesteps, sps)

        if (
            args.eval_every
            and global_step // args.eval_every > previous_step // args.eval_every
            and global_step < args.total_timesteps
        ):
            with run.timed("evaluation"):
                result = evaluate(
                    q_network,
                    args.env_id,
                    envs.n_actions,
                    device,
                    args.eval_episodes,
                    args.eval_epsilon,
                    seed=args.seed + 10_000 + 100 * run.counts["evaluations"],
                    video_path=run.video_path(global_step),
                )
            run.evaluation(global_step, result)
            run.write_receipt()

        every = args.checkpoint_every
        periodic = every and global_step // every > previous_step // every and global_step < args.total_timesteps
        if periodic or stop.requested:  # every --checkpoint-every steps, and after SIGINT/SIGTERM
            with run.timed("checkpoint"):
                state = {
                    **parts_state(parts),
                    "random": random_state(),
                    "global_step": global_step,
                    "update_credit": update_credit,
                    "obs": obs,
                    "games": envs.state_dict() if envs.games_can_be_saved else None,
                    **run.state_dict(),  # the algorithm, its arguments, the record so far
                }
                replay = rb.state_dict() if args.checkpoint_buffer else None
                path = save_checkpoint(run.dir / "checkpoints", global_step, state, replay, args.checkpoint_keep)
            run.checkpoint_written(path, global_step)
            if stop.requested:
                run.close(status="interrupted")
                where = f"{os.path.relpath(__file__)} --resume {run.dir}"
                run.print(f"stopped at step {global_step} by {stop.requested}; resume with: python {where}")
                sys.exit(0)

    stop.message = (
        f"training is done (step {global_step}); the final evaluation goes on to its end"
        f"{' and the model is saved' if args.save_model else ''}, then the run ends as finished; no checkpoint is "
        "written (signal again to exit at once, without the final evaluation)"
    )
    run.print(f"training done at step {global_step}; final evaluation of {args.eval_episodes} games")
    with run.timed("evaluation"):
        result = evaluate(
            q_network,
            args.env_id,
            envs.n_actions,
            device,
            args.eval_episodes,
            args.eval_epsilon,
            seed=args.seed + 10_000 + 100 * run.counts["evaluations"],
            video_path=run.video_path(global_step),
        )
    run.evaluation(global_step, result, final=True)
    if args.save_model:
        run.save_model(q_network, envs.n_actions)
    envs.close()
    run.close()
