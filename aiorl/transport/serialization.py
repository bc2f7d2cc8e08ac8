"""The one codec of aiorl: pickle protocol 5, out-of-band buffers, one tensor reducer.

Every payload that crosses a process boundary (calls and replies, channel items,
point-to-point messages) is pickled here, by one policy:

* **Out-of-band buffers.** `encode` returns the pickle stream and every buffer
  of at least ``oob_threshold`` bytes (default `OOB_THRESHOLD`) separately,
  so that the caller can send it as a zero-copy frame or place it in shared memory.
  Smaller buffers stay in the stream, where one copy is cheaper than a frame.
* **One tensor reducer.** A dense CPU tensor becomes its dtype, shape,
  ``requires_grad``, whether it is a ``Parameter``, and its raw bytes (a
  ``PickleBuffer``), rebuilt without a copy where the receiver's buffer is writable.
  Two per-call switches serve point-to-point messages: ``strict`` rejects
  non-contiguous tensors at once (``ValueError``; otherwise torch's own reduction
  keeps their strides), and a ``cuda_sink`` list collects CUDA tensors, which are
  pickled as placeholders and travel by NCCL or CUDA IPC.
* **CUDA tensors elsewhere** (method arguments and results, channel items): copied to
  the host on the sending thread (after what its stream queued), carried as out-of-band
  bytes like a CPU tensor, and rebuilt on the receiving process's *selected* CUDA device
  (`aiorl.util.cuda_device`), keeping ``requires_grad`` and ``Parameter``. A process
  without CUDA (a CPU-only driver) cannot take one: unpickling raises
  `CudaUnavailableError` naming the tensor (docs/gpu.md).
* **One pickler per thread**, reused: building a pickler and its stream costs more
  than pickling a small object. Its dispatch table is a single dict, updated in
  place when torch is imported or ``copyreg`` gains an entry, so a tensor pickled
  after a late ``import torch`` still uses the reducer above.
* **cloudpickle** where plain pickle gives up (lambdas, classes defined in
  ``__main__``, closures), its code objects whole with their file names
  (`aiorl.transport.code`); `SerializationError` (a ``TypeError``) when
  neither can.

Measurements behind the threshold: ``benchmarks/bench_serialization.py`` (a round
trip ties at 64 KiB, 404 vs 416 µs; out of band wins from 256 KiB, 674 vs 1,101 µs,
and by 3.7x at 4 MiB).
"""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import sys
import threading
from collections.abc import Sequence
from typing import Any

import cloudpickle

from aiorl.errors import ProtocolError
from aiorl.transport.code import CodePickler
from aiorl.util.cuda_device import selected_device

__all__ = [
    "ATOMIC_TYPES",
    "CudaUnavailableError",
    "OOB_THRESHOLD",
    "SerializationError",
    "byte_view",
    "decode",
    "dumps",
    "dumps_arguments",
    "encode",
    "loads",
    "tensor_from_buffer",
]

#: Buffers at least this large travel as separate, zero-copy frames.
OOB_THRESHOLD = 64 * 1024


class SerializationError(TypeError):
    """An object could not be pickled (by pickle nor cloudpickle)."""


class CudaUnavailableError(ProtocolError):
    """A CUDA tensor reached a process that has no CUDA device (e.g. a CPU-only driver):
    return ``tensor.cpu()`` instead, or receive it in a worker that has a GPU."""


class _NotContiguous(ValueError):
    """Raised from inside pickling (strict mode) so that the cloudpickle retry does not hide it."""


