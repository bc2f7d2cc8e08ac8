"""How channel items and queue keys travel: pickles inline or as frames, keys as bytes."""

from __future__ import annotations

import pickle
from collections.abc import Hashable, Sequence
from typing import Any

import msgpack

from aiorl.channels import settings
from aiorl.protocol.channels import QueueKey
from aiorl.transport import serialization

__all__ = ["decode_item", "encode_item", "key_from_wire", "wire_key"]


def encode_item(item: Any) -> tuple[Any, list[Any]]:
    """``(payload, frames)`` for an item: a small pickle inline, else ``(n, its n frames)``.

    The frames are the pickle and its out-of-band buffers from aiorl's one codec,
    `aiorl.transport.serialization.encode` (buffers of at least
    ``OOB_THRESHOLD`` bytes, e.g. tensor data, become zero-copy frames). Raises
    `SerializationError`.
    """
    data, buffers = serialization.encode(item)
    if not buffers and len(data) <= settings.INLINE_MAX:
        return data, []
    return 1 + len(buffers), [data, *buffers]


def decode_item(payload: Any, frames: Sequence[Any]) -> Any:
    if payload.__class__ is int:
        return serialization.decode(frames[0], frames[1:])
    return serialization.decode(payload)


#: msgpack extension type of a key that msgpack cannot hold itself: its pickle.
_PICKLED_KEY = 1


def _pickled_key(obj: Any) -> msgpack.ExtType:
    return msgpack.ExtType(_PICKLED_KEY, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _unpickled_key(code: int, data: bytes) -> Any:
    if code != _PICKLED_KEY:
        raise ValueError(f"unknown channel key extension type {code}")
    return pickle.loads(data)


def wire_key(key: Hashable) -> QueueKey:
    """A queue key as it travels and is stored at the channel worker.

    A ``str`` stays as it is (the common case, and free). Any other hashable key
    becomes bytes: its msgpack form, with tuples as arrays and objects msgpack
    cannot hold (enums, frozen dataclasses, ...) as their pickle. Equal keys
    built from ``str``, ``int``, ``float``, ``bool``, ``None``, ``bytes`` and
    tuples of them therefore name one queue in every process; unlike a ``dict``,
    ``1``, ``1.0`` and ``True`` are three keys, and other objects are compared by
    their pickle.
    """
    if key.__class__ is str:
        return key
    if isinstance(key, str):
        return str(key)
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"a channel key must be hashable, got {type(key).__name__}") from None
    return msgpack.packb(key, default=_pickled_key)  # type: ignore[no-any-return]


def key_from_wire(key: QueueKey) -> Any:
    """The key `wire_key` made ``key`` from."""
    if key.__class__ is str:
        return key
    return msgpack.unpackb(key, use_list=False, ext_hook=_unpickled_key)
