"""The CUDA device this process *selected*: where received CUDA tensors land, on every thread.

PyTorch's current device is per thread (``cudaSetDevice``): a worker that calls
``torch.cuda.set_device(1)`` in ``__init__`` (on its method thread) leaves its event-loop
thread, and every thread aiorl starts, on device 0. Receiving code that allocated on "the
current device" therefore put tensors on ``cuda:0`` in a worker that sees several GPUs.

aiorl instead keeps one process-wide choice, read by every thread that lands CUDA bytes
(point-to-point receives, broadcasts, CUDA tensors in call arguments and results):

1. the device given to `select_device` (``Worker.set_cuda_device`` style, explicit);
2. else the device that was current on the worker's method thread when its ``__init__``
   returned (`note_thread_device`, called by the worker process), which is where a
   worker that called ``torch.cuda.set_device`` asked to be;
3. else device 0 (the first device of ``CUDA_VISIBLE_DEVICES``).

Imports nothing from aiorl and never imports torch itself (a process without torch, or
without CUDA, never pays for this module).
"""

from __future__ import annotations

import sys
import threading

__all__ = ["note_thread_device", "select_device", "selected_device"]

_lock = threading.Lock()
_explicit: int | None = None
_noted: int | None = None


def select_device(index: int | None) -> None:
    """Make CUDA device ``index`` (a local index) where this process lands CUDA tensors;
    None goes back to the device noted at start-up."""
    global _explicit
    if index is not None and index < 0:
        raise ValueError(f"a CUDA device index is >= 0, got {index}")
    with _lock:
        _explicit = index


def note_thread_device() -> int | None:
    """Remember the calling thread's current CUDA device, if CUDA is initialised here.

    Called once after a worker's ``__init__`` on its method thread: a constructor that
    called ``torch.cuda.set_device`` has initialised CUDA. Never initialises CUDA itself.
    Returns the device noted (None: CUDA is not in use in this process).
    """
    global _noted
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    index = int(torch.cuda.current_device())
    with _lock:
        _noted = index
    return index


def selected_device() -> int:
    """The local CUDA device index received tensors land on (see the module docstring)."""
    explicit, noted = _explicit, _noted
    if explicit is not None:
        return explicit
    if noted is not None:
        return noted
    return 0
