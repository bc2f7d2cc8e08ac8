"""A weight name's directory dies: publishing goes on, subscribers follow the restarted one.

The directory (the one-rank group ``weights.<name>``) is soft state under
``restart="on_failure"``: these tests SIGKILL its process between publishes, with a
subscriber on the publisher's node and one on another node (its node's relay), and check
that every publish returns without waiting for the directory, that the subscribers get
each next version complete (every tensor holds its version number), and that their
versions never go backwards. A directory that does not come back fails ``wait_for``
within the bound, while pulls keep returning the last version.
"""

from __future__ import annotations

import time

import pytest

import aiorl
from aiorl.placement import NodePlacementStrategy
from aiorl.weights import host_directory
from aiorl.weights.publisher import ANNOUNCE_WAIT_S
from tests.system.test_weights import Rollout, Trainer

pytestmark = pytest.mark.timeout(180)


class Subscriber(Rollout):
    def shorten_directory_patience(self, seconds: float) -> None:
        """How long this process waits for a dead directory to come back (60 s by default)."""
        import aiorl.weights.service as service

        service.DIRECTORY_RESTART_S = seconds


@pytest.fixture(scope="module")
def cluster2():
    with aiorl.Cluster(num_nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def trainer(cluster2):
    return Trainer.create_group().launch(cluster2, NodePlacementStrategy([0]), name="trainer")


@pytest.fixture(scope="module")
def readers(cluster2):
    """Rank 0 on the publisher's node (shared memory), rank 1 on node 1 (its node's relay)."""
    return Subscriber.create_group().launch(cluster2, NodePlacementStrategy([0, 1]),
                                            name="reader")


def directory_pid(cluster: aiorl.Cluster, name: str) -> int:
    runtime = cluster.runtime
    record = runtime.run_sync(runtime.registry.lookup(f"weights.{name}:0"), timeout=10)
    return int(record.info.pid)


def kill(pid: int) -> None:
    import os
    import signal

    os.kill(pid, signal.SIGKILL)


def publish_quickly(trainer, name: str, version: int) -> None:
    """Publish ``version``; it must not wait for a directory that is down (the announce
    waits at most ANNOUNCE_WAIT_S; the rest is the copy and the call)."""
    start = time.monotonic()
    assert trainer.publish(name, version).wait(30) == [version]
    assert time.monotonic() - start < ANNOUNCE_WAIT_S + 3.0


def test_directory_killed_between_publishes_publishing_goes_on_and_subscribers_follow(
        cluster2, trainer, readers):
    name = "w-dir-killed"
    trainer.publish(name, 1).wait(60)
    assert readers.wait_for(name, 1).wait(60) == [1, 1]
    assert readers.pull(name).wait(60) == [(1, [1.0])] * 2
    seen = [1, 1]
    version = 1
    for _ in range(3):
        pid = directory_pid(cluster2, name)
        kill(pid)
        version += 1
        publish_quickly(trainer, name, version)  # the directory is down or restarting
        assert readers.wait_for(name, version, 60).wait(90) == [version, version]
        pulled = readers.pull(name).wait(60)
        assert pulled == [(version, [float(version)])] * 2  # complete, and this version
        assert all(v >= s for (v, _), s in zip(pulled, seen, strict=True))
        seen = [v for v, _ in pulled]
        assert directory_pid(cluster2, name) != pid  # a new incarnation answered
    # Publishing keeps reaching the subscribers through the restarted directory.
    version += 1
    publish_quickly(trainer, name, version)
    assert readers.wait_for(name, version, 60).wait(90) == [version, version]
    assert readers.pull(name).wait(60) == [(version, [float(version)])] * 2


def test_a_directory_that_does_not_come_back_fails_wait_for_within_the_bound(
        cluster2, trainer, readers):
    name = "w-dir-gone"
    directory = host_directory(cluster2, name)  # supervised by the driver, which closes it
    trainer.publish(name, 1).wait(60)
    assert readers.wait_for(name, 1).wait(60) == [1, 1]
    assert readers.pull(name).wait(60) == [(1, [1.0])] * 2
    readers.shorten_directory_patience(2.0).wait(10)
    directory.close()
    publish_quickly(trainer, name, 2)  # nobody to tell: written, announced to nobody
    start = time.monotonic()
    with pytest.raises(aiorl.RemoteError) as lost:
        readers.execute_on(0).wait_for(name, 2, 60).wait(60)
    assert lost.value.exc_type.endswith("PeerLostError")
    assert "did not come back" in str(lost.value)
    assert time.monotonic() - start < 15
    # Pulls keep returning the last version the subscribers knew, complete.
    assert readers.pull(name).wait(60) == [(1, [1.0])] * 2


# ---------------------------------------------------------------- a publisher replaced
def test_a_name_reused_by_a_new_publisher_never_goes_back(cluster2) -> None:
    """A group publishes "reused" up to version 5 and closes; a new group's subscriber waits
    (it never gets the gone publisher's segment as an OSError); the new group's publisher
    may not count from 1 again (versions of a name never go back: a ValueError naming the
    floor), and its version 6 is what the subscriber pulls, whole."""
    name = "reused"
    first = Trainer.create_group().launch(cluster2, NodePlacementStrategy([0]), name="first-pub")
    try:
        for version in range(1, 6):
            assert first.publish(name, version).wait(60) == [version]
    finally:
        first.close()
    second = Trainer.create_group().launch(cluster2, NodePlacementStrategy([0]),
                                           name="second-pub")
    fresh = Rollout.create_group().launch(cluster2, NodePlacementStrategy([0]),
                                          name="fresh-sub")
    try:
        fresh.wait_ready(120)
        pending = fresh.pull(name)  # no readable source: it waits (no ShmUnavailable)
        with pytest.raises(aiorl.RemoteError, match=r"version 1 of weights 'reused' is not "
                           r"newer than version 5, which an earlier publisher .* never go "
                           r"back") as refused:
            second.publish(name, 1).wait(60)
        assert isinstance(refused.value, ValueError)
        assert not pending.done()
        assert second.publish(name, 6).wait(60) == [6]
        assert pending.wait(60) == [(6, [6.0])]
        assert fresh.latest(name).wait(30) == [6]
    finally:
        second.close()
        fresh.close()
