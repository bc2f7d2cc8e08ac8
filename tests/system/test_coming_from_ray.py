"""Coming from Ray (issue 32, items 3 and 5): one value from a one-rank call, a different
argument per actor, the driver's own exception classes caught by ``except``, and a timed-out
wait that says what the worker keeps doing. docs/coming-from-ray.md shows each.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

import aiorl
from tests._paths import REPO_ROOT

pytestmark = pytest.mark.timeout(180)

DOCS = REPO_ROOT / "docs"


class QuotaExceeded(Exception):
    """Defined in the test module: travels to the workers by value with the worker class."""


class HTTPStatusError(RuntimeError):
    """An __init__ whose arguments are not RemoteError's: the driver never runs it."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status


class Counter(aiorl.Worker):
    def __init__(self, start: int = 10) -> None:
        super().__init__()
        self.value = start

    def incr(self) -> int:
        self.value += 1
        return self.value

    def sq(self, x: int) -> int:
        return x * x

    def spend(self, tokens: int) -> None:
        raise QuotaExceeded(f"{tokens} tokens over the quota")

    def fetch(self) -> None:
        raise HTTPStatusError(418, "I'm a teapot")

    def local(self) -> None:
        class Local(Exception):
            pass

        raise Local("defined inside a function: not found in the driver")

    def forever(self) -> None:
        time.sleep(3600)  # a plain method that never returns (in a test's time)

    def forever_on(self, rank: int) -> int:
        if self.rank == rank:
            time.sleep(3600)
        return self.rank

    async def nap(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    async def ping(self) -> str:
        return "pong"


@pytest.fixture(scope="module")
def one(cluster: aiorl.Cluster) -> Any:
    group = Counter.create_group(10).launch(cluster, num_workers=1, name="one")
    group.wait_ready(60)
    yield group
    group.close()


@pytest.fixture(scope="module")
def four(cluster: aiorl.Cluster) -> Any:
    group = Counter.create_group().launch(cluster, num_workers=4, name="four")
    group.wait_ready(60)
    yield group
    group.close()


# ----------------------------------------------------------------------------- 3(a), 3(c)
def test_wait_one_gives_the_value_of_a_call_on_one_rank(one: Any, four: Any) -> None:
    start = one.incr().wait(30)
    assert isinstance(start, list) and len(start) == 1  # a group of one returns a list (RLinf)
    assert one.incr().wait_one(30) == start[0] + 1  # Ray's ray.get(actor.f.remote())
    assert four.execute_on(2).sq(7).wait_one(30) == 49

    async def main() -> int:
        return await one.incr().async_wait_one()  # Ray's await actor.f.remote()

    assert asyncio.run(main()) == start[0] + 2


def test_wait_one_refuses_a_call_on_several_ranks_and_says_how_many(four: Any) -> None:
    with pytest.raises(ValueError, match=r"gave 4 results \(one per rank called\).*wait\(\)"):
        four.sq(3).wait_one(30)
    with pytest.raises(ValueError, match="gave 0 results"):
        four.execute_on().sq(3).wait_one(30)

    async def main() -> None:
        await four.execute_on(0, 1).sq(3).async_wait_one()

    with pytest.raises(ValueError, match="gave 2 results"):
        asyncio.run(main())


def test_a_different_argument_per_actor(four: Any) -> None:
    works = [four.execute_on(i).sq(i) for i in range(4)]  # Ray: [a.f.remote(i) for i, a in ...]
    assert [w.wait(30) for w in works] == [[0], [1], [4], [9]]
    assert [w.wait_one(30) for w in [four.execute_on(i).sq(i) for i in range(4)]] == [0, 1, 4, 9]

    async def main() -> list[int]:
        return list(await asyncio.gather(
            *(four.execute_on(i).sq(i).async_wait_one() for i in range(4))))

    assert asyncio.run(main()) == [0, 1, 4, 9]


# ----------------------------------------------------------------------------- 3(b)
def test_ray_get_of_several_refs_in_sync_and_async_code(four: Any) -> None:
    w1, w2 = four.execute_on(1).sq(2), four.execute_on(3).sq(3)
    assert [w.wait(30) for w in (w1, w2)] == [[4], [9]]  # synchronous code

    async def main() -> list[Any]:
        w1, w2 = four.execute_on(1).sq(2), four.execute_on(3).sq(3)
        return list(await asyncio.gather(w1, w2))  # async code: gather is awaited

    assert asyncio.run(main()) == [[4], [9]]


def test_the_coming_from_ray_page_awaits_every_gather_and_shows_the_new_rows() -> None:
    page = (DOCS / "coming-from-ray.md").read_text()
    gathers = [m.start() for m in re.finditer(r"asyncio\.gather\(", page)]
    assert gathers
    for at in gathers:  # never shown as if it gave results in synchronous code
        assert page[max(0, at - 6):at] == "await ", page[at - 60:at + 40]
    assert "[w.wait() for w in (w1, w2)]" in page
    assert "[a.f.remote(i) for i, a in enumerate(actors)]" in page
    assert "wait_one()" in page and "[0, 1, 4, 9]" in page
    assert "except QuotaExceeded" in page
    contract = (DOCS / "reference" / "contract.md").read_text()
    assert "wait_one(timeout=None)" in contract and "async_wait_one()" in contract


# ----------------------------------------------------------------------------- 3(d)
def test_a_test_modules_exception_class_is_caught_by_except(one: Any) -> None:
    with pytest.raises(QuotaExceeded) as info:
        one.spend(100).wait(30)
    err = info.value
    assert isinstance(err, aiorl.RemoteError)
    assert (err.rank, err.worker_name) == (0, "one:0")
    assert err.exc_type == f"{__name__}.QuotaExceeded"
    assert "100 tokens over the quota" in str(err)
    assert "in spend" in err.remote_traceback and "raise QuotaExceeded" in err.remote_traceback

    # An __init__ of other arguments: caught all the same, and the driver ran none of it.
    with pytest.raises(HTTPStatusError) as http:
        one.fetch().wait(30)
    assert isinstance(http.value, RuntimeError) and isinstance(http.value, aiorl.RemoteError)
    assert "418 I'm a teapot" in str(http.value) and not hasattr(http.value, "status")

    with pytest.raises(aiorl.RemoteError) as local:  # f.<locals>.Local: no class to find
        one.local().wait(30)
    assert type(local.value) is aiorl.RemoteError and "Local" in local.value.exc_type

    # In a coroutine as well.
    async def main() -> None:
        await one.spend(1)

    with pytest.raises(QuotaExceeded):
        asyncio.run(main())


def test_a_class_is_found_only_among_imported_modules_and_none_of_its_code_runs() -> None:
    """The name travels, never the class: nothing is imported, and no hook of the class runs."""
    import types

    from aiorl.errors import from_wire, remote_error

    module = types.ModuleType("aiorl_test_userland")
    exec(textwrap.dedent('''\
        RAN = []

        class Plain(Exception):
            pass

        class Outer:
            class Inner(LookupError):
                pass

        class Hooked(Exception):
            def __init_subclass__(cls, **kwargs):
                RAN.append("__init_subclass__")

        class Freed(Exception):
            def __del__(self):
                RAN.append("__del__")

        class Interrupt(KeyboardInterrupt):
            pass

        def not_a_class():
            RAN.append("called")
        '''), module.__dict__)
    fields = ("w:1", 1)

    def rebuilt(type_name: str) -> BaseException:
        return remote_error(*fields, type_name, "message", "Traceback ...")

    name = module.__name__
    assert type(rebuilt(f"{name}.Plain")) is aiorl.RemoteError  # not imported: not found
    sys.modules[name] = module
    try:
        plain = rebuilt(f"{name}.Plain")
        assert isinstance(plain, module.Plain) and isinstance(plain, aiorl.RemoteError)
        assert isinstance(rebuilt(f"{name}.Outer.Inner"), module.Outer.Inner)  # qualified name
        for unsafe in ("Hooked", "Freed", "Interrupt", "not_a_class", "RAN", "Missing"):
            assert type(rebuilt(f"{name}.{unsafe}")) is aiorl.RemoteError, unsafe
        assert module.RAN == []
        # A module run again defines a new class under the same name: except names the new one.
        exec("class Plain(Exception):\n    pass\n", module.__dict__)
        assert isinstance(rebuilt(f"{name}.Plain"), module.Plain)
        # Passed on by a second worker, and through the wire codec.
        again = from_wire(aiorl.errors.to_wire(rebuilt(f"{name}.Plain"), error="RemoteError",
                                               worker="b:0", rank=0))
        assert isinstance(again, module.Plain) and again.worker_name == "b:0"
    finally:
        del sys.modules[name]
    assert "aiorl_test_never_imported" not in sys.modules
    assert type(rebuilt("aiorl_test_never_imported.Boom")) is aiorl.RemoteError
    assert type(rebuilt("aiorl.runtime.work.UnawaitedWorkError")) is aiorl.RemoteError
    assert "aiorl_test_never_imported" not in sys.modules


SCRIPT = textwrap.dedent('''\
    import aiorl


    class QuotaExceeded(Exception):
        pass


    class Billing(aiorl.Worker):
        def spend(self, tokens):
            raise QuotaExceeded(f"{tokens} tokens over the quota")


    if __name__ == "__main__":
        with aiorl.Cluster(num_nodes=1) as cluster:
            group = Billing.create_group().launch(cluster, num_workers=1, name="billing")
            try:
                group.spend(100).wait(60)
            except QuotaExceeded as exc:
                print("caught", type(exc).__name__, isinstance(exc, aiorl.RemoteError),
                      exc.rank, exc.worker_name, exc.exc_type, flush=True)
                print(exc.remote_traceback, flush=True)
    ''')


def test_a_scripts_exception_class_is_caught_by_except(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "billing.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "AIORL_REGISTRY"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("caught RemoteError(__main__.QuotaExceeded) True 0 billing:0 __main__.QuotaExceeded"
            in out.stdout), out.stdout + out.stderr
    assert 'raise QuotaExceeded(f"{tokens} tokens over the quota")' in out.stdout, out.stdout


# ----------------------------------------------------------------------------- 5
def test_a_timed_out_plain_call_says_it_keeps_its_rank_busy(cluster: aiorl.Cluster) -> None:
    group = Counter.create_group().launch(cluster, num_workers=1, name="stuck")
    try:
        group.wait_ready(60)
        with pytest.raises(aiorl.WaitTimeout) as info:
            group.forever().wait(1)
        text = str(info.value)
        assert "Counter.forever() on group 'stuck' not done within 1 s by rank 0 (cancelled" in text
        assert "plain (non-async) method, which cannot be interrupted" in text
        assert "keeps running in the worker" in text
        assert "rank 0's method thread is still busy with forever()" in text
        assert "later plain calls to that rank queue behind it" in text

        # A later plain call waits behind it, and its timeout says so.
        with pytest.raises(aiorl.WaitTimeout) as later:
            group.incr().wait(1)
        text = str(later.value)
        assert "Counter.incr() on group 'stuck' not done within 1 s by rank 0" in text
        assert "still busy with forever(), an earlier call that timed out" in text
        assert "incr() waits behind it" in text

        assert group.ping().wait(30) == ["pong"]  # async methods still run
        with pytest.raises(aiorl.WaitTimeout) as nap:
            group.nap(60).wait(0.5)
        text = str(nap.value)
        assert "Counter.nap() on group 'stuck' not done within 0.5 s by rank 0" in text
        assert "async method: it keeps running on the worker's event loop" in text
        assert "method thread" not in text
    finally:
        group.close()


def test_a_timed_out_fan_out_names_the_ranks_that_did_not_answer(cluster: aiorl.Cluster) -> None:
    group = Counter.create_group().launch(cluster, num_workers=3, name="stuck3")
    try:
        group.wait_ready(60)
        with pytest.raises(TimeoutError) as info:
            group.forever_on(1).wait(2)
        text = str(info.value)
        assert "Counter.forever_on() on group 'stuck3' not done within 2 s by rank 1, of the 3 " \
               "ranks it went to (cancelled" in text
        assert "rank 1's method thread is still busy with forever_on()" in text
        assert group.execute_on(0).incr().wait_one(30) == 11  # the other ranks are free
        with pytest.raises(TimeoutError) as later:  # all ranks: rank 1 still holds it up
            group.incr().wait(2)
        text = str(later.value)
        assert "Counter.incr() on group 'stuck3' not done within 2 s by rank 1, of the 3" in text
        assert "rank 1's method thread is still busy with forever_on(), an earlier call" in text
        assert "incr() waits behind it" in text
    finally:
        group.close()


def test_other_works_keep_the_plain_timeout_message() -> None:
    import threading

    from aiorl.runtime.work import AsyncWork

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        work: AsyncWork[Any] = AsyncWork(loop)
        with pytest.raises(aiorl.WaitTimeout,
                           match=r"^AsyncWork not done within 0\.1 s \(cancelled\)$"):
            work.wait(0.1)
        done: AsyncWork[Any] = AsyncWork(loop)
        loop.call_soon_threadsafe(done._set_result, 5)
        with pytest.raises(TypeError, match="is for group calls.*int: use wait"):
            done.wait_one(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
