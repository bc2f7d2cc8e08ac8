"""Load balancing by weight: rollouts feed trainers batches of equal token counts.

Rollout workers generate trajectories of varying length and put each into a
channel with ``weight = its length``. Trainer ranks call ``get_batch(budget)``
in turn: each batch holds trajectories, in FIFO order, until their lengths add
up to at least ``budget`` tokens, so every trainer step sees about the same
amount of work however the lengths vary. ``maxsize`` bounds the channel, so fast
rollouts wait (backpressure) instead of piling trajectories up in memory.

Run: ``python examples/load_balancing.py`` (a few seconds on a laptop).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import torch

import aiorl
from aiorl.channels import Channel
from aiorl.placement import NodePlacementStrategy

TOKEN_BUDGET = 4096  # tokens per trainer step
END = "end-of-rollouts"


class Rollout(aiorl.Worker):
    async def generate(self, channel: Channel, n: int) -> int:
        """Put ``n`` trajectories of random length; each put waits while the channel is full."""
        rng = random.Random(self.rank)
        tokens = 0
        for i in range(n):
            length = rng.randint(16, 512)
            trajectory = {
                "rollout": self.rank,
                "index": i,
                "tokens": torch.randint(0, 32_000, (length,)),  # travels as a zero-copy frame
                "rewards": torch.rand(length),
            }
            await channel.put(trajectory, weight=length)
            tokens += length
        return tokens


class Trainer(aiorl.Worker):
    def __init__(self, channel_name: str) -> None:
        super().__init__()
        # By name, from inside a worker. __init__ runs on the method thread, so this
        # blocks until the channel is ready (from an async method it would not block).
        self.channel = self.connect_channel(channel_name)

    async def train(self) -> list[dict[str, Any]]:
        """Take batches of >= TOKEN_BUDGET tokens until the end marker; report each step."""
        steps: list[dict[str, Any]] = []
        while True:
            batch = await self.channel.get_batch(TOKEN_BUDGET)
            done = batch[-1] == END  # the marker is heavy: it always ends a batch
            trajectories = batch[:-1] if done else batch
            if trajectories:
                tokens = sum(len(t["tokens"]) for t in trajectories)
                await asyncio.sleep(tokens / 200_000)  # the "training step": ~20 ms per batch
                steps.append({
                    "trajectories": len(trajectories),
                    "tokens": tokens,
                    "from_rollouts": sorted({t["rollout"] for t in trajectories}),
                    "mean_reward": round(float(torch.cat([t["rewards"] for t in trajectories])
                                               .mean()), 3),
                })
            if done:
                return steps


def main() -> None:
    n_rollouts, n_trainers, per_rollout = 4, 2, 24
    with aiorl.Cluster(num_nodes=1) as cluster:
        channel = Channel.create(cluster, "trajectories", maxsize=32)
        rollouts = Rollout.create_group().launch(
            cluster, NodePlacementStrategy([0] * n_rollouts), name="rollout")
        trainers = Trainer.create_group("trajectories").launch(
            cluster, NodePlacementStrategy([0] * n_trainers), name="trainer")
        trainers.wait_ready()  # both trainers are connected before the first trajectory

        # Waiting getters are served in arrival order, so the trainer ranks take turns.
        training = trainers.train()
        produced = rollouts.generate(channel, per_rollout).wait(120)
        # Every trajectory is in the channel now (puts completed), so markers put after
        # them come out last (FIFO); one heavy marker per trainer closes its last batch.
        for _ in range(n_trainers):
            channel.put(END, weight=TOKEN_BUDGET)

        print(f"{n_rollouts} rollouts produced {sum(produced)} tokens "
              f"in {n_rollouts * per_rollout} trajectories")
        for rank, steps in enumerate(training.wait(120)):
            total = sum(s["tokens"] for s in steps)
            print(f"trainer {rank}: {len(steps)} steps, {total} tokens")
            for i, s in enumerate(steps):
                print(f"  step {i}: {s['trajectories']:3d} trajectories, {s['tokens']:5d} tokens "
                      f"from rollouts {s['from_rollouts']}, mean reward {s['mean_reward']}")
        assert sum(s["tokens"] for steps in training.wait() for s in steps) == sum(produced)
        rollouts.close()
        trainers.close()
        channel.destroy().wait(30)


if __name__ == "__main__":
    main()
