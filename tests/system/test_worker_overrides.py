"""A framework may re-define Worker's API on purpose with PEP 698's ``@override``; an unmarked
re-definition is refused; every naming problem of a class is reported in one error."""

from __future__ import annotations

import sys
import typing
from typing import Any

import pytest

import aiorl
from aiorl.group.method_names import is_marked_override

pytestmark = pytest.mark.timeout(120)

if sys.version_info >= (3, 12):
    override = typing.override  # type: ignore[attr-defined]
else:
    typing_extensions = pytest.importorskip("typing_extensions")
    override = typing_extensions.override


def stdlib_override(f: Any) -> Any:
    """What ``typing.override`` does on 3.12+ (setting ``__override__``), for the 3.10/3.11 runs
    of this suite: aiorl reads the attribute, not the decorator's identity."""
    f.__override__ = True
    return f


class SyncByDefault(aiorl.Worker):
    """RLinf's compatibility layer in small: ``async_op=False`` by default, marked overrides
    that call ``super()``, and a marked classmethod."""

    @override
    def send(self, obj: Any, dst_group_name: str, dst_rank: Any, async_op: bool = False) -> Any:
        return super().send(obj, dst_group_name, dst_rank, async_op=async_op)

    @stdlib_override
    def recv(self, src_group_name: str, src_rank: Any, async_op: bool = False) -> Any:
        return super().recv(src_group_name, src_rank, async_op=async_op)

    @override
    @classmethod
    def create_group(cls, *args: Any, **kwargs: Any) -> Any:
        return super().create_group(*args, **kwargs)

    def give(self, obj: Any) -> None:
        assert self.send(obj, self.worker_group_name, 1) is None  # blocking: no AsyncWork

    def take(self) -> Any:
        return self.recv(self.worker_group_name, 0)


def test_marked_overrides_are_accepted_and_run(cluster):
    group = SyncByDefault.create_group().launch(cluster, num_workers=2, name="overrides")
    try:
        taken = group.execute_on(1).take()
        group.execute_on(0).give({"x": 7}).wait(60)
        assert taken.wait(60) == [{"x": 7}]
    finally:
        group.close()


def test_the_marker_is_found_on_every_decorator_order():
    class Marked(aiorl.Worker):
        @classmethod
        @override
        def create_group(cls, *args: Any, **kwargs: Any) -> Any:
            return super().create_group(*args, **kwargs)

        @override
        @staticmethod
        def log_info(*args: Any) -> None:
            pass

        @property
        @override
        def world_size(self) -> int:
            return 1

    assert Marked.create_group() is not None
    for name in ("create_group", "log_info", "world_size"):
        assert is_marked_override(vars(Marked)[name]), name
    assert not is_marked_override(vars(SyncByDefault)["give"])


def test_an_unmarked_redefinition_is_refused_with_what_to_do():
    class Accidental(aiorl.Worker):
        async def send(self, x: int) -> int:
            return x

    with pytest.raises(ValueError) as e:
        Accidental.create_group()
    assert str(e.value).startswith(
        "Accidental defines send, which shadows aiorl.Worker's own API of the same name")
    assert "rename it, or mark it with @typing.override if you mean it" in str(e.value)

    class UnmarkedClassmethod(aiorl.Worker):
        @classmethod
        def create_group(cls, *args: Any, **kwargs: Any) -> Any:
            return super().create_group(*args, **kwargs)

    with pytest.raises(ValueError, match="UnmarkedClassmethod defines create_group, which "
                       "shadows"):
        UnmarkedClassmethod.create_group()


def test_a_subclass_that_redefines_a_marked_override_must_mark_its_own():
    """The definition that wins is the one checked: the framework's marker does not excuse
    an application class that names a method ``send`` by accident."""

    class App(SyncByDefault):
        def send(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
            return obj

    with pytest.raises(ValueError, match="App defines send, which shadows"):
        App.create_group()

    class Inherits(SyncByDefault):
        def step(self) -> int:
            return 1

    assert Inherits.create_group() is not None


def test_every_clash_is_reported_in_one_error():
    class Everything(aiorl.Worker):
        def execute_on(self) -> None:
            pass

        def close(self) -> None:
            pass

        def send(self) -> None:
            pass

        def recv(self) -> None:
            pass

        @override
        def broadcast(self, *args: Any, **kwargs: Any) -> Any:  # marked: not reported
            return super().broadcast(*args, **kwargs)

    with pytest.raises(ValueError) as e:
        Everything.create_group()
    assert str(e.value) == (
        "Everything defines close and execute_on, which clash with WorkerGroup attributes of "
        "the same name (a call on the group would reach the group, never the workers); rename "
        "them; it also defines recv and send, which shadow aiorl.Worker's own API of the same "
        "name (aiorl itself calls it, e.g. send and recv carry messages between workers); "
        "rename them, or mark each with @typing.override if you mean it "
        "(typing_extensions.override before Python 3.12) and call super()"
    )


def test_one_group_clash_reads_in_the_singular_and_override_does_not_excuse_it():
    """``@override`` concerns Worker's API; a method a group attribute hides stays unreachable
    through the group whatever it is marked with."""

    class One(aiorl.Worker):
        @override
        def execute_on(self) -> None:
            pass

    with pytest.raises(ValueError) as e:
        One.create_group()
    assert str(e.value) == (
        "One defines execute_on, which clashes with a WorkerGroup attribute of the same name "
        "(a call on the group would reach the group, never the workers); rename it"
    )
