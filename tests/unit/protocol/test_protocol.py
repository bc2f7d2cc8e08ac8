"""The typed control plane (aiorl.protocol) and the name grammar, without processes.

Every registry op has a schema, a service handler and a client method; every message
survives a round trip; every malformed field is refused with a ProtocolError that
names it.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

from aiorl.errors import ProtocolError
from aiorl.names import WorkerAddress, WorkerInfo, check_group_name
from aiorl.protocol.ops import RegistryOp, WorkerState
from aiorl.protocol.registry import (
    SCHEMA,
    DriverInfo,
    GroupRecord,
    GroupSpec,
    NodeInfo,
    NodeRegistration,
    StatusReport,
    WatchRequest,
    WatchSnapshot,
    WorkerChanged,
    WorkerExit,
    WorkerRecord,
    WorkerStateReport,
)
from aiorl.protocol.spawn import HostNode, SpawnRequest, WorkerLaunch, WorkerSpawn
from aiorl.registry.client import RegistryClient
from aiorl.registry.service import RegistryService
from aiorl.transport.endpoint import Endpoint
from tests._paths import REPO_ROOT

pytestmark = pytest.mark.timeout(30)

#: The client method that sends each op (the test fails when an op has none).
CLIENT_METHODS = {
    RegistryOp.REGISTER_NODE: "register_node",
    RegistryOp.UNREGISTER_NODE: "unregister_node",
    RegistryOp.REGISTER_DRIVER: "register_driver",
    RegistryOp.UNREGISTER_DRIVER: "unregister_driver",
    RegistryOp.HEARTBEAT: "heartbeat",
    RegistryOp.CREATE_GROUP: "create_group",
    RegistryOp.CLOSE_GROUP: "close_group",
    RegistryOp.WORKER_STATE: "report_state",
    RegistryOp.WORKER_EXITED: "report_exit",
    RegistryOp.LOOKUP: "lookup",
    RegistryOp.LOOKUP_GROUP: "lookup_group",
    RegistryOp.WATCH: "watch",
    RegistryOp.UNWATCH: "unwatch",
    RegistryOp.NODES: "nodes",
    RegistryOp.STATUS: "status",
    RegistryOp.PING: "ping",
}

HOSTILE_NAMES = ["*", "a\x00b", "../../x", "@nodes", "", "a/b", "..", ".hidden", "-flag",
                 "a:b", "x" * 129, "a b", "caf\u00e9", "a..b", 5, None]


def _info(name: str = "g:0", pid: int = 42) -> WorkerInfo:
    return WorkerInfo(WorkerAddress.from_name(name), WorkerAddress.from_name(name).rank, 2, 0,
                      "127.0.0.1", "tcp://127.0.0.1:5555", pid=pid, node_id="n1")


def test_every_registry_op_has_a_schema_a_service_handler_and_a_client_method():
    assert set(SCHEMA) == set(RegistryOp)
    assert set(CLIENT_METHODS) == set(RegistryOp)
    for op, method in CLIENT_METHODS.items():
        assert inspect.iscoroutinefunction(getattr(RegistryClient, method)), op

    async def handlers() -> set[RegistryOp]:
        endpoint = Endpoint("protocol-test", host="127.0.0.1", keys=None)
        service = RegistryService(endpoint)
        try:
            return set(service.handlers)
        finally:
            service.close()

    assert asyncio.run(handlers()) == set(RegistryOp)


def test_ops_and_states_keep_the_wire_strings():
    assert RegistryOp.WORKER_EXITED == "worker_exited" and str(RegistryOp.PING) == "ping"
    assert [s.value for s in WorkerState] == ["starting", "ready", "failed", "dead"]
    assert WorkerState.DEAD.is_final and not WorkerState.READY.is_final


@pytest.mark.parametrize("message", [
    NodeRegistration(NodeInfo("n1", "tcp://127.0.0.1:1", 0, "127.0.0.1", "h", 4, 1, "cuda",
                              {"robot": 2}, {"zone": "a"}, 7),
                     (GroupSpec("g", 2, "driver-1", "m.W", restore=True),)),
    GroupSpec("rollout-1.v2", 8, "driver-1", "m.W"),
    DriverInfo("driver-1", 12, "host", "tcp://127.0.0.1:9"),
    WorkerStateReport(_info(), WorkerState.FAILED, {"type": "E", "nested": {"a": [1, 2.5]}}),
    WorkerExit("g:1", 99, -9, 9, "last words", "killed"),
    WorkerRecord(_info(), WorkerState.READY),
    GroupRecord(2, "m.W", "driver-1", {"g:0": WorkerRecord(_info(), WorkerState.READY)}),
    WatchSnapshot({"g:0": WorkerRecord(_info(), WorkerState.READY)}, ()),
    WorkerChanged(WorkerRecord(_info("g:3:1"), WorkerState.DEAD, {"reason": "gone"})),
    StatusReport(1.5, (), (), (WorkerRecord(_info(), WorkerState.READY),), ()),
    SpawnRequest("g", "driver-1", 2, (WorkerLaunch(1, {"A": "1"}, (0,), ("0",), ("/x",)),),
                 "m.W", "tcp://127.0.0.1:3"),
])
def test_messages_round_trip(message):
    assert type(message).from_wire(message.to_wire()) == message


@pytest.mark.parametrize("meta, field", [
    ({"address": 5, "pid": 1}, "address"),
    ({"address": b"g:0", "pid": 1}, "address"),
    ({"address": "g", "pid": 1}, "address"),  # a group, not a worker
    ({"address": "g:01", "pid": 1}, "address"),  # not canonical
    ({"address": "g:0", "pid": "1"}, "pid"),
    ({"address": "g:0", "pid": -1}, "pid"),
    ({"address": "g:0", "pid": 1, "signal": 1000}, "signal"),
    ({"address": "g:0", "pid": 1, "stderr_tail": "x" * (300 * 1024)}, "stderr_tail"),
    ({"address": "g:0"}, "pid"),
])
def test_malformed_worker_exited_names_the_field(meta, field):
    with pytest.raises(ProtocolError, match=field):
        WorkerExit.from_wire(meta)


def test_malformed_nested_fields_are_named():
    good = WorkerStateReport(_info(), WorkerState.READY).to_wire()
    for path, value in [("address", 5), ("rank", True), ("endpoint", "http://x"),
                        ("node_rank", -2), ("available_accelerators", ["0"])]:
        bad = {**good, "info": {**good["info"], path: value}}
        with pytest.raises(ProtocolError, match=f"info.{path}"):
            WorkerStateReport.from_wire(bad)
    with pytest.raises(ProtocolError, match="state"):
        WorkerStateReport.from_wire({**good, "state": "dead"})  # only an agent reports deaths
    with pytest.raises(ProtocolError, match="detail"):
        WorkerStateReport.from_wire({**good, "detail": {"x": object()}})
    for meta in (None, 5, [], b"x", "heartbeat"):
        with pytest.raises(ProtocolError):
            GroupSpec.from_wire(meta)


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_group_names_are_refused_everywhere(name):
    with pytest.raises(ValueError):
        check_group_name(name)
    with pytest.raises(ValueError):
        WorkerAddress(name)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="group"):
        GroupSpec.from_wire({"group": name, "world_size": 1, "owner": "d"})
    launch = WorkerLaunch(0).to_wire()
    with pytest.raises(ProtocolError, match="group"):
        SpawnRequest.from_wire({"group": name, "owner": "d", "world_size": 1, "workers": [launch]})


def test_good_names_and_watch_patterns():
    for name in ("g", "Rollout_2", "a.b-c", "_x", "0", "x" * 128, "channel.queue-1"):
        assert check_group_name(name) == name
    for pattern in ("*", "@nodes", "g", "g:0", "g:0:1"):
        assert WatchRequest.from_wire({"name": pattern}).name == pattern
    for pattern in ("@other", "g:", "g: 1", "g:+1", "*x", ""):
        with pytest.raises(ProtocolError):
            WatchRequest.from_wire({"name": pattern})
    for name in ("g: 1", "g:+1", "g:1_0", "g:x"):
        with pytest.raises(ValueError):
            WorkerAddress.from_name(name)


def test_spawn_request_checks_ranks_and_environment():
    launch = WorkerLaunch(2).to_wire()
    with pytest.raises(ProtocolError, match="workers"):
        SpawnRequest.from_wire({"group": "g", "owner": "d", "world_size": 2, "workers": [launch]})
    bad_env = {**WorkerLaunch(0).to_wire(), "env": {"A": "x\x00y"}}
    with pytest.raises(ProtocolError, match="env"):
        SpawnRequest.from_wire({"group": "g", "owner": "d", "world_size": 1, "workers": [bad_env]})


def test_worker_spawn_builds_the_worker_info():
    spawn = WorkerSpawn(WorkerLaunch(1, visible_accelerators=("3",), hardware_ranks=(5,)), "g",
                        4, b"", "tcp://127.0.0.1:1",
                        HostNode("n1", 2, "10.0.0.1", "h", "cuda", "tcp://10.0.0.1:7"), "/tmp/x")
    info = spawn.worker_info("tcp://10.0.0.1:8", pid=77)
    assert (info.name, info.group_world_size, info.node_rank, info.pid) == ("g:1", 4, 2, 77)
    assert info.available_accelerators == [3] and info.hardware_ranks == [5]
    request = SpawnRequest("g", "driver-1", 4, (spawn.launch,), "m.W")
    assert request.group_spec() == GroupSpec("g", 4, "driver-1", "m.W", restore=True)


def test_no_operation_string_outside_the_protocol_and_the_registry():
    """Ops are named through the enums of aiorl.protocol.ops everywhere else (issue 11):
    a call, handler or event registration with a literal op string fails this test."""
    import re

    from aiorl.protocol.ops import AgentOp, DriverOp, RegistryEvent, WorkerOp

    ops = {o.value for e in (RegistryOp, RegistryEvent, AgentOp, WorkerOp, DriverOp) for o in e}
    call = re.compile(r"\b(request|send_oneway|handle|on_event|push_event)\(")
    literal = re.compile(r'"([a-z_@]+)"')
    package = REPO_ROOT / "aiorl"
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in ("protocol", "registry"):
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            match = call.search(line)
            if match is None:
                continue
            window = " ".join(lines[i:i + 2])[match.start():]  # the op may be on the next line
            if any(op in ops for op in literal.findall(window)):
                found.append(f"{path.relative_to(package)}:{i + 1}: {line.strip()}")
    assert not found, "literal op strings:\n" + "\n".join(found)
