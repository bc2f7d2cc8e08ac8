"""Reading one received message's fields, checking each on the way in.

Every typed message's ``from_wire`` reads its map through `Fields`,
which raises [`ProtocolError`][aiorl.ProtocolError] naming the message and the
field at the first value of the wrong type, out of range, too long, or not a
valid name. Messages that travel as lists, read by position (those sent once per
broadcast or per point-to-point message), use `list_fields`, `int_field` and
`field_error` the same way. Nothing downstream of ``from_wire`` ever sees an unchecked value:
that is what keeps one malformed message from being stored and breaking every
later scan of the registry's tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from aiorl.errors import ProtocolError
from aiorl.names import WorkerAddress, check_group_name

__all__ = [
    "MAX_ITEMS",
    "MAX_SHORT",
    "MAX_TEXT",
    "Fields",
    "PlainData",
    "check_plain",
    "check_worker_name",
    "field_error",
    "int_field",
    "list_fields",
]

#: Identifiers, addresses, host names, labels.
MAX_SHORT = 1024
#: Free text: tracebacks, the tail of a worker's output.
MAX_TEXT = 256 * 1024
#: Entries of one list or map (nodes, workers, labels, environment variables).
MAX_ITEMS = 100_000
_MAX_DEPTH = 6
_INT64 = (-(2**63), 2**63 - 1)

#: msgpack-able plain data (what a free-form ``detail`` may hold).
PlainData = None | bool | int | float | str | bytes | list["PlainData"] | dict[str, "PlainData"]

_T = TypeVar("_T")
_REQUIRED = object()


class Fields:
    """A received map, read field by field; ``message`` names it in every error."""

    __slots__ = ("_meta", "_message")

    def __init__(self, meta: object, message: str) -> None:
        if not isinstance(meta, dict):
            raise ProtocolError(f"{message}: expected a map, got {type(meta).__name__}")
        self._meta: dict[object, object] = meta
        self._message = message

    def error(self, key: str, why: str) -> ProtocolError:
        return ProtocolError(f"{self._message}.{key}: {why}")

    def packed(self) -> bytes | None:
        """The whole map packed by msgpack: a key under which to keep what was read from it
        (the same content packs to the same bytes); None when it holds what msgpack cannot
        pack (reading it field by field then says what is wrong)."""
        import msgpack

        try:
            return bytes(msgpack.packb(self._meta))
        except (TypeError, ValueError, OverflowError):
            return None

    def has(self, key: str) -> bool:
        return self._meta.get(key) is not None

    def _raw(self, key: str, default: object) -> object:
        if key in self._meta:
            return self._meta[key]
        if default is _REQUIRED:
            raise ProtocolError(f"{self._message}: missing field {key!r}")
        return default

    def text(self, key: str, default: object = _REQUIRED, *, max_len: int = MAX_SHORT) -> str:
        value = self._raw(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {type(value).__name__}")
        if len(value) > max_len:
            raise self.error(key, f"longer than {max_len} characters")
        return value

    def ident(self, key: str, default: object = _REQUIRED) -> str:
        """A node, driver or owner id: 1 to 256 printable characters (they reach logs)."""
        value = self.text(key, default, max_len=256)
        if not value or not value.isprintable():
            raise self.error(key, f"expected a non-empty printable id, got {value[:40]!r}")
        return value

    def optional_text(self, key: str, *, max_len: int = MAX_SHORT) -> str | None:
        return self.text(key, max_len=max_len) if self.has(key) else None

    def integer(
        self, key: str, default: object = _REQUIRED, *, lo: int = _INT64[0], hi: int = _INT64[1]
    ) -> int:
        value = self._raw(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"expected an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise self.error(key, f"{value} is outside [{lo}, {hi}]")
        return value

    def number(self, key: str, default: object = _REQUIRED, *, lo: float = 0.0,
               hi: float = 1e12) -> float:
        value = self._raw(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.error(key, f"expected a number, got {type(value).__name__}")
        if not math.isfinite(value) or not lo <= value <= hi:
            raise self.error(key, f"{value} is outside [{lo:g}, {hi:g}]")
        return float(value)

    def flag(self, key: str, default: object = _REQUIRED) -> bool:
        value = self._raw(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {type(value).__name__}")
        return value

    def checked(self, key: str, check: Callable[[str], str], default: object = _REQUIRED) -> str:
        """A string that ``check`` accepts (a group or worker name); its ValueError names why not."""
        value = self.text(key, default)
        try:
            return check(value)
        except ValueError as exc:
            raise self.error(key, str(exc)) from None

    def group_name(self, key: str) -> str:
        return self.checked(key, check_group_name)

    def worker_name(self, key: str) -> str:
        return self.checked(key, check_worker_name)

    def nested(self, key: str) -> Fields:
        return Fields(self._raw(key, _REQUIRED), f"{self._message}.{key}")

    def items(self, key: str, default: object = _REQUIRED, *,
              max_items: int = MAX_ITEMS) -> list[object]:
        value = self._raw(key, default)
        if not isinstance(value, (list, tuple)):
            raise self.error(key, f"expected a list, got {type(value).__name__}")
        if len(value) > max_items:
            raise self.error(key, f"more than {max_items} entries")
        return list(value)

    def each(self, key: str, parse: Callable[[Fields], _T], default: object = _REQUIRED) -> list[_T]:
        """Parse every entry of a list of maps with ``parse``."""
        return [parse(Fields(v, f"{self._message}.{key}[{i}]"))
                for i, v in enumerate(self.items(key, default))]

    def int_list(self, key: str, default: object = (), *, lo: int = 0,
                 hi: int = _INT64[1]) -> tuple[int, ...]:
        values = self.items(key, default)
        if not all(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
                   for v in values):
            raise self.error(key, f"expected integers in [{lo}, {hi}]")
        return tuple(values)  # type: ignore[arg-type]  # checked just above

    def text_list(self, key: str, default: object = (), *,
                  max_len: int = MAX_SHORT * 4) -> tuple[str, ...]:
        values = self.items(key, default)
        if not all(isinstance(v, str) and len(v) <= max_len for v in values):
            raise self.error(key, f"expected strings of at most {max_len} characters")
        return tuple(values)  # type: ignore[arg-type]  # checked just above

    def mapping(self, key: str, default: object = _REQUIRED, *,
                max_items: int = MAX_ITEMS) -> dict[str, object]:
        value = self._raw(key, default)
        if not isinstance(value, dict):
            raise self.error(key, f"expected a map, got {type(value).__name__}")
        if len(value) > max_items:
            raise self.error(key, f"more than {max_items} entries")
        if not all(isinstance(k, str) and len(k) <= MAX_SHORT for k in value):
            raise self.error(key, "keys must be strings")
        return {str(k): v for k, v in value.items()}

    def text_map(self, key: str, default: object = _REQUIRED, *,
                 max_len: int = MAX_TEXT) -> dict[str, str]:
        value = self.mapping(key, default)
        if not all(isinstance(v, str) and len(v) <= max_len for v in value.values()):
            raise self.error(key, f"values must be strings of at most {max_len} characters")
        return dict(value)  # type: ignore[arg-type]  # checked just above

    def int_map(self, key: str, default: object = _REQUIRED, *, lo: int = 0,
                hi: int = _INT64[1]) -> dict[str, int]:
        value = self.mapping(key, default)
        if not all(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
                   for v in value.values()):
            raise self.error(key, f"values must be integers in [{lo}, {hi}]")
        return dict(value)  # type: ignore[arg-type]  # checked just above

    def plain_map(self, key: str, default: object = _REQUIRED) -> dict[str, PlainData]:
        """A free-form map of plain data, bounded in depth, width and string length."""
        value = self.mapping(key, default)
        try:
            check_plain(value)
        except ValueError as exc:
            raise self.error(key, str(exc)) from None
        return dict(value)  # type: ignore[arg-type]  # checked just above


def check_plain(value: object, depth: int = 0) -> None:
    """Raise ValueError unless ``value`` is bounded plain data (no extension types, no giants)."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, float)):
        return
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise ValueError("integer out of the 64-bit range")
        return
    if isinstance(value, (str, bytes)):
        if len(value) > MAX_TEXT:
            raise ValueError(f"a string longer than {MAX_TEXT}")
        return
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_ITEMS:
            raise ValueError(f"a list of more than {MAX_ITEMS} entries")
        for v in value:
            check_plain(v, depth + 1)
        return
    if isinstance(value, Mapping):
        if len(value) > MAX_ITEMS:
            raise ValueError(f"a map of more than {MAX_ITEMS} entries")
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError("map keys must be strings")
            check_plain(v, depth + 1)
        return
    raise ValueError(f"unexpected {type(value).__name__}")


