"""Which payload path a p2p message takes, by kind, size and placement; the one codec.

The path tests run real workers (two on one node, one on another) and record, on the
receiving side, the control messages as they arrive (``p2p.batch`` or ``p2p.data``, kind,
CPU path tag, CUDA path tag) before the engine handles them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import aiorl
from aiorl.p2p.message import encode_object, encode_tensor
from aiorl.p2p.settings import INLINE_MAX, SHM_MIN
from aiorl.placement import NodePlacementStrategy
from aiorl.protocol.p2p import CMA, FRAMES, K_CPU, K_OBJ, SHM

pytestmark = pytest.mark.timeout(90)

G = "p2ppaths"
SAME, CROSS = 1, 2  # peers of rank 0: on its node, on the other node
KB = 1024


def tensor_of(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


# Each case: how it is sent (send or send_tensor) and what.
CASES: dict[str, tuple[str, Any]] = {
    "int": ("send", 7),
    "tensor_1kb": ("send", 1 * KB),
    "tensor_100kb": ("send", 100 * KB),
    "tensor_300kb": ("send", 300 * KB),
    "tensor_4mb": ("send", 4096 * KB),
    "dict_100kb": ("send_dict", 100 * KB),
    "dict_300kb": ("send_dict", 300 * KB),
    "send_tensor_1kb": ("send_tensor", 1 * KB),
    "send_tensor_300kb": ("send_tensor", 300 * KB),
    "send_tensor_4mb": ("send_tensor", 4096 * KB),
}


def payload(how: str, what: Any) -> Any:
    if how == "send" and isinstance(what, int) and what < 100:
        return what
    if how == "send_dict":
        return {"x": tensor_of(what), "step": 1}
    return tensor_of(what)


class Recorder(aiorl.Worker):
    def record(self) -> None:
        """Put a recorder in front of the engine's data handlers."""
        from aiorl.p2p import get_p2p
        from aiorl.protocol.ops import P2POp

        engine = get_p2p(self._runtime)
        on_data, on_batch = engine._on_data, engine._on_batch
        self.seen: list[list[Any]] = []

        def tag(desc: Any) -> Any:
            return None if desc is None else desc[0]

        def data(msg: Any) -> None:
            _src, kind, _head, bufdesc, cudadesc = msg.meta
            self.seen.append(["data", kind, tag(bufdesc), tag(cudadesc)])
            on_data(msg)

        def batch(msg: Any) -> None:
            for kind, _head, bufdesc in msg.meta[1]:
                self.seen.append(["batch", kind, tag(bufdesc), None])
            on_batch(msg)

        self._runtime.endpoint.handle(P2POp.DATA, data)
        self._runtime.endpoint.handle(P2POp.BATCH, batch)

    async def take(self, src: int, n: int) -> list[list[Any]]:
        for _ in range(n):
            await self.recv(self.worker_group_name, src)
        seen, self.seen = self.seen, []
        return seen

    async def send_twice(self, dst: int, how: str, what: Any) -> None:
        """Send the case twice in one loop turn: inline messages then share one batch."""
        g = self.worker_group_name
        send = self.send_tensor if how == "send_tensor" else self.send
        works = [send(payload(how, what), g, dst) for _ in range(2)]
        for w in works:
            await w


@pytest.fixture(scope="module")
def group():
    with aiorl.Cluster(num_nodes=2) as c:
        g = Recorder.create_group().launch(
            c, name=G, placement_strategy=NodePlacementStrategy([0, 0, 1])
        )
        g.execute_on(SAME, CROSS).record().wait(60)
        yield g
        g.close()


def paths_taken(g: Any, peer: int, case: str) -> list[list[Any]]:
    how, what = CASES[case]
    taken = g.execute_on(peer).take(0, 2)
    g.execute_on(0).send_twice(peer, how, what).wait(30)
    result: list[list[Any]] = taken.wait(30)[0]
    return result


