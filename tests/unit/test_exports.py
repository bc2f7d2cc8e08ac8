"""The public surface is pinned: a name added to or dropped from a facade is a visible change."""

from __future__ import annotations

import importlib

import pytest

import aiorl

pytestmark = pytest.mark.timeout(60)

TOP_LEVEL = [
    "AddressError", "AiorlError", "AsyncChannelWork", "AsyncCollWork", "AsyncFuncWork",
    "AsyncWork", "AuthenticationError", "Channel", "Cluster", "ClusterClosedError", "ConflictError", "ConnectionLostError", "EventKind", "GroupEvent",
    "GroupExistsError", "GroupNotFoundError", "MappingThread", "NodeRankTakenError", "NotFoundError", "PeerLostError",
    "PerRank", "PlacementError", "PollResult", "PollingWorker", "ProtocolError", "QueueEmpty", "QueueFull",
    "RegistryError", "RegistryUnavailable", "RemoteError", "WaitTimeout", "Worker",
    "WorkerAddress", "WorkerGroup", "WorkerInfo", "WorkerInitError", "WorkerNotFoundError",
    "WorkingDir", "WorkingDirError", "mark", "span",
]


def test_top_level_all_is_pinned_and_sorted() -> None:
    assert aiorl.__all__ == TOP_LEVEL
    for name in aiorl.__all__:
        assert hasattr(aiorl, name), name


@pytest.mark.parametrize("facade", [
    "aiorl", "aiorl.actors", "aiorl.runtime", "aiorl.group", "aiorl.channels", "aiorl.errors",
    "aiorl.weights",
])
def test_every_facade_exports_sorted_names_that_exist(facade: str) -> None:
    module = importlib.import_module(facade)
    assert module.__all__ == sorted(module.__all__), f"{facade}.__all__ is not sorted"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{facade} lists names it does not define: {missing}"


def test_error_contract_bases() -> None:
    """Errors meaning "not found", "exists", "timed out" keep the built-in bases (API.md 11)."""
    assert issubclass(aiorl.GroupNotFoundError, LookupError)
    assert issubclass(aiorl.WorkerNotFoundError, LookupError)
    assert issubclass(aiorl.GroupExistsError, ValueError)
    assert issubclass(aiorl.NodeRankTakenError, ValueError)
    assert issubclass(aiorl.WaitTimeout, TimeoutError)
    for name in aiorl.__all__:
        obj = getattr(aiorl, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, aiorl.AiorlError), name


def test_only_the_runtime_touches_asyncwork_internals() -> None:
    """Producers complete works through aiorl.runtime.promise (where tracing will hook in)."""
    import pathlib
    import re

    root = pathlib.Path(aiorl.__file__).parent
    pattern = re.compile(r"\.(_set_result|_set_exception|_complete_from|_concurrent)\(|\b\w+\._fut\b")
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py") if path.parent.name != "runtime"
        for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)
    ]
    assert not offenders, offenders
