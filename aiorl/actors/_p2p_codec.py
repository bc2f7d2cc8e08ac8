"""Encoding and decoding of p2p payloads: tensors and pickled containers.

Everything here runs on the caller's thread (encoding) or the loop (decoding)
and touches no sockets: an outgoing message becomes an :class:`_Out` (pickle
stream, raw CPU buffers to place, CUDA tensors to transfer), and the receiver
rebuilds tensors over the bytes it got (:func:`_rebuild_cpu`).
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import threading
from collections import ChainMap
from collections.abc import Sequence
from typing import Any

from aiorl.actors._p2p_proto import INBAND_MAX, K_CPU, K_CUDA, K_OBJ
from aiorl.errors import ProtocolError
from aiorl.transport.serialization import SerializationError, tensor_from_buffer


class _Out:
    """An outgoing message, encoded on the caller's thread."""

    __slots__ = ("kind", "head", "pickle", "bufs", "nbytes", "cuda", "event", "raw")

    def __init__(
        self, kind: int, head: Any, pickle_frame: Any, bufs: list[memoryview], cuda: list[Any]
    ) -> None:
        self.kind = kind
        self.head = head  # K_CPU/K_CUDA: [dtype, shape, requires_grad]
        self.pickle = pickle_frame
        self.bufs = bufs  # raw CPU bytes that travel out of band (shared memory or frames)
        self.nbytes = sum(b.nbytes for b in bufs) if bufs else 0
        self.cuda = cuda  # CUDA tensors, in placeholder order
        self.event: Any = None  # CUDA event recorded on the caller's stream at call time
        self.raw = False  # from send_tensor: the receiver most likely fills its own buffer


_tls = threading.local()  # .enc_cuda while pickling, .dec_cuda while unpickling
_DTYPES: dict[str, Any] = {}


def _dtype_name(dtype: Any) -> str:
    return str(dtype)[6:]  # "torch.float32" -> "float32"


def _dtype(name: str) -> Any:
    dt = _DTYPES.get(name)
    if dt is None:
        import torch

        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise ProtocolError(f"unknown tensor dtype {name!r} in a p2p message")
        _DTYPES[name] = dt
    return dt


def _not_contiguous(t: Any) -> ValueError:
    return ValueError(
        f"cannot send a non-contiguous tensor (shape {tuple(t.shape)}, "
        f"stride {tuple(t.stride())}); "
        "call .contiguous() first"
    )


class _NotContiguous(ValueError):
    """Raised from inside pickling so that the cloudpickle fallback does not swallow it."""


def _byte_view(t: Any) -> Any:
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


def _reduce_tensor(t: Any) -> Any:
    """Pickle reducer for tensors inside objects (see :func:`_encode`)."""
    # Not serialization._reduce_tensor: this one also carries requires_grad, Parameters and
    # CUDA placeholders and rejects non-contiguous tensors (that one defers those to torch).
    import torch

    if t.layout != torch.strided or t.is_quantized or t.device.type not in ("cpu", "cuda"):
        return t.__reduce_ex__(5)  # torch's own format; rare kinds
    if not t.is_contiguous():
        raise _NotContiguous(str(_not_contiguous(t)))
    if t.device.type == "cuda":
        cuda = _tls.enc_cuda
        cuda.append(t)
        return _cuda_placeholder, (len(cuda) - 1,)
    param = isinstance(t, torch.nn.Parameter)
    return _rebuild_cpu, (
        t.dtype,
        tuple(t.shape),
        t.requires_grad,
        pickle.PickleBuffer(_byte_view(t)),
        param,
    )


def _rebuild_cpu(
    dtype: Any, shape: Sequence[int], requires_grad: bool, data: Any, param: bool = False
) -> Any:
    """Receiver side of :func:`_reduce_tensor`: a tensor over ``data`` (no copy when writable)."""
    import numpy as np
    import torch

    if isinstance(data, np.ndarray) and data.flags.writeable:
        # from_numpy keeps the array (and a shared-memory lease's finalizer) alive.
        t = torch.from_numpy(data)
        if dtype != torch.uint8:
            t = t.view(dtype)
        t = t.reshape(shape)
    else:
        t = tensor_from_buffer(dtype, shape, data)
    if param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _cuda_placeholder(index: int) -> Any:
    """Receiver side of a CUDA tensor inside an object: the tensor being received into."""
    return _tls.dec_cuda[index]


_PICKLERS: tuple[type, type] | None = None


