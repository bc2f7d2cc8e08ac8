"""The worker the GPU suites launch (tests/gpu/test_gpu_single.py, tests/gpu/test_gpu_multi.py).

Every method checks what it received itself and returns plain data (lists of problems,
numbers), so a failure names what went wrong without shipping tensors back.
"""

from __future__ import annotations

import asyncio
import glob
import os
import statistics
import time
from typing import Any

import torch

import aiorl
from aiorl.cuda.devices import device_uuid
from aiorl.util.cuda_device import selected_device

#: GPU busy-wait long enough (~tens of ms on an H100) that an unsynchronised transfer would
#: read the tensor before the fill that follows it.
SLEEP_CYCLES = 50_000_000


def shm_torch_files() -> int:
    return len(glob.glob("/dev/shm/torch_*"))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def dtype_cases() -> list[tuple[str, Any]]:
    """(label, tensor factory on a device): the dtype/shape matrix of issue 13."""
    cases: list[tuple[str, Any]] = [
        ("fp32", lambda d: torch.arange(1000, device=d, dtype=torch.float32)),
        ("bf16", lambda d: torch.arange(999, device=d).to(torch.bfloat16)),
        ("fp16", lambda d: torch.arange(777, device=d).to(torch.float16)),
        ("bool", lambda d: torch.arange(501, device=d) % 3 == 0),
        ("int64", lambda d: torch.arange(-50, 50, device=d, dtype=torch.int64)),
        ("complex64", lambda d: torch.arange(64, device=d).to(torch.complex64) * (1 + 2j)),
        ("0-d", lambda d: torch.tensor(3.5, device=d)),
        ("zero-size", lambda d: torch.empty(0, 7, device=d)),
        ("view", lambda d: torch.arange(100, device=d, dtype=torch.float32)[10:60]),
        ("2d", lambda d: torch.arange(64, device=d, dtype=torch.int32).reshape(8, 8)),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        cases.append(
            ("fp8", lambda d: torch.linspace(-4, 4, 256, device=d).to(torch.float8_e4m3fn))
        )
    return cases


def _equal(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    if a.dtype.itemsize == 1 and a.dtype not in (torch.bool, torch.uint8, torch.int8):
        a, b = a.view(torch.uint8), b.view(torch.uint8)  # fp8: compare the bits
    return torch.equal(a, b)


class G(aiorl.Worker):
    """A GPU worker. ``device`` (local index) is selected in ``__init__`` with
    ``torch.cuda.set_device``: received tensors must land there, on every thread."""

    def __init__(self, device: int = 0) -> None:
        super().__init__()
        torch.cuda.set_device(device)
        self.device = torch.device("cuda", device)

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "selected": selected_device(),
            "uuid": device_uuid(self.device.index),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "alloc": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        }

    # ------------------------------------------------------------------ stream races
    async def send_after_sleep(self, dst: int, value: float, side: bool) -> None:
        t = torch.zeros(1 << 20, device=self.device)
        stream = torch.cuda.Stream(self.device) if side else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            t.fill_(value)
            await self.send(t, self.worker_group_name, dst)
            await self.send_tensor(t, self.worker_group_name, dst)

    async def recv_after_race(self, src: int, value: float) -> list[str]:
        bad = []
        got = await self.recv(self.worker_group_name, src)
        if not bool((got == value).all()):
            bad.append("send: read before the fill")
        buf = torch.empty(1 << 20, device=self.device)
        torch.cuda._sleep(SLEEP_CYCLES)
        buf.fill_(-1.0)  # queued before the receive is posted: the transfer must land after
        await self.recv_tensor(buf, self.worker_group_name, src)
        if not bool((buf == value).all()):
            bad.append("recv_tensor: the caller's pending fill overwrote the payload")
        return bad

    # ------------------------------------------------------------------ where tensors land
    async def send_one(self, dst: int, n: int) -> None:
        await self.send(
            {"t": torch.arange(n, device=self.device, dtype=torch.float32)},
            self.worker_group_name,
            dst,
        )

    def recv_where(self, src: int) -> dict[str, Any]:
        """Plain method (method thread): where a received tensor landed."""
        got = self.recv(self.worker_group_name, src).wait(60)["t"]
        return {
            "index": got.device.index,
            "uuid": device_uuid(got.device.index),
            "ok": bool((got.cpu() == torch.arange(got.numel())).all()),
        }

    async def recv_where_async(self, src: int) -> dict[str, Any]:
        """Async method (event-loop thread, never set_device'd): same answer wanted."""
        got = (await self.recv(self.worker_group_name, src))["t"]
        return {
            "index": got.device.index,
            "uuid": device_uuid(got.device.index),
            "ok": bool((got.cpu() == torch.arange(got.numel())).all()),
        }

    def make_result(self) -> dict[str, Any]:
        p = torch.nn.Parameter(torch.ones(3, device=self.device))
        return {
            "t": torch.arange(5, device=self.device),
            "p": p,
            "view": torch.arange(10, device=self.device)[::2],
        }

    def take_arg(self, x: Any) -> dict[str, Any]:
        return {"index": x.device.index, "sum": float(x.sum())}

    # ------------------------------------------------------------------ matrix
    async def send_matrix(self, dst: int, raw: bool) -> int:
        n = 0
        for _label, make in dtype_cases():
            t = make(self.device)
            if raw:
                await self.send_tensor(t.contiguous(), self.worker_group_name, dst)
            else:
                param = torch.nn.Parameter(
                    t.float() if t.is_floating_point() else t.clone(),
                    requires_grad=t.is_floating_point(),
                )
                await self.send({"t": t.contiguous(), "p": param}, self.worker_group_name, dst)
            n += 1
        return n

    async def recv_matrix(self, src: int, raw: bool) -> list[str]:
        bad = []
        for label, make in dtype_cases():
            want = make(torch.device("cpu")).contiguous()
            if raw:
                buf = torch.empty_like(want, device=self.device)
                got = await self.recv_tensor(buf, self.worker_group_name, src)
                if got is not buf or not _equal(buf, want):
                    bad.append(f"{label}: recv_tensor")
            else:
                obj = await self.recv(self.worker_group_name, src)
                if not _equal(obj["t"], want) or obj["t"].device != self.device:
                    bad.append(f"{label}: value or device {obj['t'].device}")
                if not isinstance(obj["p"], torch.nn.Parameter):
                    bad.append(f"{label}: Parameter lost")
        return bad

    async def send_huge(self, dst: int, gib: float) -> None:
        n = int(gib * 2**30) // 4
        t = torch.ones(n, device=self.device)
        t[-1] = 7.0
        await self.send_tensor(t, self.worker_group_name, dst)

    async def recv_huge(self, src: int, gib: float) -> dict[str, Any]:
        """Receive ``gib`` GiB while measuring how late the event loop runs a 1 ms tick."""
        n = int(gib * 2**30) // 4
        buf = torch.empty(n, device=self.device)
        lateness: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                lateness.append(time.perf_counter() - t0 - 0.001)

        ticker = asyncio.create_task(tick())
        t0 = time.perf_counter()
        await self.recv_tensor(buf, self.worker_group_name, src)
        elapsed = time.perf_counter() - t0
        done.set()
        await ticker
        lateness.sort()
        ok = bool(buf[0] == 1.0) and bool(buf[-1] == 7.0)
        return {
            "ok": ok,
            "s": elapsed,
            "p99_ms": 1e3 * lateness[int(0.99 * (len(lateness) - 1))] if lateness else 0.0,
        }

    # ------------------------------------------------------------------ endurance
    async def send_same(self, dst: int, times: int) -> dict[str, float]:
        t = torch.full((1 << 16,), 3.0, device=self.device)
        rss0, shm0 = rss_mb(), shm_torch_files()
        for i in range(times):
            await self.send_tensor(t, self.worker_group_name, dst)
            if i == 99:
                rss0, shm0 = rss_mb(), shm_torch_files()  # after warm-up
        return {"rss_growth_mb": rss_mb() - rss0, "shm_growth": shm_torch_files() - shm0}

    async def recv_same(self, src: int, times: int) -> dict[str, float]:
        buf = torch.empty(1 << 16, device=self.device)
        lateness: list[float] = []
        rss0 = rss_mb()
        bad = 0
        for i in range(times):
            t0 = time.perf_counter()
            await self.recv_tensor(buf, self.worker_group_name, src)
            lateness.append(time.perf_counter() - t0)
            if i % 500 == 0 and not bool((buf == 3.0).all()):
                bad += 1
            if i == 99:
                rss0 = rss_mb()
        lateness.sort()
        return {
            "bad": bad,
            "rss_growth_mb": rss_mb() - rss0,
            "p99_ms": 1e3 * lateness[int(0.99 * (len(lateness) - 1))],
            "median_ms": 1e3 * statistics.median(lateness),
        }

    # ------------------------------------------------------------------ failures
    def fill_memory(self, leave_mb: int) -> int:
        """Allocate all but ``leave_mb`` of the device's free memory (kept until release)."""
        free, _total = torch.cuda.mem_get_info(self.device)
        n = max(0, free - (leave_mb << 20))
        self._hog = torch.empty(n, dtype=torch.uint8, device=self.device)
        return n >> 20

    def release_memory(self) -> None:
        self._hog = None
        torch.cuda.empty_cache()

    def prepare(self, n: int, value: float) -> None:
        """Allocate the next tensor ``send_expect`` sends (before a peer fills the GPU)."""
        self._prepared = torch.full((n,), value, device=self.device)

    async def send_expect(self, dst: int, n: int, value: float) -> str:
        prepared = getattr(self, "_prepared", None)
        self._prepared = None
        t = prepared if prepared is not None else torch.full((n,), value, device=self.device)
        try:
            await self.send_tensor(t, self.worker_group_name, dst)
            return "ok"
        except Exception as exc:  # noqa: BLE001 - the test reads the class name
            return type(exc).__name__

    async def recv_expect(self, src: int, n: int, value: float | None) -> str:
        try:
            got = await self.recv(self.worker_group_name, src)
        except Exception as exc:  # noqa: BLE001 - the test reads the class name
            return f"{type(exc).__name__}: {exc}"
        if value is not None and not bool((got == value).all()):
            return "wrong data"
        return "ok"

    async def send_forever(self, dst: int, mb: int) -> None:
        t = torch.ones(mb << 18, device=self.device)
        while True:
            await self.send_tensor(t, self.worker_group_name, dst)

    async def recv_until_lost(self, src: int, mb: int) -> str:
        buf = torch.empty(mb << 18, device=self.device)
        try:
            while True:
                await self.recv_tensor(buf, self.worker_group_name, src)
        except aiorl.PeerLostError:
            return "PeerLostError"
        except Exception as exc:  # noqa: BLE001 - the test reads the class name
            return type(exc).__name__

    async def send_two(self, dst: int, n: int) -> None:
        await self.recv(self.worker_group_name, dst)  # the receiver posted (and may cancel)
        for value in (1.0, 2.0):
            await self.send_tensor(
                torch.full((n,), value, device=self.device), self.worker_group_name, dst
            )

    async def recv_cancelled(self, src: int, n: int, delay_s: float) -> dict[str, Any]:
        """Post a recv_tensor, cancel it after ``delay_s``, then receive the next message."""
        g = self.worker_group_name
        buf = torch.full((n,), -1.0, device=self.device)
        work = self.recv_tensor(buf, g, src)
        await self.send(None, g, src)
        await asyncio.sleep(delay_s)
        work.cancel()
        nxt = torch.empty(n, device=self.device)
        await self.recv_tensor(nxt, g, src)
        await asyncio.sleep(0.5)  # a late write into buf would show by now
        torch.cuda.synchronize()
        return {
            "first_written": bool((buf != -1).any()),
            "next": float(nxt[0]),
            "cancelled": work.cancelled() if hasattr(work, "cancelled") else None,
        }

    def alive(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ all-to-all
    async def all_to_all(self, world: int, n: int) -> list[str]:
        g, me = self.worker_group_name, self.rank
        sends = [
            self.send(torch.full((n,), float(me * 100 + peer), device=self.device), g, peer)
            for peer in range(world)
            if peer != me
        ]  # every first send at once
        bad = []
        for peer in range(world):
            if peer == me:
                continue
            got = await self.recv(g, peer)
            if got.device != self.device or not bool((got == peer * 100 + me).all()):
                bad.append(f"from {peer}")
        for w in sends:
            await w
        return bad
