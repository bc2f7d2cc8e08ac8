"""Pickle protocol 5 with out-of-band buffers, and cloudpickle where pickle gives up.

``dumps(obj)`` returns a list of frames: the pickle stream first, then every
buffer larger than :data:`OOB_THRESHOLD` as its own frame, so that ZMQ can send
it without copying. Smaller buffers stay in the stream, where one copy is cheaper
than one more frame. ``loads(frames)`` reverses it.

Contiguous CPU tensors are reduced to their raw bytes plus dtype and shape, so a
large tensor travels as one zero-copy frame instead of torch's default
``torch.save``-style byte string. Anything plain pickle cannot handle (lambdas,
classes defined in ``__main__``, closures) is retried with cloudpickle.
"""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import cloudpickle

__all__ = ["OOB_THRESHOLD", "SerializationError", "dumps", "loads"]

#: Buffers at least this large travel as separate, zero-copy frames. Below it,
#: copying into the pickle stream costs no more than a frame of its own
#: (benchmarks/bench_serialization.py: a round trip ties at 64 KiB, 404 vs 416 µs;
#: out of band wins from 256 KiB, 674 vs 1,101 µs, and by 3.7x at 4 MiB).
OOB_THRESHOLD = 64 * 1024


class SerializationError(TypeError):
    """An object could not be pickled (by pickle nor cloudpickle)."""


def tensor_from_buffer(dtype: Any, shape: Sequence[int], data: Any) -> Any:
    """A tensor of ``dtype`` and ``shape`` over the bytes of ``data``.

    No copy unless ``data`` is read-only (shared with :mod:`aiorl.actors._p2p_codec`).
    """
    import torch

    mv = memoryview(data)
    if mv.readonly:
        # torch.frombuffer needs a writable buffer; received frames are read-only.
        mv = memoryview(bytearray(mv))
    if mv.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(mv, dtype=torch.uint8)
    return (t if dtype == torch.uint8 else t.view(dtype)).reshape(shape)


def _rebuild_tensor(dtype: Any, shape: tuple[int, ...], data: Any) -> Any:
    # Named in pickle streams (the wire format): keep it, delegate the work.
    return tensor_from_buffer(dtype, shape, data)


def _reduce_tensor(t: Any) -> Any:
    # Not shared with p2p's reducer: that one keeps autograd/Parameter/CUDA tensors its own way
    # and rejects non-contiguous ones, where this one defers all of them to torch.
    if t.device.type != "cpu" or not t.is_contiguous() or t.requires_grad or t.is_sparse:
        return t.__reduce_ex__(5)  # torch's own path (CUDA, autograd, sparse, strided)
    flat = t.detach().reshape(-1).view(__import__("torch").uint8)
    return _rebuild_tensor, (t.dtype, tuple(t.shape), pickle.PickleBuffer(flat.numpy()))


def _tensor_table() -> dict[type, Any]:
    torch = sys.modules.get("torch")  # no tensors can exist unless torch was imported
    return {torch.Tensor: _reduce_tensor} if torch is not None else {}


_table_cache: dict[bool, dict[type, Any]] = {}


def _dispatch_table() -> dict[type, Any]:
    # Cached per "torch imported yet?"; rebuilt never otherwise (copyreg rarely changes
    # after start-up, and a stale entry would only cost speed, not correctness).
    key = "torch" in sys.modules
    table = _table_cache.get(key)
    if table is None:
        table = _table_cache[key] = {**copyreg.dispatch_table, **_tensor_table()}
    return table


class _Pickler(pickle.Pickler):
    def __init__(self, file: Any, **kwargs: Any) -> None:
        # The C pickler reads dispatch_table once, in __init__: set it first.
        self.dispatch_table = _dispatch_table()
        super().__init__(file, **kwargs)


class _CloudPickler(cloudpickle.CloudPickler):
    def __init__(self, file: Any, **kwargs: Any) -> None:
        self.dispatch_table = collections.ChainMap(
            _tensor_table(), cloudpickle.CloudPickler.dispatch_table)
        super().__init__(file, **kwargs)


def dumps(obj: Any, oob_threshold: int = OOB_THRESHOLD) -> list[Any]:
    """Serialize ``obj`` into ``[pickle_bytes, *large_buffers]``.

    Raises :class:`SerializationError` naming the object's type when neither
    pickle nor cloudpickle can serialize it.
    """
    buffers: list[pickle.PickleBuffer] = []

    def keep_large(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes < oob_threshold:
            return True  # true = serialize in-band
        buffers.append(buf)
        return False

    stream = io.BytesIO()
    pickler = _Pickler(stream, protocol=5, buffer_callback=keep_large)
    try:
        pickler.dump(obj)
    except Exception:
        buffers.clear()
        stream = io.BytesIO()
        cp = _CloudPickler(stream, protocol=5, buffer_callback=keep_large)
        try:
            cp.dump(obj)
        except Exception as exc:
            raise SerializationError(
                f"cannot serialize object of type {type(obj).__qualname__}: {exc}"
            ) from exc
    return [stream.getbuffer(), *(b.raw() for b in buffers)]


def loads(frames: Sequence[Any]) -> Any:
    """Inverse of :func:`dumps`: ``frames[0]`` is the pickle, the rest its buffers."""
    return pickle.loads(frames[0], buffers=frames[1:])
