"""A trainer + rollout pipeline: the program docs/tutorial.md builds step by step.

The task is a toy contextual bandit: a context is 4 random numbers, and the right action is
``1`` when the first one is positive. Every part of aiorl a real RL pipeline uses appears once:

* groups and calls: ``rollout``, ``reward``, ``trainer`` and ``evaluator`` groups, driven by
  fan-out calls from the driver;
* a worker calling another group: rollouts ask the ``reward`` group to score their actions;
* a channel: rollouts put trajectories (weight = their length), the trainer takes batches of a
  fixed total weight, and ``maxsize`` holds rollouts back when the trainer falls behind;
* weights: the trainer publishes each new version, rollouts pull the newest before each round;
* point-to-point: the trainer hands the final model to the evaluator with ``send``/``recv``.

Run: ``python examples/pipeline.py`` (embedded, one machine), ``--nodes 2`` for two embedded
node agents, or ``AIORL_REGISTRY=tcp://head:6380 AIORL_KEY_FILE=... python
examples/pipeline.py --nodes 2`` on a real two-machine cluster (docs/deploy.md).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import aiorl
from aiorl.placement import NodePlacementStrategy

CONTEXT = 4
PER_ROUND = 32  # trajectories' length: contexts a rollout plays per round


def make_policy() -> torch.nn.Module:
    torch.manual_seed(0)  # every process starts from the same weights
    return torch.nn.Linear(CONTEXT, 2)


class Reward(aiorl.Worker):
    """Scores actions: 1 for the right one. Stands for a reward model on its own GPUs."""

    def score(self, contexts: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (actions == (contexts[:, 0] > 0).long()).float()


class Rollout(aiorl.Worker):
    def __init__(self, channel_name: str) -> None:
        super().__init__()
        self.policy = make_policy()
        torch.manual_seed(1 + self.rank)  # each rollout plays its own contexts
        self.channel = self.connect_channel(channel_name)  # __init__ may wait; it runs once
        self.reward = self.group("reward")  # another group, called from this worker
        self.weights = self.weight_subscriber("policy")

    async def generate(self, rounds: int) -> list[float]:
        """Play ``rounds`` rounds; before each, pull the newest weights (at most one behind)."""
        mean_rewards = []
        for k in range(rounds):
            await self.weights.wait_for(max(0, k - 1))
            await self.weights.pull(into=self.policy.state_dict())
            contexts = torch.randn(PER_ROUND, CONTEXT)
            with torch.no_grad():
                actions = torch.multinomial(torch.softmax(self.policy(contexts), -1), 1).squeeze(1)
            scored = await self.reward.execute_on(self.rank % self.reward.world_size).score(
                contexts, actions)
            rewards = scored[0]
            await self.channel.put({"contexts": contexts, "actions": actions,
                                    "rewards": rewards}, weight=PER_ROUND)
            mean_rewards.append(round(float(rewards.mean()), 3))
        return mean_rewards


class Trainer(aiorl.Worker):
    def __init__(self, channel_name: str) -> None:
        super().__init__()
        self.policy = make_policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=0.1)
        self.channel = self.connect_channel(channel_name)
        self.weights = self.weight_publisher("policy")

    async def train(self, steps: int, batch_weight: int) -> list[float]:
        """Publish version 0, then per step: a batch of ``batch_weight`` contexts, one
        REINFORCE update, the next version published."""
        await self.weights.publish(self.policy.state_dict(), version=0)
        losses = []
        for step in range(1, steps + 1):
            batch = await self.channel.get_batch(batch_weight)
            contexts = torch.cat([t["contexts"] for t in batch])
            actions = torch.cat([t["actions"] for t in batch])
            rewards = torch.cat([t["rewards"] for t in batch])
            logp = torch.log_softmax(self.policy(contexts), -1).gather(1, actions[:, None])
            loss = -((rewards - rewards.mean()) * logp.squeeze(1)).mean()
            self.optimizer.zero_grad()
            torch.autograd.backward(loss)
            self.optimizer.step()
            await self.weights.publish(self.policy.state_dict(), version=step)
            losses.append(round(loss.item(), 4))
        return losses

    async def hand_over(self) -> None:
        """Send the trained weights to the evaluator, worker to worker."""
        await self.send(self.policy.state_dict(), "evaluator", 0)


class Evaluator(aiorl.Worker):
    async def evaluate(self, n: int) -> float:
        """Receive the trainer's model and measure how often it picks the right action."""
        policy = make_policy()
        policy.load_state_dict(await self.recv("trainer", 0))
        contexts = torch.randn(n, CONTEXT)
        with torch.no_grad():
            actions = policy(contexts).argmax(-1)
        return float((actions == (contexts[:, 0] > 0).long()).float().mean())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)

    with aiorl.Cluster(num_nodes=args.nodes) as cluster:
        channel = aiorl.Channel.create(cluster, "trajectories", maxsize=2 * args.rollouts)
        reward = Reward.create_group().launch(cluster, num_workers=1, name="reward")
        # CPU workers spread over the nodes in blocks; the trainer and evaluator stay on node 0.
        rollouts = Rollout.create_group("trajectories").launch(
            cluster, num_workers=args.rollouts, name="rollout")
        trainer = Trainer.create_group("trajectories").launch(
            cluster, NodePlacementStrategy([0]), name="trainer")
        evaluator = Evaluator.create_group().launch(cluster, num_workers=1, name="evaluator")

        training = trainer.train(args.rounds, args.rollouts * PER_ROUND)
        playing = rollouts.generate(args.rounds)
        losses = training.wait(300)[0]
        rewards = playing.wait(300)
        accuracy = evaluator.evaluate(1000)
        trainer.hand_over().wait(60)
        result = {"losses": losses, "rollout mean rewards": rewards,
                  "accuracy": accuracy.wait(60)[0]}
        for key, value in result.items():
            print(f"{key}: {value}")
        for group in (rollouts, trainer, evaluator, reward):
            group.close()
        channel.destroy().wait(30)
        return result


if __name__ == "__main__":
    main()
