"""A node agent's cache of drivers' working directories (`aiorl.runtime.working_dir`).

Each entry is one unpacked archive, named by its SHA-256 digest, under the agent's private
log directory (``<log dir>/working_dirs/<digest>``): a second job with the same code finds it
there and nothing is sent or unpacked again. An entry is in use while a worker of a group
that named it runs on this node; when its job ends it stays, for the next job, among the
`KEEP_UNUSED` most recently used unused entries, and older unused ones are removed when a
new directory arrives (entries left by an earlier, killed agent in a kept ``--log-dir`` count
as the oldest unused ones). The whole cache goes when the agent stops (it is only a cache:
the drivers hold the originals), so what a node keeps is bounded.

The workers of a group that names a directory get it first on ``PYTHONPATH`` (so modules
there win over same-named ones elsewhere, as the driver saw them), its path in
``AIORL_WORKING_DIR``, and, when the driver asked, as their current directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import shutil
import time
from collections.abc import Callable

from aiorl.errors import WorkingDirError
from aiorl.protocol.spawn import SpawnRequest, WorkerLaunch
from aiorl.protocol.working_dir import MAX_ARCHIVE_BYTES, WorkingDirOffer, WorkingDirReply
from aiorl.runtime.working_dir import unpack
from aiorl.transport.endpoint import Incoming

__all__ = ["KEEP_UNUSED", "WORKING_DIR_VARIABLE", "WorkingDirCache"]

log = logging.getLogger("aiorl.node")

#: Unused entries kept for a later job with the same code (the most recently used ones).
KEEP_UNUSED = 4
#: Set in a worker of a group with a shipped working directory: the node's copy.
WORKING_DIR_VARIABLE = "AIORL_WORKING_DIR"

_DIGEST = re.compile(r"[0-9a-f]{64}")


class WorkingDirCache:
    """The agent's working-directory cache: answers ``working_dir`` offers and prepares the
    launches of spawn requests that name a directory.

    Args:
        root: The cache directory (created on first use, removed by `close`).
        live_groups: Returns the groups that have a worker on this node now.
    """

    def __init__(self, root: str, live_groups: Callable[[], set[str]]) -> None:
        self.root = root
        self._live_groups = live_groups
        #: digest -> the groups that named it (pruned to the live ones when evicting).
        self._users: dict[str, set[str]] = {}
        self._last_used: dict[str, float] = {}
        #: Unpacks in progress, by digest: a second offer of one waits for the first.
        self._unpacking: dict[str, asyncio.Future[None]] = {}
        self._adopted = False

    def path_of(self, digest: str) -> str:
        return os.path.join(self.root, digest)

    def holds(self, digest: str) -> bool:
        return digest not in self._unpacking and os.path.isdir(self.path_of(digest))

    # ------------------------------------------------------------------ offers
    def on_offer(self, msg: Incoming) -> None:
        """``working_dir``: answer ``cached`` at once when held (or when no archive came);
        otherwise unpack the archive off the loop and answer when it is in place."""
        offer = WorkingDirOffer.from_wire(msg.meta)  # ProtocolError: answered by the endpoint
        if self.holds(offer.digest):
            self._last_used[offer.digest] = time.monotonic()
            msg.reply(WorkingDirReply(True).to_wire())
            return
        if not msg.frames and offer.digest not in self._unpacking:
            msg.reply(WorkingDirReply(False).to_wire())
            return
        data = bytes(msg.frames[0]) if msg.frames else b""
        task = asyncio.get_running_loop().create_task(self._receive(offer, data))

        def answer(t: asyncio.Task[None]) -> None:
            if t.cancelled():
                return
            error = t.exception()
            if error is not None:
                msg.reply_error(error)
            else:
                msg.reply(WorkingDirReply(True).to_wire())

        task.add_done_callback(answer)

    async def _receive(self, offer: WorkingDirOffer, data: bytes) -> None:
        pending = self._unpacking.get(offer.digest)
        if pending is not None:
            await asyncio.shield(pending)
            return
        if len(data) != offer.size:
            raise WorkingDirError(f"working directory {offer.digest[:12]}: {len(data)} bytes "
                                  f"arrived, the offer said {offer.size}")
        if not self._adopted:  # the first archive, before any unpack runs in a thread
            self._adopted = True
            self._adopt_leftovers()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._unpacking[offer.digest] = fut
        try:
            await asyncio.to_thread(unpack, data, offer.digest, self.path_of(offer.digest),
                                    min(offer.unpacked, MAX_ARCHIVE_BYTES))
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: a waiting offer re-raises it
            raise
        finally:
            del self._unpacking[offer.digest]
        self._last_used[offer.digest] = time.monotonic()
        self._evict()  # the new entry counts as the most recently used
        log.info("working directory %s cached (%d bytes packed)", offer.digest[:12], offer.size)
        fut.set_result(None)

    # ------------------------------------------------------------------ spawning
    def prepare(self, request: SpawnRequest) -> SpawnRequest:
        """``request`` with each launch given its working directory; unchanged when it names
        none. Raises `WorkingDirError` when the named directory is not here."""
        digest = request.working_dir
        if digest is None:
            return request
        if not self.holds(digest):
            raise WorkingDirError(
                f"group {request.group}: working directory {digest[:12]} is not on this node "
                "(the driver sends it before the spawn; the agent may have restarted): launch "
                "again")
        self._users.setdefault(digest, set()).add(request.group)
        self._last_used[digest] = time.monotonic()
        path = self.path_of(digest)
        launches = tuple(self._launch_in(launch, path, request.working_dir_chdir)
                         for launch in request.workers)
        return dataclasses.replace(request, workers=launches)

    @staticmethod
    def _launch_in(launch: WorkerLaunch, path: str, chdir: bool) -> WorkerLaunch:
        env = dict(launch.env)
        # First on PYTHONPATH, before the group's own entries (env_configs); the zygote puts
        # the launch's PYTHONPATH ahead of everything on a forked worker's sys.path.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (path, env.get("PYTHONPATH"))))
        env[WORKING_DIR_VARIABLE] = path
        return dataclasses.replace(launch, env=env, cwd=path if chdir else launch.cwd)

    # ------------------------------------------------------------------ cleaning up
    def _adopt_leftovers(self) -> None:
        """Entries an earlier agent left in this directory (it was killed, and ``--log-dir``
        is kept) count as unused and oldest; its half-unpacked staging directories go."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith(".unpack-"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            elif _DIGEST.fullmatch(name) and name not in self._last_used:
                self._last_used[name] = 0.0

    def _evict(self) -> None:
        """Remove unused entries beyond the `KEEP_UNUSED` most recently used."""
        live = self._live_groups()
        unused = []
        for digest in list(self._last_used):
            users = self._users.get(digest, set()) & live
            self._users[digest] = users
            if not users and digest not in self._unpacking:
                unused.append(digest)
        unused.sort(key=lambda d: self._last_used[d], reverse=True)
        for digest in unused[KEEP_UNUSED:]:
            shutil.rmtree(self.path_of(digest), ignore_errors=True)
            self._last_used.pop(digest, None)
            self._users.pop(digest, None)
            log.info("working directory %s removed from the cache (unused)", digest[:12])

    def close(self) -> None:
        """Remove the whole cache (the agent is stopping)."""
        shutil.rmtree(self.root, ignore_errors=True)
