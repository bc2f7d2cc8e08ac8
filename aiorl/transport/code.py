"""Code pickled by value keeps its file name, its line numbers and its source lines.

A worker class defined in the user's script (``__main__``, a test module, a notebook cell)
travels to the workers by value, with cloudpickle. cloudpickle 3.1.3 renames the file of every
code object it pickles to ``"<dynamic-code>"`` (for reproducible payloads), so a remote
traceback read ``File "<dynamic-code>", line 6, in boom`` with no source line: the user could
not tell where their own code failed. aiorl does better than that, whatever cloudpickle's
version:

* **Code objects travel whole.** `CodePickler` reduces a code object to its
  `marshal` bytes (what a ``.pyc`` file holds), which keep ``co_filename`` and the line
  table of it and of every nested function. Driver and workers run the same Python (cloudpickle's
  own code reduction needs that too), so marshal's version-specific format is no restriction.
* **Source lines travel with a class: those of its code, nothing else.**
  `dumps_with_sources` also carries, for each file whose code it pickled, the lines of that
  code (as the driver's `linecache` sees them, which includes notebook cells): from each
  function's first line (its decorators, its ``def``) to its last, nested functions
  included. Every other line of the file travels blank, so line numbers hold. A traceback
  needs no more, and the rest of the driver's script (other functions, constants such as a
  token the class never uses) stays in the driver: a worker that runs another user's class
  sees only that class's code. `loads_with_sources` lends the text to the receiver's
  `linecache` when the file is not on its disk: a worker on another node formats a
  traceback with the user's failing line.

The codec (`aiorl.transport.serialization`) uses the same pickler when plain pickle gives
up (lambdas and local classes in arguments), so their code keeps its file name too.
"""

from __future__ import annotations

import io
import linecache
import marshal
import os
import pickle
import types
from typing import Any

import cloudpickle

__all__ = ["CodePickler", "dumps_with_sources", "loads_with_sources"]

#: Source text larger than this is not carried (a traceback then shows the file and line
#: number without the text, as Python does for a file it cannot read).
MAX_SOURCE_BYTES = 1 << 20


def _code_from_marshal(data: bytes) -> types.CodeType:
    code = marshal.loads(data)
    if not isinstance(code, types.CodeType):  # a corrupted or hostile payload
        raise pickle.UnpicklingError(f"expected a code object, got {type(code).__name__}")
    return code


class CodePickler(cloudpickle.CloudPickler):  # type: ignore[misc]  # untyped base
    """cloudpickle, with code objects carried whole: file name, line table, nested code.

    ``code_lines`` collects, by file name, the line numbers of the code objects it pickled
    (each from its first line to its last, nested code included).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.code_lines: dict[str, set[int]] = {}

    @property
    def code_files(self) -> set[str]:
        """The file names of the code objects it pickled."""
        return set(self.code_lines)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:
            _note_lines(obj, self.code_lines)
            return _code_from_marshal, (marshal.dumps(obj),)
        return super().reducer_override(obj)


def _note_lines(code: types.CodeType, into: dict[str, set[int]]) -> None:
    """Add the lines ``code`` spans (first line to last) and those of its nested code."""
    numbers = [line for _start, _end, line in code.co_lines() if line is not None]
    last = max(numbers, default=code.co_firstlineno)
    into.setdefault(code.co_filename, set()).update(range(code.co_firstlineno, last + 1))
    for const in code.co_consts:
        if type(const) is types.CodeType:
            _note_lines(const, into)


def _source_text(filename: str, wanted: set[int]) -> str | None:
    """The ``wanted`` lines of what the driver's linecache has for ``filename``, every
    other line blank (so numbers hold), up to the last wanted one (None if there is no
    text, or the result is too large)."""
    lines = linecache.getlines(filename)
    if not lines or not wanted:
        return None
    end = min(len(lines), max(wanted))
    text = "".join(lines[i - 1] if i in wanted else "\n" for i in range(1, end + 1))
    return text if len(text) <= MAX_SOURCE_BYTES else None


def dumps_with_sources(obj: Any) -> bytes:
    """Pickle ``obj`` by `CodePickler`, with the source of each file its code came from."""
    stream = io.BytesIO()
    pickler = CodePickler(stream, protocol=5)
    pickler.dump(obj)
    sources = {f: text for f, wanted in sorted(pickler.code_lines.items())
               if (text := _source_text(f, wanted)) is not None}
    return pickle.dumps((stream.getvalue(), sources), protocol=5)


def loads_with_sources(data: bytes) -> Any:
    """Inverse of `dumps_with_sources`.

    A carried source whose file this machine lacks is lent to `linecache` (never in place
    of a file on disk, which is what this process runs)."""
    inner, sources = pickle.loads(data)
    for filename, text in sources.items():
        if not os.path.exists(filename):
            # mtime None: linecache.checkcache keeps the entry (as for a loader's source).
            linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    return pickle.loads(inner)