# ----------------------------------------------------------------------------- tensors
def byte_view(t: Any) -> Any:
    """The bytes of a contiguous CPU tensor as a flat uint8 numpy array (no copy)."""
    import torch

    flat = t.detach() if t.requires_grad else t
    if flat.is_conj() or flat.is_neg():  # lazy conjugate/negative views: materialize
        flat = flat.resolve_conj().resolve_neg()
    if flat.dim() != 1:
        flat = flat.view(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def not_contiguous_error(t: Any) -> ValueError:
    """The error for a non-contiguous tensor where aiorl needs its bytes in one piece."""
    return ValueError(
        f"cannot send a non-contiguous tensor (shape {tuple(t.shape)}, "
        f"stride {tuple(t.stride())}); call .contiguous() first"
    )


_numpy_of: dict[Any, Any] = {}


def numpy_dtypes() -> dict[Any, Any]:
    """numpy's dtype for each torch dtype numpy has (not bfloat16 nor the float8 kinds).

    A tensor of one of them is seen by numpy in one call (``Tensor.numpy``) instead of a
    flat uint8 view's three, and rebuilt with numpy's views, several times cheaper than
    torch's: a state dict of 1,000 tensors pays each call 1,000 times."""
    if not _numpy_of:
        import numpy as np
        import torch

        _numpy_of.update({
            torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
            torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
            torch.int64: np.int64, torch.uint8: np.uint8, torch.bool: np.bool_,
            torch.complex64: np.complex64, torch.complex128: np.complex128})
    return _numpy_of


def tensor_from_buffer(dtype: Any, shape: Sequence[int], data: Any) -> Any:
    """A tensor of ``dtype`` and ``shape`` over the bytes of ``data`` (copied if read-only).

    The tensor keeps what it views alive (a shared-memory array, and its lease's
    finalizer, through numpy's ``base``)."""
    import numpy as np
    import torch

    as_numpy = numpy_dtypes().get(dtype)
    if as_numpy is not None:
        return _rebuild_array(as_numpy, tuple(shape), data)
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if not arr.flags.writeable:  # torch needs writable memory; received frames are read-only
        arr = arr.copy()
    t = torch.from_numpy(arr)
    return (t if dtype == torch.uint8 else t.view(dtype)).reshape(shape)


def _rebuild_tensor(
    dtype: Any, shape: Sequence[int], requires_grad: bool, data: Any, param: bool
) -> Any:
    """Unpickling side of `_reduce_tensor` (named in pickle streams: the wire format)."""
    t = tensor_from_buffer(dtype, shape, data)
    if param:
        import torch

        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _rebuild_array(as_numpy: Any, shape: tuple[int, ...], data: Any) -> Any:
    """Unpickling side of `_reduce_tensor`'s common case (and `tensor_from_buffer`'s for the
    dtypes numpy has): a plain tensor over ``data``'s bytes as numpy's ``as_numpy`` (copied
    if read-only: torch needs writable memory)."""
    import numpy as np
    import torch

    # Either keeps ``data`` (and a shared-memory lease's finalizer) alive through ``base``;
    # a view of an array (shared memory) costs half of frombuffer.
    if data.__class__ is np.ndarray:
        arr = data.view(as_numpy)
    else:
        arr = np.frombuffer(data, dtype=as_numpy)
    if not arr.flags.writeable:
        arr = arr.copy()
    if arr.shape != shape:
        arr = arr.reshape(shape)
    return torch.from_numpy(arr)


def _cuda_placeholder(index: int, requires_grad: bool = False, param: bool = False) -> Any:
    """Unpickling side of a CUDA tensor sent out of band: the tensor it was received into,
    made a ``Parameter`` / given ``requires_grad`` again as the sent one was."""
    t = _tls.cuda_in[index]
    if param:
        import torch

        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _rebuild_cuda_tensor(
    dtype: Any, shape: Sequence[int], requires_grad: bool, data: Any, param: bool, device: str
) -> Any:
    """Unpickling side of a CUDA tensor in a call or channel item: its bytes, on this
    process's selected CUDA device (``device`` is where it was, for the error message)."""
    import torch

    if not torch.cuda.is_available():
        raise CudaUnavailableError(
            f"received a CUDA tensor (shape {tuple(shape)}, {dtype}, from {device}) but this "
            "process has no CUDA device; send tensor.cpu() instead"
        )
    host = tensor_from_buffer(dtype, shape, data)
    t = host.to(torch.device("cuda", selected_device()))
    if param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(t: Any) -> Any:
    # The common case first, in the fewest torch calls (a state dict pays each per tensor):
    # a plain CPU tensor without grad, of a dtype numpy has, contiguous. ``numpy()`` raises
    # for the kinds it cannot view (a lazy conjugate or negative, sparse): the path below.
    if t.__class__ is _PlainTensor and t.is_cpu and not t.requires_grad:
        as_numpy = _numpy_of.get(t.dtype)
        if as_numpy is not None:
            try:
                arr = t.numpy()
            except (RuntimeError, TypeError):
                arr = None
            if arr is not None and arr.flags.c_contiguous:
                return _rebuild_array, (as_numpy, arr.shape, pickle.PickleBuffer(arr))
    # Every other tensor: the checks are the cheap boolean properties, and the Parameter
    # check (a Python-level __instancecheck__) only for a subclass of Tensor.
    import torch

    cuda = t.is_cuda
    if not (cuda or t.is_cpu) or t.layout != torch.strided or t.is_quantized:
        return t.__reduce_ex__(5)  # torch's own format; rare kinds
    param = t.__class__ is not torch.Tensor and isinstance(t, torch.nn.Parameter)
    enc = _tls.encoder
    if not t.is_contiguous():
        if enc is not None and enc.strict:
            raise _NotContiguous(str(not_contiguous_error(t)))
        if not cuda or (enc is not None and enc.cuda_out is not None):
            return t.__reduce_ex__(5)  # keeps the strides
        # A CUDA view in a call: its values, compactly (docs/gpu.md).
        return _reduce_cuda(t.contiguous(), None, param)
    if cuda:
        return _reduce_cuda(t, enc, param)
    dtype, grad = t.dtype, t.requires_grad
    if grad or dtype not in (_numpy_of or numpy_dtypes()):
        arr = byte_view(t)
    else:
        try:
            arr = t.numpy()
        except RuntimeError:  # a lazy conjugate or negative view: byte_view resolves it
            arr = byte_view(t)
    return _rebuild_tensor, (dtype, tuple(t.shape), grad, pickle.PickleBuffer(arr), param)


def _reduce_cuda(t: Any, enc: _Encoder | None, param: bool) -> Any:
    """A CUDA tensor: a placeholder when the encoder collects them (p2p), else its bytes
    through the host, rebuilt on the receiver's selected device."""
    sink = enc.cuda_out if enc is not None else None
    if sink is not None:
        sink.append(t)
        if t.requires_grad or param:
            return _cuda_placeholder, (len(sink) - 1, t.requires_grad, param)
        return _cuda_placeholder, (len(sink) - 1,)
    host = t.detach().cpu()  # after what the calling thread's stream queued
    return _rebuild_cuda_tensor, (
        t.dtype,
        tuple(t.shape),
        t.requires_grad,
        pickle.PickleBuffer(byte_view(host)),
        param,
        str(t.device),
    )


# ----------------------------------------------------------------------------- dispatch table
class _CodecState(threading.local):
    """Per thread: the encoder in use (the reducer reads its settings) and, while unpickling,
    the CUDA tensors that placeholders stand for."""

    encoder: _Encoder | None = None
    cuda_in: Sequence[Any] = ()


_tls = _CodecState()

#: The dispatch table of every aiorl pickler. One dict, updated in place (C picklers keep a
#: reference to it, taken at construction): see :func:`_sync_table`.
_TABLE: dict[Any, Any] = dict(copyreg.dispatch_table)
#: ``torch.Tensor`` once the reducer is registered (`_reduce_tensor` compares classes to it).
_PlainTensor: Any = None
_synced_copyreg_size = len(copyreg.dispatch_table)
_torch_registered = False
_sync_lock = threading.Lock()


def _sync_table() -> None:
    """Add the tensor reducer once torch is imported, and what ``copyreg`` gained since."""
    global _synced_copyreg_size, _torch_registered, _PlainTensor
    with _sync_lock:
        _TABLE.update(copyreg.dispatch_table)
        _synced_copyreg_size = len(copyreg.dispatch_table)
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "nn"):  # fully imported
            _TABLE[torch.Tensor] = _reduce_tensor
            _TABLE[torch.nn.Parameter] = _reduce_tensor
            _PlainTensor = torch.Tensor
            numpy_dtypes()  # fills what `_reduce_tensor`'s common case looks up
            _torch_registered = True


