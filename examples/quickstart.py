"""A first aiorl program: a group of workers on the embedded cluster.

Run: ``python examples/quickstart.py``
"""

from __future__ import annotations

import asyncio
import os

import torch

import aiorl


class Rollout(aiorl.Worker):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(self.rank)
        self.policy = torch.nn.Linear(hidden, 1)

    async def generate(self, n: int) -> float:
        """Runs on the worker's event loop; many such calls may run at once."""
        with torch.no_grad():
            return float(self.policy(torch.randn(n, self.policy.in_features)).mean())

    def where(self) -> str:
        """A plain method: runs on the worker's method thread, one call at a time."""
        return f"{self.worker_name} pid={os.getpid()} node={self.worker_info.node_rank}"


def main() -> None:
    with aiorl.Cluster(num_nodes=1, accelerators_per_node=4) as cluster:
        group = Rollout.create_group(16).launch(cluster, name="rollout")  # one per accelerator
        for line in group.where().wait(60):
            print(line)
        print("means:", [round(x, 3) for x in group.generate(8).wait()])
        print("ranks 0 and 3:", group.execute_on(0, 3).generate(4).wait())

        async def concurrent() -> list[list[float]]:
            # Group methods are looked up at run time, so mypy cannot see their result type.
            results: list[list[float]] = await asyncio.gather(
                *(group.generate(2) for _ in range(10)))
            return results

        print("10 concurrent fan-out calls:", len(asyncio.run(concurrent())), "results")
        group.close()


if __name__ == "__main__":
    main()
