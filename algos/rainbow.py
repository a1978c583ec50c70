# Rainbow (Hessel et al. 2018): C51's distributional loss + Double DQN's action selection + a dueling head
# + noisy layers for exploration (no epsilon-greedy) + 3-step returns + prioritized replay, with the paper's
# Atari settings; each part but the first two has a flag to turn it off, the paper's ablations: --n-step 1,
# --no-dueling, --no-noisy, --no-prioritized; docs in docs/algorithms.md. The network is the fixed Nature encoder (its
# 512-unit layer stands for the paper's noisy hidden layers of 512, which our fixed encoder cannot have) and a
# dueling head of noisy layers. Rainbow's own parts are in this file: the noisy layer before the network, the
# prioritized replay memory (over the shared buffer) after the loss.
import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from cleanrl_utils.buffer import ReplayBatch, ReplayBuffer
from cleanrl_utils.encoder import NatureCNN
from cleanrl_utils.envs import TrainEnvs
from cleanrl_utils.run import Run, RunFlags, parse_args


@dataclass
class Args(RunFlags):  # + the shared flags for running: threads, run folder, checkpoints, resume
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    device: Literal["auto", "cuda", "mps", "cpu"] = "auto"
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
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """on a non-finite loss: stop the run (its checkpoints kept), or skip that update"""
    fast: bool = True
    """the fast update, same loss and gradients to float tolerance (benchmarks/RESULTS.md): Adam's fused kernel on
    CPU and CUDA, channels-last convolutions on CPU; --no-fast: the plain update"""

    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the environment"""
    total_timesteps: int = 10_000_000
    """total agent steps of the experiment, summed over environments"""
    learning_rate: float = 6.25e-5
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 8_000
    """the agent steps it takes to update the target network (32k frames)"""
    batch_size: int = 32
    """the batch size of sample from the replay memory"""
    start_e: float | None = None
    """the starting epsilon for exploration (default: 0, the noisy layers explore; 1 with --no-noisy)"""
    end_e: float | None = None
    """the ending epsilon for exploration (default: 0, the noisy layers explore; 0.01 with --no-noisy)"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    learning_starts: int = 20_000
    """agent steps to start learning (80k frames)"""
    train_frequency: int = 4
    """agent steps per gradient update, whatever the number of environments"""
    eval_every: int = 500_000
    """agent steps between evaluations (0: only the final one)"""
    eval_episodes: int = 10
    """whole games per evaluation"""
    eval_epsilon: float = 0.01
    """epsilon of the evaluation policy (0: greedy)"""
    adam_eps: float = 1.5e-4
    """the epsilon of the Adam optimizer (the paper's 1.5e-4)"""
    n_atoms: int = 51
    """the number of atoms of the return distribution's support"""
    v_min: float = -10.0
    """the lowest return of the support"""
    v_max: float = 10.0
    """the highest return of the support"""
    n_step: int = 3
    """the number of steps of the multi-step return (stops at episode ends); --n-step 1: the one-step target"""
    prioritized: bool = True
    """whether to sample the replay memory in proportion to the loss (Schaul et al. 2016); --no-prioritized:
    uniformly, with no importance-sampling weights"""
    prioritized_alpha: float = 0.5
    """the priority exponent: p = (loss + eps) ** alpha (0: uniform sampling)"""
    prioritized_beta: float = 0.4
    """the importance-sampling exponent at the start, annealed linearly to `prioritized-beta-end` over `total-timesteps`"""
    prioritized_beta_end: float = 1.0
    """the importance-sampling exponent at the end (DER: 0.5, the start's: held throughout)"""
    prioritized_eps: float = 1e-6
    """added to the loss before the exponent, so that no transition's priority is 0"""
    dueling: bool = True
    """whether the head is dueling, per atom (Wang et al. 2016); --no-dueling: one layer gives the logits"""
    noisy: bool = True
    """whether the head's layers are noisy (Fortunato et al. 2018) and explore, with epsilon 0; --no-noisy: plain
    layers and epsilon-greedy, epsilon from 1 to 0.01 as DQN unless --start-e and --end-e say otherwise"""
    noisy_sigma: float = 0.5
    """sigma_0 of the noisy layers' factorised Gaussian noise"""
    forced_steps: bool = True
    """whether FIRE is pressed for the agent at a game's start and after a life loss (NOOP, FIRE, 2), as the other
    scripts' protocol (CleanRL's wrappers); --no-forced-steps: the agent plays every step, as Dopamine's Atari 100k
    (DER)"""

    def __post_init__(self):  # epsilon-greedy explores only with --no-noisy, then from 1 to 0.01 as DQN
        if self.start_e is None:
            self.start_e = 0.0 if self.noisy else 1.0
        if self.end_e is None:
            self.end_e = 0.0 if self.noisy else 0.01


