"""Weight publication across two "machines" (network namespaces, see test_multinode.py).

The publisher is on node 0; node 1's subscribers must receive each version's bytes once
(through one relay), counted by the subscribers' own statistics, while node 0's subscriber
reads the publisher's segment and receives nothing over the network.
"""

from __future__ import annotations

import pytest

import aiorl
from aiorl.placement import NodePlacementStrategy
from aiorl.transport.security import ClusterKeys
from tests.deploy.test_multinode import topology  # noqa: F401  (the fixture)
from tests.system.test_weights import SHAPES, Rollout, Trainer, model_bytes

pytestmark = pytest.mark.timeout(180)


def test_each_node_receives_a_version_once(topology, tmp_path):  # noqa: F811
    key_file = str(tmp_path / "cluster.key")
    ClusterKeys.generate().save(key_file)
    registry = f"tcp://{topology.ip('aiorl-reg')}:6391"
    topology.run("aiorl-reg", "-m", "aiorl.registry.service", "--host", topology.ip("aiorl-reg"),
                 "--port", "6391", "--key-file", key_file, "--log-level", "WARNING")
    for rank, ns in enumerate(["aiorl-n0", "aiorl-n1"]):
        topology.run(ns, "-m", "aiorl.node.agent", "--registry", registry, "--host", topology.ip(ns),
                     "--node-rank", str(rank), "--key-file", key_file, "--log-level", "WARNING")
    with aiorl.Cluster(registry=registry, num_nodes=2, key_file=key_file, timeout=60) as cluster:
        pub = Trainer.create_group().launch(cluster, NodePlacementStrategy([0]), name="trainer")
        subs = Rollout.create_group().launch(cluster, NodePlacementStrategy([0, 1, 1, 1]),
                                             name="rollout")
        assert subs.node().wait(90) == [0, 1, 1, 1]
        for version in (1, 2, 3):
            pub.publish("w-machines", version).wait(90)
            assert subs.wait_for("w-machines", version, 60).wait(90) == [version] * 4
            assert subs.pull("w-machines").wait(90) == [(version, [float(version)])] * 4
        stats = subs.stats("w-machines").wait(30)
        assert stats[0]["relayed_bytes"] == 0  # node 0 reads the publisher's segment
        node1 = stats[1:]
        # One relay on node 1 received each version once; the others received nothing.
        assert sorted(s["relayed_versions"] for s in node1) == [0, 0, 3]
        per_version = sum(s["relayed_bytes"] for s in node1) / 3
        assert model_bytes() <= per_version <= model_bytes() + 64 * len(SHAPES)
        assert all(s["pulls"] == 3 and s["torn_retries"] == 0 for s in stats)
