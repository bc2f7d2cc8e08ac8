"""Which running cluster a command of ``aiorl`` looks at, and with which keys."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["resolve_target"]


def resolve_target(args: argparse.Namespace) -> tuple[str, Any, str | None] | None:
    """Where ``aiorl status`` (and every command that looks at a running cluster) looks:
    (registry address, keys, host to bind on).

    ``--registry`` or ``$AIORL_REGISTRY`` (keys from ``--key-file``, else as every aiorl
    process finds them); otherwise this user's running embedded cluster in process
    ``--pid`` when given, else the newest, found through its runtime file. None (after saying
    why, in one line) when there is nothing to look at, or the address is not one
    (`normalize_address`: ``HOST:PORT`` means ``tcp://HOST:PORT``).
    """
    from aiorl.cluster.embedded import running_embedded_clusters
    from aiorl.errors import AddressError
    from aiorl.transport import security
    from aiorl.transport.address import normalize_address

    address = args.registry or os.environ.get("AIORL_REGISTRY")
    if address:
        try:
            address = normalize_address(address, "--registry" if args.registry
                                        else "$AIORL_REGISTRY")
        except AddressError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return None
        keys = (security.ClusterKeys.load(args.key_file) if args.key_file
                else security.keys_from_environment())
        return address, keys, None
    embedded = running_embedded_clusters()
    pid = getattr(args, "pid", None)
    if pid is not None:
        embedded = [e for e in embedded if e.pid == pid]
        if not embedded:
            print(f"error: no embedded aiorl.Cluster() of this user runs in process {pid}",
                  file=sys.stderr)
            return None
    if not embedded:
        print("error: no registry address (use --registry or set AIORL_REGISTRY) and no "
              "embedded aiorl.Cluster() of this user is running", file=sys.stderr)
        return None
    newest = embedded[0]
    if len(embedded) > 1:
        others = ", ".join(str(e.pid) for e in embedded[1:])
        print(f"({len(embedded)} embedded clusters are running; showing driver pid "
              f"{newest.pid}'s; the others' drivers: {others}; choose with --pid)",
              file=sys.stderr)
    keys = security.ClusterKeys.load(newest.key_file) if newest.key_file else None
    return newest.registry, keys, f"ipc://{newest.session_dir}"