# What each case takes toward a worker of the same node (CMA where ptrace allows it).
SAME_NODE = {
    "int": ["batch", K_OBJ, None],
    "tensor_1kb": ["batch", K_CPU, FRAMES],
    "tensor_100kb": ["data", K_CPU, FRAMES],
    "tensor_300kb": ["data", K_CPU, SHM],
    "tensor_4mb": ["data", K_CPU, SHM],  # send: the receiver keeps a view, no pull
    "dict_100kb": ["data", K_OBJ, FRAMES],
    "dict_300kb": ["data", K_OBJ, SHM],
    "send_tensor_1kb": ["batch", K_CPU, FRAMES],
    "send_tensor_300kb": ["data", K_CPU, SHM],
    "send_tensor_4mb": ["data", K_CPU, CMA],
}


@pytest.mark.parametrize("case", list(CASES))
def test_path_toward_same_node(group: Any, case: str) -> None:
    want = SAME_NODE[case]
    got = paths_taken(group, SAME, case)
    if want[2] == CMA and got and got[0][2] == SHM:
        pytest.skip("process_vm_readv is not allowed here (ptrace_scope); shm is the fallback")
    assert got == [[*want, None]] * 2, got


@pytest.mark.parametrize("case", list(CASES))
def test_path_toward_other_node(group: Any, case: str) -> None:
    how, kind_place, tag = SAME_NODE[case]
    if tag in (SHM, CMA):
        tag = FRAMES  # no shared memory or pulls across nodes
    assert paths_taken(group, CROSS, case) == [[how, kind_place, tag, None]] * 2


# ----------------------------------------------------------------------------- no processes
@pytest.mark.parametrize(
    ("obj", "inline"),
    [
        (1, True),
        ("x" * (INLINE_MAX - 100), True),
        ("x" * INLINE_MAX, False),
        (tensor_of(INLINE_MAX - 1), True),
        (tensor_of(INLINE_MAX), False),
        ({"t": tensor_of(INLINE_MAX - 1000)}, True),  # in band: one pickle frame
        ({"t": tensor_of(INLINE_MAX)}, False),  # out of band
    ],
)
def test_inline_is_one_small_frame(obj: Any, inline: bool) -> None:
    msg = encode_object(obj)
    assert (msg.inline is not None) is inline
    if not inline and isinstance(obj, dict):
        assert msg.bufs and msg.nbytes == INLINE_MAX


def test_send_tensor_message_is_raw_bytes() -> None:
    t = torch.arange(SHM_MIN, dtype=torch.uint8)
    msg = encode_tensor(t)
    assert msg.kind == K_CPU and msg.pickle is None and msg.nbytes == SHM_MIN
    assert msg.head == ["uint8", [SHM_MIN], False] and msg.inline is None


def test_tensor_reducer_applies_when_torch_is_imported_after_first_use() -> None:
    """A tensor pickled after a late ``import torch`` still travels as raw bytes."""
    script = textwrap.dedent(
        """
        import sys
        from aiorl.transport import serialization
        assert "torch" not in sys.modules
        serialization.encode({"warm": 1})
        serialization.dumps([1, 2])
        import torch
        data, bufs = serialization.encode(torch.zeros(1 << 17), strict=True, cuda_sink=[])
        assert len(bufs) == 1 and bufs[0].nbytes == 4 << 17, bufs
        assert b"_rebuild_array" in data and b"torch._utils" not in data
        frames = serialization.dumps(torch.ones(1 << 17))
        assert len(frames) == 2
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_runtime_stop_closes_the_engine() -> None:
    """The engine releases its paths when its runtime stops; later operations fail at once."""
    from aiorl.errors import PeerLostError
    from aiorl.p2p import get_p2p

    with aiorl.Cluster(num_nodes=1) as c:
        engine = get_p2p(c.runtime)
        assert get_p2p(c.runtime) is engine and not engine.closed
    assert engine.closed
    with pytest.raises(PeerLostError, match="closed"):
        engine.send(1, "nobody", 0).wait(5)