def check_worker_name(name: str) -> str:
    """Return ``name`` if it is a worker address with a rank (``group:rank...``), else ValueError."""
    address = WorkerAddress.from_name(name)
    if not address.rank_path:
        raise ValueError(f"{name!r} names a group, not a worker (expected group:rank)")
    if address.get_name() != name:  # e.g. "g:01": one worker, one spelling
        raise ValueError(f"{name!r} is not a canonical worker name (did you mean "
                         f"{address.get_name()!r}?)")
    return name


# ---------------------------------------------------------------------- positional messages
def field_error(message: str, field: str, why: str) -> ProtocolError:
    """The error for field ``field`` of ``message``: ``message.field: why``."""
    return ProtocolError(f"{message}.{field}: {why}")


def list_fields(meta: object, names: tuple[str, ...], message: str) -> Sequence[Any]:
    """A received list of ``len(names)`` fields (``names`` only serve the error)."""
    if (type(meta) is not list and type(meta) is not tuple) or len(meta) != len(names):
        raise ProtocolError(f"{message}: expected a list of {len(names)} fields "
                            f"({', '.join(names)})")
    return meta


def int_field(value: object, message: str, field: str, lo: int = 0, hi: int = _INT64[1]) -> int:
    """An integer in ``[lo, hi]`` (not a bool)."""
    if type(value) is not int:
        raise field_error(message, field, f"expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise field_error(message, field, f"{value} is outside [{lo}, {hi}]")
    return value
