"""A driver for ``aiorl slurm``: one group across the whole allocation, called once.

Run by ``examples/slurm/train.sbatch`` (``sbatch train.sbatch`` from this directory). Under
``aiorl slurm`` the cluster is already up: ``aiorl.Cluster()`` finds it through
``AIORL_REGISTRY`` and ``AIORL_KEY_FILE``, which the launcher sets, and every node of the
allocation has joined before this program starts.
"""

from __future__ import annotations

import os
import socket

import aiorl


class Where(aiorl.Worker):
    def where(self) -> dict[str, object]:
        """Which node and GPUs this rank runs on."""
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "node": self.worker_info.node_rank,
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "-")}

    def add(self, x: int) -> int:
        return x + self.rank


def main() -> None:
    if not os.environ.get("AIORL_REGISTRY"):
        raise SystemExit("run me with `aiorl slurm -- python train.py` (see train.sbatch)")
    with aiorl.Cluster() as cluster:
        # One rank per GPU of the allocation; without GPUs, two CPU ranks per node.
        if cluster.num_accelerators:
            group = Where.create_group().launch(cluster, name="where")
        else:
            group = Where.create_group().launch(cluster, num_workers=2 * cluster.num_nodes,
                                                name="where")
        for answer in group.where().wait(300):
            print("rank {rank} on {host} (node {node}) pid {pid} gpus {gpus}".format(**answer))
        total = sum(group.add(1).wait(60))
        print(f"{len(group.ranks)} ranks on {cluster.num_nodes} node(s) answered; sum {total}")
        group.close()


if __name__ == "__main__":
    main()
