"""The node agent's table of its workers: the same end state whatever order the fork report,
the worker's ready message and its exit arrive in (`aiorl.node.node_workers`)."""

from __future__ import annotations

import itertools

import pytest

from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.node.node_workers import GONE_PIDS_KEPT, NodeWorkers


def _info(name: str, pid: int, endpoint: str) -> WorkerInfo:
    address = WorkerAddress.from_name(name)
    return WorkerInfo(address=address, rank=address.rank_path[-1], group_world_size=2,
                      node_rank=0, node_ip="127.0.0.1", endpoint=endpoint, pid=pid)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("order", list(itertools.permutations(["forked", "ready"])))
def test_ready_before_or_after_the_fork_report_makes_the_worker_known(order: tuple[str, ...]) -> None:
    table = NodeWorkers()
    heard: list[str] = []
    table.on_ready(lambda info: heard.append(info.endpoint))
    table.expect(1, "g:0", "g", "/log")
    table.expect(2, "g:1", "g", "/log")
    assert table.pending() and table.serves("g:0", "ipc:///a") is None
    for step in order:
        if step == "forked":
            table.forked(1, 100)
        else:
            assert table.ready(_info("g:0", 100, "ipc:///a")) is not None
    assert table.is_local("ipc:///a") and table.serves("g:0", "ipc:///a") is True
    assert table.serves("g:0", "ipc:///other") is False and heard == ["ipc:///a"]
    assert table.status() == {"spawning": 1, "forked": 0, "ready": 1}
    assert table.pending()  # g:1 has not said where it listens
    table.forked(2, 101)
    table.ready(_info("g:1", 101, "ipc:///b"))
    assert not table.pending() and table.by_pid(101) is not None
    assert [r.name for r in table.running()] == ["g:0", "g:1"]
    assert table.exited(100) is not None and table.exited(101) is not None
    assert not table.is_local("ipc:///a") and len(table) == 0 and table.groups() == set()
    assert table.exited_at("ipc:///a") and not table.exited_at("ipc:///never")


@pytest.mark.timeout(10)
def test_a_ready_message_after_its_processs_exit_changes_nothing() -> None:
    table = NodeWorkers()
    table.expect(1, "g:0", "g", "/log")
    table.forked(1, 100)
    table.exited(100)
    # The restart's record is waiting for its own ready: the dead process's late message
    # must not make its old address look served.
    table.expect(2, "g:0", "g", "/log", incarnation=1)
    assert table.ready(_info("g:0", 100, "ipc:///old")) is None
    assert not table.is_local("ipc:///old") and table.serves("g:0", "ipc:///old") is None
    table.forked(2, 200)
    assert table.ready(_info("g:0", 200, "ipc:///new")) is not None
    assert table.serves("g:0", "ipc:///new") is True


@pytest.mark.timeout(10)
def test_a_worker_under_a_profiler_is_found_by_name_newest_incarnation_first() -> None:
    table = NodeWorkers()
    table.expect(1, "g:0", "g", "/log")
    table.forked(1, 100)
    table.expect(2, "g:0", "g", "/log", incarnation=1)
    table.forked(2, 200)
    record = table.ready(_info("g:0", 201, "ipc:///profiled"))  # the profiler's child's pid
    assert record is not None and record.incarnation == 1
    assert table.ready(_info("g:9", 300, "ipc:///x")) is None  # nobody of that name here


@pytest.mark.timeout(10)
def test_a_failed_fork_leaves_nothing_pending_and_gone_pids_stay_bounded() -> None:
    table = NodeWorkers()
    table.expect(1, "g:0", "g", "/log")
    table.fork_failed(1)
    assert not table.pending() and len(table) == 0
    assert table.forked(1, 5) is None  # a report for a spawn the table no longer expects
    for pid in range(GONE_PIDS_KEPT + 10):
        table.exited(pid)
    assert len(table._gone_pids) == GONE_PIDS_KEPT
