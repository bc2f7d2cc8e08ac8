"""Run a command while busy processes hog the CPUs: ``make test-stress``.

Usage: ``python tests/stress.py [--hogs N] -- COMMAND...``. N processes (default 2, one per
core of the CI machine) spin at full speed for as long as the command runs, so the suite meets
the scheduling delays of a shared machine: a test that only passes when it has the CPUs to
itself fails here. The hogs are stopped however the command ends; the exit status and the wall
time are the command's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=2, help="busy processes to run beside it")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (python tests/stress.py -- COMMAND...)")
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    started = time.monotonic()
    try:
        status = subprocess.call(command)
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()
    print(f"== {' '.join(command)}: exit {status} in {time.monotonic() - started:.0f} s "
          f"beside {args.hogs} busy processes", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
