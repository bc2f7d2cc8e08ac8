"""The demo's reinforcement-learning problem, all in torch: CartPole, a policy, REINFORCE.

Kept deliberately small so that the demo runs in seconds on two CPU cores while still
doing real work: episodes of varying length (the pole falls after a handful of steps at
first, later after more), a real policy-gradient update with ``torch.optim.Adam``, and
weights that change every step.

This module imports torch at the top: it is used only inside worker processes, which
fork from a zygote that has torch preloaded. The driver never imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "OBS_DIM",
    "NUM_ACTIONS",
    "CartPole",
    "BatchStats",
    "make_policy",
    "reinforce_loss",
    "rollout_episode",
    "trajectory_nbytes",
]

OBS_DIM = 4
NUM_ACTIONS = 2


class CartPole:
    """The classic cart-pole balancing task (Barto, Sutton & Anderson 1983) on a torch tensor.

    State ``[x, x_dot, theta, theta_dot]``; action 0 pushes left, 1 pushes right; reward 1
    per step; the episode ends when the pole leans more than 12 degrees or the cart leaves
    the track (|x| > 2.4). Same constants as Gym's ``CartPole-v1``, no gym dependency.
    """

    GRAVITY = 9.8
    MASS_CART = 1.0
    MASS_POLE = 0.1
    TOTAL_MASS = MASS_CART + MASS_POLE
    HALF_LENGTH = 0.5
    POLE_MASS_LENGTH = MASS_POLE * HALF_LENGTH
    FORCE = 10.0
    TAU = 0.02
    THETA_LIMIT = 12 * 2 * math.pi / 360
    X_LIMIT = 2.4

    def __init__(self, generator: torch.Generator) -> None:
        self._gen = generator
        self.state = torch.zeros(OBS_DIM)

    def reset(self) -> torch.Tensor:
        """A new episode: every state variable uniform in [-0.05, 0.05]."""
        self.state = (torch.rand(OBS_DIM, generator=self._gen) - 0.5) * 0.1
        return self.state

    def step(self, action: int) -> tuple[torch.Tensor, bool]:
        """Apply ``action``; return the new state and whether the episode has ended."""
        x, x_dot, theta, theta_dot = self.state.unbind()
        force = self.FORCE if action == 1 else -self.FORCE
        cos, sin = torch.cos(theta), torch.sin(theta)
        temp = (force + self.POLE_MASS_LENGTH * theta_dot * theta_dot * sin) / self.TOTAL_MASS
        theta_acc = (self.GRAVITY * sin - cos * temp) / (
            self.HALF_LENGTH * (4.0 / 3.0 - self.MASS_POLE * cos * cos / self.TOTAL_MASS))
        x_acc = temp - self.POLE_MASS_LENGTH * theta_acc * cos / self.TOTAL_MASS
        # Explicit Euler, as in the reference implementation.
        self.state = torch.stack([x + self.TAU * x_dot, x_dot + self.TAU * x_acc,
                                  theta + self.TAU * theta_dot, theta_dot + self.TAU * theta_acc])
        done = bool(self.state[0].abs() > self.X_LIMIT) or bool(
            self.state[2].abs() > self.THETA_LIMIT)
        return self.state, done


def make_policy(hidden: int, seed: int) -> nn.Module:
    """An MLP from the 4 observations to 2 action logits, initialised from ``seed``.

    Every worker builds it from the same seed, so all start from identical weights
    (version 0) without a first broadcast.
    """
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return nn.Sequential(
            nn.Linear(OBS_DIM, hidden), nn.Tanh(),
            nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, NUM_ACTIONS),
        )
    finally:
        torch.random.set_rng_state(gen_state)


@torch.inference_mode()
def rollout_episode(policy: nn.Module, env: CartPole, max_len: int,
                    generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Play one episode (at most ``max_len`` steps) with actions sampled from ``policy``.

    Returns contiguous CPU tensors ``obs`` (T x 4, float32), ``actions`` (T, int64) and
    ``rewards`` (T, float32), T being the episode's length.
    """
    obs = torch.empty(max_len, OBS_DIM)
    actions = torch.empty(max_len, dtype=torch.int64)
    state = env.reset()
    length = 0
    for t in range(max_len):
        obs[t] = state
        probs = torch.softmax(policy(state), dim=-1)
        action = int(torch.multinomial(probs, 1, generator=generator))
        actions[t] = action
        state, done = env.step(action)
        length = t + 1
        if done:
            break
    return {
        "obs": obs[:length].clone(),
        "actions": actions[:length].clone(),
        "rewards": torch.ones(length),
    }


def trajectory_nbytes(traj: dict[str, Any]) -> int:
    """Bytes of tensor data in one trajectory (what travels through the channel)."""
    return sum(v.numel() * v.element_size() for v in traj.values() if isinstance(v, torch.Tensor))


@dataclass(frozen=True)
class BatchStats:
    """What one trainer saw in one batch."""

    loss: float
    trajectories: int
    env_steps: int
    mean_length: float
    mean_staleness: float  # weight versions between the generating policy and the trainer's
    nbytes: int


def reinforce_loss(policy: nn.Module, batch: list[dict[str, Any]], gamma: float,
                   version: int) -> tuple[torch.Tensor, BatchStats]:
    """The REINFORCE policy-gradient loss of a batch of trajectories.

    Advantages are the discounted returns-to-go, normalised over the batch (the batch
    mean is the baseline). Minimising the loss raises the log-probability of actions
    followed by longer-than-average survival.
    """
    returns = []
    for traj in batch:
        acc = 0.0
        rtg = []
        for r in reversed(traj["rewards"].tolist()):
            acc = r + gamma * acc
            rtg.append(acc)
        rtg.reverse()
        returns.append(torch.tensor(rtg))
    adv = torch.cat(returns)
    adv = (adv - adv.mean()) / (adv.std(unbiased=False) + 1e-6)
    obs = torch.cat([t["obs"] for t in batch])
    actions = torch.cat([t["actions"] for t in batch])
    logp = torch.log_softmax(policy(obs), dim=-1).gather(1, actions[:, None]).squeeze(1)
    loss = -(logp * adv).mean()
    lengths = [int(t["obs"].shape[0]) for t in batch]
    stats = BatchStats(
        loss=float(loss.detach()),
        trajectories=len(batch),
        env_steps=sum(lengths),
        mean_length=sum(lengths) / len(lengths),
        mean_staleness=sum(version - int(t["version"]) for t in batch) / len(batch),
        nbytes=sum(trajectory_nbytes(t) for t in batch),
    )
    return loss, stats