# ---------------------------------------------------------------- noisy layers (Fortunato et al. 2018, NoisyNet)
# y = (mu_w + sigma_w * eps_w) x + mu_b + sigma_b * eps_b with factorised noise: eps_w = f(eps_out) f(eps_in)^T and
# eps_b = f(eps_out), f(x) = sgn(x) sqrt(|x|), eps_in and eps_out standard normal vectors of the layer's input and
# output sizes (p + q draws instead of p * q). Initialisation as the paper's section 3.2: mu ~ U[-1/sqrt(p), 1/sqrt(p)],
# sigma = sigma_0 / sqrt(p), p the input size. The noise stays fixed between calls of reset_noise(); in evaluation
# mode (.eval()) the layer uses its mean weights only. The noise is not in the state dict (it is not learned).


def scaled_noise(size: int, device: torch.device) -> torch.Tensor:
    """f(x) = sgn(x) sqrt(|x|) of ``size`` standard normal draws"""
    x = torch.randn(size, device=device)
    return x.sign() * x.abs().sqrt()


class NoisyLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, sigma_0: float = 0.5) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"NoisyLinear needs positive sizes, got {in_features} -> {out_features}")
        if not sigma_0 >= 0:
            raise ValueError(f"sigma_0 {sigma_0} must be >= 0 (0: no noise)")
        self.in_features, self.out_features, self.sigma_0 = in_features, out_features, sigma_0
        self.weight_mu = nn.Parameter(torch.empty(out_features, in_features))
        self.weight_sigma = nn.Parameter(torch.empty(out_features, in_features))
        self.bias_mu = nn.Parameter(torch.empty(out_features))
        self.bias_sigma = nn.Parameter(torch.empty(out_features))
        self.register_buffer("epsilon_in", torch.zeros(in_features), persistent=False)
        self.register_buffer("epsilon_out", torch.zeros(out_features), persistent=False)
        self.reset_parameters()
        self.reset_noise()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight_mu.uniform_(-bound, bound)
            self.bias_mu.uniform_(-bound, bound)
            self.weight_sigma.fill_(self.sigma_0 / math.sqrt(self.in_features))
            self.bias_sigma.fill_(self.sigma_0 / math.sqrt(self.in_features))

    def reset_noise(self) -> None:
        """a new draw of eps_in and eps_out, used by every forward pass in training mode until the next"""
        self.epsilon_in.copy_(scaled_noise(self.in_features, self.epsilon_in.device))
        self.epsilon_out.copy_(scaled_noise(self.out_features, self.epsilon_out.device))

    def weight_epsilon(self) -> torch.Tensor:
        """eps_w = f(eps_out) f(eps_in)^T, (out_features, in_features)"""
        return torch.outer(self.epsilon_out, self.epsilon_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:  # evaluation: the mean weights
            return nn.functional.linear(x, self.weight_mu, self.bias_mu)
        weight = self.weight_mu + self.weight_sigma * self.weight_epsilon()
        bias = self.bias_mu + self.bias_sigma * self.epsilon_out
        return nn.functional.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, sigma_0={self.sigma_0}"


def reset_noise(module: nn.Module) -> None:
    """a new noise draw for every NoisyLinear inside ``module``"""
    for layer in module.modules():
        if isinstance(layer, NoisyLinear):
            layer.reset_noise()


def mean_sigma(module: nn.Module) -> float:
    """the mean |sigma| over the weights of every NoisyLinear inside ``module`` (how much noise is left)"""
    sigmas = [
        layer.weight_sigma.detach().abs().flatten() for layer in module.modules() if isinstance(layer, NoisyLinear)
    ]
    return torch.cat(sigmas).mean().item() if sigmas else 0.0


class QNetwork(nn.Module):
    def __init__(
        self,
        n_actions: int,
        n_atoms: int = 51,
        v_min: float = -10.0,
        v_max: float = 10.0,
        noisy_sigma: float = 0.5,
        dueling: bool = True,
        noisy: bool = True,
    ):
        super().__init__()
        self.encoder = NatureCNN()
        self.n_actions, self.n_atoms = n_actions, n_atoms
        self.register_buffer("atoms", torch.linspace(v_min, v_max, n_atoms))  # the support z_1..z_N
        linear = partial(NoisyLinear, sigma_0=noisy_sigma) if noisy else nn.Linear  # --no-noisy: plain layers
        self.value = linear(512, n_atoms) if dueling else None  # dueling: a value stream
        self.advantage = linear(512, n_actions * n_atoms)  # and an advantage stream (--no-dueling: the logits)

    def log_distribution(self, x):
        """log-probabilities of the returns on the atoms, (batch, n_actions, n_atoms)"""
        features = self.encoder(x)
        logits = self.advantage(features).view(-1, self.n_actions, self.n_atoms)
        if self.value is not None:
            logits = dueling_logits(self.value(features).view(-1, 1, self.n_atoms), logits)
        return F.log_softmax(logits, dim=2)

    def distribution(self, x):
        """probabilities of the returns on the atoms, (batch, n_actions, n_atoms)"""
        return self.log_distribution(x).exp()

    def forward(self, x):
        """expected returns, the Q-values, (batch, n_actions)"""
        return (self.distribution(x) * self.atoms).sum(dim=2)


def dueling_logits(value, advantage):
    """Wang et al. (2016) per atom, as Rainbow: v(s) + a(s, a) - mean_a' a(s, a'); value (batch, 1, N),
    advantage (batch, n_actions, N) -> logits (batch, n_actions, N), softmaxed over the atoms afterwards"""
    return value + advantage - advantage.mean(dim=1, keepdim=True)


def project_distribution(next_probs, rewards, discounts, atoms):
    """The categorical projection of Bellemare et al. (2017, Algorithm 1), vectorised over the batch: each target
    atom r + discount * z_j (discount gamma, gamma^k for a k-step return, 0 after a terminal: no bootstrap),
    clipped to [v_min, v_max], gives its probability p_j to the two nearest support points in proportion to
    closeness, z_i receiving p_j * max(0, 1 - |Tz_j - z_i| / delta_z).
    next_probs (batch, N), rewards and discounts (batch,), atoms (N,)"""
    delta_z = (atoms[-1] - atoms[0]) / (len(atoms) - 1)
    tz = (rewards.unsqueeze(1) + discounts.unsqueeze(1) * atoms).clamp(atoms[0], atoms[-1])
    closeness = (1 - (tz.unsqueeze(1) - atoms.view(1, -1, 1)).abs() / delta_z).clamp(min=0)  # (batch, i, j)
    return (closeness * next_probs.unsqueeze(1)).sum(dim=2)


def compute_target_distribution(q_network, target_network, data):
    """Double: the projection of R + gamma^n * Z_target(s', a*) with a* = argmax_a' E[Z_online(s', a')], the
    online network choosing and the target network evaluating; R the n-step discounted reward sum, s' the state
    n steps later, gamma^n the batch's `discounts` (gamma^k if the episode ended after k < n steps, 0 after a
    terminal); (batch, N)"""
    with torch.no_grad():
        next_actions = q_network(data.next_observations).argmax(dim=1)
        next_probs = target_network.distribution(data.next_observations)
        next_probs = next_probs[torch.arange(len(next_actions), device=next_actions.device), next_actions]
        return project_distribution(next_probs, data.rewards, data.discounts, target_network.atoms)


def per_sample_cross_entropy(target_probs, log_probs):
    """-sum_i target_i * log p_i for each transition (Rainbow's priority too); (batch, N) twice -> (batch,)"""
    return -(target_probs * log_probs).sum(dim=1)


def compute_loss(q_network, target_network, data, args):
    """the loss on a sampled batch, the metrics the loop logs, and each transition's loss (its new priority: the
    paper's KL plus the target's entropy); td_loss is the unweighted cross-entropy, as c51's"""
    target_probs = compute_target_distribution(q_network, target_network, data)
    rows = torch.arange(len(data.actions), device=data.actions.device)
    log_probs = q_network.log_distribution(data.observations)[rows, data.actions]  # the taken actions'
    losses = per_sample_cross_entropy(target_probs, log_probs)
    # importance-sampling weights correct the bias of prioritized sampling (--no-prioritized: none)
    loss = (data.weights * losses).mean() if args.prioritized else losses.mean()
    old_val = (log_probs.detach().exp() * q_network.atoms).sum(dim=1)  # E[Z(s, a)]
    return loss, {"td_loss": losses.detach().mean(), "q_values": old_val.mean()}, losses.detach()


# ---------------------------------------------------------------- prioritized replay (Schaul et al. 2016)
# Proportional variant, over the shared frame-deduplicated buffer. Transition i is sampled with probability
# P(i) = p_i / sum_k p_k, its priority p_i = (|delta_i| + eps) ** alpha (delta_i its last loss); a new transition
# gets the largest priority seen so far, so it is sampled at least once soon. The bias this brings is corrected by
# importance-sampling weights w_i = (N * P(i)) ** -beta, normalised by the largest over the buffer,
# w_i / max_k w_k = (p_min / p_i) ** beta, so they only ever scale an update down. Priorities live in a sum tree:
# sampling (a prefix-sum search) and updating take O(log n) per item, vectorised over the batch with numpy. A slot
# that holds no complete transition (a stack's first frames, a transition whose stack was overwritten, or whose
# n-step return is not complete yet) has priority 0, so it is never sampled.


# the sum tree's memory per transition, at most: two float64 arrays of 2 * (leaves rounded up to a power of two)
PRIORITY_BYTES = 2 * 8 * 2 * 2


class SumTree:
    """Non-negative priorities of ``size`` leaves, with their sum and their smallest positive value.

    A complete binary tree in an array: node ``k`` has children ``2k`` and ``2k + 1``, the root is node 1,
    and leaf ``i`` is node ``leaves + i`` (``leaves``: ``size`` rounded up to a power of two; the padding
    leaves stay 0). Each inner node holds the sum of its children (and, in a second array, their minimum
    positive value, +inf where there is none).
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a sum tree needs at least one leaf, got size {size}")
        self.size = size
        self.depth = max(0, (size - 1).bit_length())
        self.leaves = 1 << self.depth
        self.sums = np.zeros(2 * self.leaves, dtype=np.float64)
        self.mins = np.full(2 * self.leaves, np.inf, dtype=np.float64)

    def total(self) -> float:
        return float(self.sums[1])

    def min(self) -> float:
        """the smallest positive priority (+inf when every priority is 0)"""
        return float(self.mins[1])

    def get(self, indices: np.ndarray) -> np.ndarray:
        return self.sums[np.asarray(indices, dtype=np.int64) + self.leaves]

    def update(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Set leaves ``indices`` to ``priorities`` (where an index repeats, its last priority wins) and
        recompute their ancestors level by level, each as the exact sum of its two children (no drift)."""
        indices = np.asarray(indices, dtype=np.int64).ravel()
        priorities = np.asarray(priorities, dtype=np.float64).ravel()
        if len(indices) != len(priorities):
            raise ValueError(f"{len(indices)} indices but {len(priorities)} priorities")
        if len(indices) == 0:
            return
        if indices.min() < 0 or indices.max() >= self.size:
            raise IndexError(f"leaf indices must lie in [0, {self.size}), got [{indices.min()}, {indices.max()}]")
        if not (np.isfinite(priorities).all() and (priorities >= 0).all()):
            raise ValueError("priorities must be finite and >= 0")
        reversed_unique, last = np.unique(indices[::-1], return_index=True)
        nodes = reversed_unique + self.leaves
        values = priorities[::-1][last]
        self.sums[nodes] = values
        self.mins[nodes] = np.where(values > 0, values, np.inf)
        for _ in range(self.depth):  # a node listed twice gets the same value twice: no need to deduplicate
            nodes = nodes >> 1
            left, right = 2 * nodes, 2 * nodes + 1
            self.sums[nodes] = self.sums[left] + self.sums[right]
            self.mins[nodes] = np.minimum(self.mins[left], self.mins[right])

    def find(self, values: np.ndarray) -> np.ndarray:
        """For each value in [0, total), the leaf ``i`` with ``sum(p[:i]) <= value < sum(p[:i + 1])``, a
        descent from the root for the whole batch at once. The descent never enters a subtree of sum 0
        (it goes right only where the right child holds some priority), so even a value at or past the
        total through rounding lands on a leaf of positive priority."""
        values = np.array(values, dtype=np.float64).ravel()
        nodes = np.ones(len(values), dtype=np.int64)
        for _ in range(self.depth):
            left = self.sums[2 * nodes]
            go_right = (values >= left) & (self.sums[2 * nodes + 1] > 0)
            values = np.where(go_right, values - left, values)
            nodes = 2 * nodes + go_right
        return nodes - self.leaves


# the uniform buffer's batch plus the importance-sampling weights and where the transitions lie
PrioritizedReplayBatch = NamedTuple(
    "PrioritizedReplayBatch",
    [
        *ReplayBatch.__annotations__.items(),
        ("weights", torch.Tensor),  # float32 (B,) on the device, w_i / max_k w_k, in (0, 1]
        ("indices", np.ndarray),  # int64 (B,), env * capacity + slot: give them back to update_priorities
    ],
)


class PrioritizedReplayBuffer(ReplayBuffer):
    """``ReplayBuffer`` (same storage, same ``add``) sampled in proportion to priorities.

    ``sample(batch_size, beta)`` draws one transition in each of ``batch_size`` equal segments of the
    priorities' total (stratified, as Schaul et al.) and returns the usual fields plus ``weights`` and
    ``indices``; ``update_priorities(indices, errors)`` sets ``p = (|error| + eps) ** alpha``.
    Leaf ``env * capacity + slot`` of the sum tree is slot ``slot`` of environment ``env``'s ring.
    """

    def __init__(
        self,
        buffer_size: int,
        num_envs: int,
        observation_shape: tuple[int, ...] = (4, 84, 84),
        device: torch.device | str = "cpu",
        n_step: int = 1,
        gamma: float = 0.99,
        seed: int | None = None,
        storage_device: torch.device | str | None = None,
        compress: bool = False,
        alpha: float = 0.6,
        eps: float = 1e-6,
    ) -> None:
        if not alpha >= 0:
            raise ValueError(f"alpha {alpha} must be >= 0 (0 samples uniformly)")
        if not eps > 0:
            raise ValueError(f"eps {eps} must be > 0 (so that no transition's priority is 0)")
        super().__init__(
            buffer_size, num_envs, observation_shape, device, n_step, gamma, seed, storage_device, compress
        )
        self.alpha, self.eps = alpha, eps
        self.tree = SumTree(self.num_envs * self.capacity)
        self.max_priority = 1.0  # new transitions get the largest priority seen so far

    SETTINGS = (*ReplayBuffer.SETTINGS, "alpha", "eps")

    def state_dict(self, frames: bool = True) -> dict[str, Any]:
        """``ReplayBuffer.state_dict`` plus the sum tree's sums and minima and the largest priority seen."""
        return {
            **super().state_dict(frames),
            "tree.sums": self.tree.sums.copy(),
            "tree.mins": self.tree.mins.copy(),
            "max_priority": self.max_priority,
        }

    def load_state_dict(self, state: dict[str, Any], frames: bool = True) -> None:
        own = ("tree.sums", "tree.mins", "max_priority")
        missing = [name for name in own if name not in state]
        if missing:
            raise ValueError(f"replay state lacks {missing}: not a prioritized replay memory")
        for name in ("tree.sums", "tree.mins"):
            if np.shape(state[name]) != self.tree.sums.shape:
                raise ValueError(f"replay {name} has shape {np.shape(state[name])}, not {self.tree.sums.shape}")
        super().load_state_dict({k: v for k, v in state.items() if k not in own}, frames)
        self.tree.sums[...] = state["tree.sums"]
        self.tree.mins[...] = state["tree.mins"]
        self.max_priority = float(state["max_priority"])

    def add(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        actions: np.ndarray,
        rewards: np.ndarray,
        dones: np.ndarray,
        ends: np.ndarray,
        mask: np.ndarray | None = None,
    ) -> None:
        start, written = self.cursor.copy(), self.written.copy()
        super().add(obs, next_obs, actions, rewards, dones, ends, mask)
        count = self.written - written
        self._refresh_priorities(np.flatnonzero(count), start, count)  # the rings that were written

    def cut_episodes(self) -> None:
        """As ``ReplayBuffer.cut_episodes``; the transitions whose n-step return the cut completes become
        sampleable."""
        super().cut_episodes()
        self._refresh_priorities(np.arange(self.num_envs), self.cursor.copy(), np.zeros(self.num_envs, np.int64))

    def _refresh_priorities(self, rings: np.ndarray, start: np.ndarray, count: np.ndarray) -> None:
        """After ``count[env]`` slots of each env of ``rings`` were written from ``start[env]`` on, re-derive
        which slots nearby hold a complete transition: the written slots themselves, the ``n_step - 1`` before
        them (whose n-step return may now be complete) and the ``stack`` after them (whose stacks lost a frame).
        A complete one keeps its priority, or gets the largest seen if it is new; every other slot gets 0."""
        cap, back, ahead = self.capacity, self.n_step - 1, self.stack
        envs, slots, new = [], [], []
        for env in rings:
            span = back + count[env] + ahead
            window = np.arange(cap) if span >= cap else (start[env] - back + np.arange(span)) % cap
            envs.append(np.full(len(window), env))
            slots.append(window)
            new.append((window - start[env]) % cap < min(count[env], cap))  # slots written by this add
        if not envs:
            return
        envs, slots, new = np.concatenate(envs), np.concatenate(slots), np.concatenate(new)
        leaves = envs * cap + slots
        old = self.tree.get(leaves)
        current = np.where(new, 0.0, old)  # a rewritten slot's old priority is void
        priorities = np.where(self.complete(envs, slots), np.where(current > 0, current, self.max_priority), 0.0)
        changed = priorities != old
        if changed.any():
            self.tree.update(leaves[changed], priorities[changed])

    def sample(self, batch_size: int, beta: float = 0.4) -> PrioritizedReplayBatch:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta {beta} must be in [0, 1]")
        total = self.tree.total()
        if not total > 0:
            raise ValueError("the replay buffer holds no complete transition to sample yet")
        values = (np.arange(batch_size) + self.rng.random(batch_size)) * (total / batch_size)
        indices = self.tree.find(values)
        weights = (self.tree.min() / self.tree.get(indices)) ** beta
        envs, slots = np.divmod(indices, self.capacity)
        batch = self.gather(envs, slots)
        return PrioritizedReplayBatch(
            **batch._asdict(), weights=self.to_device(weights.astype(np.float32), self.device), indices=indices
        )

    def update_priorities(self, indices: np.ndarray, errors: np.ndarray | torch.Tensor) -> None:
        """``p = (|error| + eps) ** alpha`` for the sampled ``indices``. A transition that has left the buffer
        since it was sampled (its leaf is 0 now) stays out; a non-finite error leaves its transition's priority
        as it was (the scripts' own check of the loss stops the run, or skips the update)."""
        if isinstance(errors, torch.Tensor):
            errors = errors.detach().cpu().numpy()  # with a GPU, a host synchronisation: the tree is in host memory
        errors = np.asarray(errors, dtype=np.float64).ravel()
        indices = np.asarray(indices, dtype=np.int64).ravel()
        if len(errors) != len(indices):
            raise ValueError(f"{len(indices)} indices but {len(errors)} errors")
        keep = np.isfinite(errors) & (self.tree.get(indices) > 0)
        priorities = (np.abs(errors[keep]) + self.eps) ** self.alpha
        self.tree.update(indices[keep], priorities)
        if len(priorities):
            self.max_priority = max(self.max_priority, float(priorities.max()))


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def beta_schedule(beta_0: float, beta_end: float, duration: int, t: int):
    """the importance-sampling exponent, from beta_0 at step 0 linearly to beta_end at step `duration`"""
    return beta_0 + (beta_end - beta_0) * min(1.0, t / duration)


def check_args(args: Args) -> str | None:
    """this script's own flags (the shared ones are checked by the run): what is wrong, or None"""
    if args.n_atoms < 2:
        return f"--n-atoms {args.n_atoms} must be at least 2 (the support's two ends); use e.g. --n-atoms 51"
    if not (np.isfinite(args.v_min) and np.isfinite(args.v_max) and args.v_min < args.v_max):
        return (
            f"--v-min {args.v_min} must be below --v-max {args.v_max}, both finite (the support is "
            "[v-min, v-max]); lower --v-min or raise --v-max, e.g. --v-min -10 --v-max 10"
        )
    if args.n_step < 1:
        return f"--n-step {args.n_step} must be a positive integer (1: one-step returns; Rainbow uses 3)"
    if not (np.isfinite(args.noisy_sigma) and args.noisy_sigma >= 0):
        return f"--noisy-sigma {args.noisy_sigma} must be >= 0 and finite (0: no noise; Rainbow uses 0.5)"
    if not (np.isfinite(args.prioritized_alpha) and args.prioritized_alpha >= 0):
        return f"--prioritized-alpha {args.prioritized_alpha} must be >= 0 (0: uniform sampling; Rainbow uses 0.5)"
    if not 0.0 <= args.prioritized_beta <= 1.0:
        return f"--prioritized-beta {args.prioritized_beta} must be in [0, 1] (annealed to 1; Rainbow starts at 0.4)"
    if not 0.0 <= args.prioritized_beta_end <= 1.0:
        return f"--prioritized-beta-end {args.prioritized_beta_end} must be in [0, 1] (Rainbow: 1; DER: 0.5)"
    if not (np.isfinite(args.prioritized_eps) and args.prioritized_eps > 0):
        return f"--prioritized-eps {args.prioritized_eps} must be > 0 and finite; use e.g. --prioritized-eps 1e-6"
    return None


if __name__ == "__main__":
    args = parse_args(Args)  # tyro.cli(Args): the algorithm's flags, then the run flags
    run = Run(args, __file__, check_args)  # --resume, the checks, device, threads, seeding, signals
    device = run.device

    envs = TrainEnvs(args.env_id, args.num_envs, seed=args.seed, forced_steps=args.forced_steps)
    network_kwargs = dict(n_atoms=args.n_atoms, v_min=args.v_min, v_max=args.v_max, noisy_sigma=args.noisy_sigma)
    network_kwargs.update(dueling=args.dueling, noisy=args.noisy)
    q_network = QNetwork(envs.n_actions, **network_kwargs).to(device)
    target_network = QNetwork(envs.n_actions, **network_kwargs).to(device)
    target_network.load_state_dict(q_network.state_dict())
    run.fast(q_network, target_network)  # --fast: channels-last convolutions on CPU
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate, eps=args.adam_eps, fused=run.fused)
    buffer_kwargs = dict(
        device=device,
        n_step=args.n_step,
        gamma=args.gamma,
        seed=args.seed,
        storage_device=run.buffer_device,
        compress=args.compress_replay,
    )
    if args.prioritized:  # sampled in proportion to (loss + eps) ** alpha
        alpha, eps = args.prioritized_alpha, args.prioritized_eps
        rb = PrioritizedReplayBuffer(args.buffer_size, args.num_envs, **buffer_kwargs, alpha=alpha, eps=eps)
    else:  # --no-prioritized: uniform sampling, still n-step
        rb = ReplayBuffer(args.buffer_size, args.num_envs, **buffer_kwargs)
    rng = np.random.default_rng(args.seed)
    # what the run owns, declared once: a checkpoint saves it and --resume puts it back
    obs, global_step = run.own(
        envs, rb, policy=q_network, q_network=q_network, target_network=target_network, optimizer=optimizer, rng=rng
    )

    metrics = None  # the latest update's metrics (tensors), read every 1000 steps
    while global_step < args.total_timesteps:
        previous_step = global_step
        epsilon = linear_schedule(
            args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step
        )
        with run.timed("acting"):
            if global_step <= run.learning_starts:  # before learning, a new noise draw at every step
                reset_noise(q_network)  # (reset_noise does nothing with --no-noisy)
            actions = rng.integers(0, envs.n_actions, args.num_envs)
            greedy = rng.random(args.num_envs) >= epsilon
            if greedy.any():
                with torch.no_grad():
                    q_values = q_network(torch.as_tensor(obs[greedy], device=device))
                actions[greedy] = q_values.argmax(dim=1).cpu().numpy()
        envs.send(actions)  # the games step in their own threads while the learner updates, below
        global_step += args.num_envs

        if global_step > run.learning_starts:
            # one update per train_frequency agent steps, whatever the number of environments
            for _ in range(global_step // args.train_frequency - previous_step // args.train_frequency):
                with run.timed("learning"):
                    reset_noise(q_network)  # a new noise draw per update, independent for the two networks;
                    reset_noise(target_network)  # acting uses the online one's until the next update
                    if args.prioritized:  # plus importance-sampling weights (beta annealed) and indices
                        beta = beta_schedule(
                            args.prioritized_beta, args.prioritized_beta_end, args.total_timesteps, global_step
                        )
                        data = rb.sample(args.batch_size, beta)
                    else:
                        data = rb.sample(args.batch_size)
                    loss, metrics, priorities = compute_loss(q_network, target_network, data, args)
                    if run.skip(loss):  # --on-nonfinite skip: a non-finite loss is not applied
                        continue
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    if args.prioritized:  # new priorities: each transition's loss (KL plus the target's entropy)
                        rb.update_priorities(data.indices, priorities)
            if global_step // 1000 > previous_step // 1000 and metrics is not None:  # logged beside the loss
                if args.prioritized:
                    metrics["beta"] = beta
                if args.noisy:
                    metrics["noisy_sigma"] = mean_sigma(q_network)

            # update target network
            if global_step // args.target_network_frequency > previous_step // args.target_network_frequency:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters(), strict=True):
                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)

        step = envs.recv()
        # the step after a game ends returns the reset observation: not a transition (mask)
        rb.add(obs, step.next_obs, actions, step.rewards, step.dones, step.ends, step.mask)
        obs = step.next_obs
        if run.step(global_step, obs, step, epsilon, metrics):  # log, evaluate, checkpoint when due; True: stop
            break

    # the final evaluation, the saved model, the closed record (or the stop's message)
    sys.exit(run.finish(**network_kwargs))