def _picklers() -> tuple[type, type]:
    """Pickler classes whose dispatch table knows tensors (the C pickler reads it at init)."""
    # Not serialization's picklers: their table holds its reducer, and these are reused per
    # thread (class-level table) where those are built per call.
    global _PICKLERS
    if _PICKLERS is None:
        import cloudpickle

        table: dict[Any, Any] = dict(copyreg.dispatch_table)
        torch = sys.modules.get("torch")
        if torch is not None:
            table[torch.Tensor] = _reduce_tensor
            table[torch.nn.Parameter] = _reduce_tensor

        class Fast(pickle.Pickler):
            dispatch_table = table

        class Cloud(cloudpickle.CloudPickler):
            dispatch_table = ChainMap(table, cloudpickle.CloudPickler.dispatch_table)

        _PICKLERS = (Fast, Cloud)
    return _PICKLERS


class _Encoder:
    """A pickler kept per thread: building one costs more than pickling a small object."""

    __slots__ = ("stream", "pickler", "bufs", "busy")

    def __init__(self, pickler_cls: type) -> None:
        self.stream = io.BytesIO()
        self.bufs: list[memoryview] = []
        self.busy = False
        self.pickler = pickler_cls(self.stream, 5, buffer_callback=self._out_of_band)

    def _out_of_band(self, pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < INBAND_MAX:
            return True  # serialize in band
        self.bufs.append(raw)
        return False

    def dump(self, obj: Any) -> tuple[bytes, list[memoryview]]:
        """The pickle of ``obj`` and its out-of-band buffers; the pickler is reset either way."""
        self.bufs = []
        try:
            self.pickler.dump(obj)
            return self.stream.getvalue(), self.bufs
        finally:
            self.pickler.clear_memo()
            self.stream.seek(0)
            self.stream.truncate()


def _encode(obj: Any) -> _Out:
    """Encode ``obj`` for :meth:`P2P.send` on the caller's thread; raises on bad input."""
    torch = sys.modules.get("torch")
    if torch is not None and type(obj) is torch.Tensor and obj.layout == torch.strided:
        return _encode_tensor(obj)
    fast, cloud = _picklers()
    enc: _Encoder | None = getattr(_tls, "encoder", None)
    if enc is None or enc.busy:  # first use on this thread, or re-entered from a __reduce__
        enc = _Encoder(fast)
        if getattr(_tls, "encoder", None) is None:
            _tls.encoder = enc
    cuda: list[Any] = []
    _tls.enc_cuda = cuda
    enc.busy = True
    try:
        try:
            data, bufs = enc.dump(obj)
        except _NotContiguous as exc:
            raise ValueError(str(exc)) from None
        except Exception:
            # Lambdas, local classes, closures: cloudpickle can do what pickle cannot.
            _tls.encoder = None  # a failed dump may leave the pickler in any state
            cuda.clear()
            try:
                data, bufs = _Encoder(cloud).dump(obj)
            except _NotContiguous as exc:
                raise ValueError(str(exc)) from None
            except Exception as exc:
                raise SerializationError(
                    f"cannot send object of type {type(obj).__qualname__}: it cannot be pickled "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
    finally:
        enc.busy = False
        _tls.enc_cuda = None
    out = _Out(K_OBJ, None, data, bufs, cuda)
    if cuda:
        from aiorl.actors._p2p_cuda import record_event

        out.event = record_event()
    return out


def _encode_tensor(t: Any) -> _Out:
    """One tensor, no pickle: dtype and shape in the header, its bytes as the payload."""
    if not t.is_contiguous():
        raise _not_contiguous(t)
    head = [_dtype_name(t.dtype), list(t.shape), bool(t.requires_grad)]
    if t.device.type == "cuda":
        from aiorl.actors._p2p_cuda import record_event

        out = _Out(K_CUDA, head, None, [], [t])
        out.event = record_event()
        return out
    if t.device.type != "cpu":
        raise TypeError(f"cannot send a tensor on device {t.device} (only CPU and CUDA)")
    return _Out(K_CPU, head, None, [memoryview(_byte_view(t))], [])


def _check_buffer(buf: Any) -> None:
    import torch

    if not isinstance(buf, torch.Tensor):
        raise TypeError(
            f"recv_tensor needs a preallocated torch.Tensor, got {type(buf).__qualname__}"
        )
    if buf.layout != torch.strided or not buf.is_contiguous():
        raise ValueError("recv_tensor needs a contiguous (strided) buffer tensor")
    if buf.is_conj() or buf.is_neg():
        raise ValueError("recv_tensor needs a plain buffer (resolve its conj/neg bit first)")
    if buf.device.type not in ("cpu", "cuda"):
        raise TypeError(f"recv_tensor buffer on unsupported device {buf.device}")


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _spec_nbytes(spec: Sequence[Any]) -> int:
    dtype, shape = spec
    n = _dtype(dtype).itemsize
    for d in shape:
        n *= d
    return n


def _flat_u8(t: Any) -> Any:
    """A contiguous tensor's bytes as a flat uint8 tensor (NCCL then only has to match bytes)."""
    import torch

    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