def _dispatch_table() -> dict[Any, Any]:
    """The live dispatch table (for picklers built elsewhere: they see later updates too)."""
    if len(copyreg.dispatch_table) != _synced_copyreg_size or (
        not _torch_registered and "torch" in sys.modules
    ):
        _sync_table()
    return _TABLE


class _Pickler(pickle.Pickler):
    dispatch_table = _TABLE  # the C pickler reads it at construction


class _CloudPickler(CodePickler):
    dispatch_table = collections.ChainMap(_TABLE, cloudpickle.CloudPickler.dispatch_table)


class _Encoder:
    """A pickler, its stream, its out-of-band buffers and the settings of the current dump.

    One per thread, reused: building a pickler costs more than pickling a small object.
    """

    __slots__ = ("stream", "pickler", "bufs", "threshold", "strict", "cuda_out", "busy")

    def __init__(self, pickler_cls: Any) -> None:
        self.stream = io.BytesIO()
        self.bufs: list[memoryview] = []
        self.threshold = OOB_THRESHOLD
        self.strict = False  # a non-contiguous tensor raises (instead of torch's reduction)
        self.cuda_out: list[Any] | None = None  # CUDA tensors sent out of band
        self.busy = False
        self.pickler = pickler_cls(self.stream, 5, buffer_callback=self._out_of_band)

    def _out_of_band(self, pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < self.threshold:
            return True  # serialize in band
        self.bufs.append(raw)
        return False


# ----------------------------------------------------------------------------- public
#: Types whose pickle can hold neither out-of-band buffers nor tensors (exact types only:
#: a subclass may reduce to anything). Most small messages are one of these.
ATOMIC_TYPES = frozenset({int, float, bool, str, bytes, type(None)})


def encode(
    obj: Any,
    oob_threshold: int = OOB_THRESHOLD,
    *,
    strict: bool = False,
    cuda_sink: list[Any] | None = None,
) -> tuple[bytes, list[memoryview]]:
    """The pickle of ``obj`` and its out-of-band buffers (each ``>= oob_threshold`` bytes).

    ``strict``: a non-contiguous tensor anywhere in ``obj`` raises `ValueError`.
    ``cuda_sink``: CUDA tensors are appended to it and pickled as placeholders
    (`decode` with ``cuda=`` puts the received tensors back).
    Raises `SerializationError` naming the type when nothing can pickle ``obj``.
    """
    if len(copyreg.dispatch_table) != _synced_copyreg_size or (
        not _torch_registered and "torch" in sys.modules
    ):
        _sync_table()
    if obj.__class__ in ATOMIC_TYPES:  # no buffers, no tensors inside: the C pickler alone
        return pickle.dumps(obj, 5), []
    state = _tls
    enc = state.encoder
    if enc is None or enc.busy:  # first use on this thread, or re-entered from a __reduce__
        return _encode_with_new_encoder(obj, oob_threshold, strict, cuda_sink)
    enc.threshold = oob_threshold
    enc.strict = strict
    enc.cuda_out = cuda_sink
    enc.busy = True
    bufs: list[memoryview] = []
    enc.bufs = bufs
    pickler, stream = enc.pickler, enc.stream
    try:
        pickler.dump(obj)
        return stream.getvalue(), bufs
    except _NotContiguous as exc:
        raise ValueError(str(exc)) from None
    except Exception:
        state.encoder = None  # a failed dump may leave the pickler in any state
        return _encode_with_cloudpickle(obj, oob_threshold, strict, cuda_sink)
    finally:
        pickler.clear_memo()
        stream.seek(0)
        stream.truncate()
        enc.busy = False
        enc.cuda_out = None


def _encode_with_new_encoder(
    obj: Any, oob_threshold: int, strict: bool, cuda_sink: list[Any] | None
) -> tuple[bytes, list[memoryview]]:
    state = _tls
    outer = state.encoder
    state.encoder = _Encoder(_Pickler)
    try:
        return encode(obj, oob_threshold, strict=strict, cuda_sink=cuda_sink)
    finally:
        if outer is not None:  # re-entered: the outer dump goes on with its own encoder
            state.encoder = outer


def _encode_with_cloudpickle(
    obj: Any, oob_threshold: int, strict: bool, cuda_sink: list[Any] | None
) -> tuple[bytes, list[memoryview]]:
    """Lambdas, local classes, closures: cloudpickle can do what pickle cannot."""
    if cuda_sink is not None:
        cuda_sink.clear()
    state = _tls
    outer = state.encoder
    enc = state.encoder = _Encoder(_CloudPickler)
    enc.threshold, enc.strict, enc.cuda_out = oob_threshold, strict, cuda_sink
    try:
        enc.pickler.dump(obj)
        return enc.stream.getvalue(), enc.bufs
    except _NotContiguous as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:
        raise SerializationError(
            f"cannot serialize object of type {type(obj).__qualname__}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        state.encoder = outer


def decode(data: Any, buffers: Sequence[Any] = (), cuda: Sequence[Any] = ()) -> Any:
    """Inverse of `encode`; ``cuda`` are the tensors its CUDA placeholders stand for."""
    if not cuda:
        return pickle.loads(data, buffers=buffers)
    state = _tls
    state.cuda_in = cuda
    try:
        return pickle.loads(data, buffers=buffers)
    finally:
        state.cuda_in = ()


def dumps(obj: Any, oob_threshold: int = OOB_THRESHOLD) -> list[Any]:
    """Serialize ``obj`` into ``[pickle_bytes, *large_buffers]`` (see `encode`)."""
    data, bufs = encode(obj, oob_threshold)
    return [data, *bufs]


def dumps_arguments(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The frames of a call's ``(args, kwargs)`` (see :func:`dumps`). When they cannot be
    serialized, the :class:`SerializationError` names the argument that cannot (its position
    or keyword and its type), not the tuple that holds them all."""
    try:
        return dumps((args, kwargs))
    except SerializationError:
        named = [*((f"argument {i}", v) for i, v in enumerate(args)),
                 *((f"keyword argument {k!r}", v) for k, v in kwargs.items())]
        for where, value in named:
            try:
                encode(value)
            except SerializationError as exc:
                cause = exc.__cause__
                reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
                raise SerializationError(
                    f"{where} of {method}() cannot be serialized ({type(value).__qualname__}): "
                    f"{reason}") from cause
        raise


def loads(frames: Sequence[Any]) -> Any:
    """Inverse of `dumps`: ``frames[0]`` is the pickle, the rest its buffers."""
    return pickle.loads(frames[0], buffers=frames[1:])
