"""Entry point of a worker started by exec rather than forked from the zygote.

A worker that runs under a profiler (``nsys profile ... python -m
aiorl.node.exec_worker FD``) or with a node group's own ``python_interpreter_path``
must be a new program: a forked zygote child is the zygote's interpreter, already
running, which no profiler can wrap. The zygote still forks it (so it gets the same
session, process group, parent-death signal and log file as any worker), then the
child execs this module. Its spawn spec and the cluster keys arrive in the memory
file ``FD`` (a memfd the child wrote before exec), never in argv or the environment,
which other users of the machine can read.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys

from aiorl.node.zygote import set_parent_death_signal, working_directory_last

__all__ = ["main"]


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m aiorl.node.exec_worker FD (started by the aiorl zygote)",
              file=sys.stderr)
        return 2
    fd = int(args[0])
    try:
        data = _read_all(fd)
    finally:
        os.close(fd)
    spec, keys, listen = pickle.loads(data)
    # exec keeps the parent-death signal, but a profiler in between is our parent now:
    # ask again so this process dies with whatever started it.
    set_parent_death_signal(signal.SIGKILL)
    from aiorl.actors import worker_process

    return worker_process.run(spec, keys=keys, listen=listen)


if __name__ == "__main__":
    # Installed modules win over what lies in the working directory, which stays importable
    # (before any user code is imported: the preload, the worker class).
    working_directory_last()
    sys.exit(main())
