"""How a worker's launch environment joins the environment of the node it starts on.

A node group's ``env_configs`` (and ``launch(env=...)``) set variables for its
workers. Most of them simply replace what the node has. Path lists are different: a
user who writes ``PYTHONPATH: /opt/extra`` wants that directory *added* in front of
the node's own entries, not the node's Python packages gone. So, as in RLinf, the
variables in `PATH_LIKE_ENV_VARS` are merged: the launch entries first, then
the node's, each entry once. ``AIORL_PATH_ENV_MERGE_MODE=override`` (RLinf's
``RLINF_PATH_ENV_MERGE_MODE``) replaces them like any other variable instead; the
mode is read from the launch environment first (an ``env_configs`` entry), then from
the node's (the node agent's environment; an embedded cluster's agents inherit the
driver's). ``AIORL_PATH_LIKE_ENV_VARS=A,B`` adds names to the merged set.

The merge runs in the worker process itself, against the environment it inherited,
because only the node knows its own ``PATH``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

__all__ = [
    "MERGE_MODE_VAR",
    "MERGE_MODES",
    "PATH_LIKE_ENV_VARS",
    "merge_environment",
    "merge_path_list",
    "path_env_merge_mode",
]

log = logging.getLogger("aiorl.node")

#: Colon-separated search paths: RLinf's list, plus the ones a CUDA/ROCm or robotics
#: environment commonly extends (headers, man and info pages, XDG data, plugins).
PATH_LIKE_ENV_VARS = frozenset({
    "PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "LIBRARY_PATH", "DYLD_LIBRARY_PATH",
    "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "CMAKE_PREFIX_PATH", "PKG_CONFIG_PATH",
    "MANPATH", "INFOPATH", "XDG_DATA_DIRS", "GST_PLUGIN_PATH", "MUJOCO_PLUGIN_PATH",
    "CUDA_PLUGIN_PATH", "ROCM_LIBRARY_PATH", "HIP_LIBRARY_PATH",
})
MERGE_MODE_VAR = "AIORL_PATH_ENV_MERGE_MODE"
EXTRA_PATH_VARS_VAR = "AIORL_PATH_LIKE_ENV_VARS"
#: ``append`` (RLinf's name and default: the launch entries are added, in front) or
#: ``override`` (they replace the node's value).
MERGE_MODES = ("append", "override")


def path_env_merge_mode(launch: Mapping[str, str], inherited: Mapping[str, str]) -> str:
    """The merge mode in force: the launch environment's, else the node's, else
    ``append``. An unknown value is logged and treated as ``append`` (RLinf does the
    same: a typo must not wipe a worker's ``PATH``)."""
    raw = launch.get(MERGE_MODE_VAR, inherited.get(MERGE_MODE_VAR, "append"))
    mode = raw.strip().lower()
    if mode not in MERGE_MODES:
        log.error("%s=%r is not one of %s; merging path lists (append)", MERGE_MODE_VAR, raw,
                  ", ".join(MERGE_MODES))
        return "append"
    return mode


def merge_path_list(incoming: str, existing: str) -> str:
    """``incoming``'s entries, then ``existing``'s, each once, empty entries dropped:
    ``merge_path_list("/new:/a", "/a:/b") == "/new:/a:/b"``."""
    entries = [e for e in incoming.split(os.pathsep) + existing.split(os.pathsep) if e]
    return os.pathsep.join(dict.fromkeys(entries))


def merge_environment(launch: Mapping[str, str], inherited: Mapping[str, str]) -> dict[str, str]:
    """The values to set for ``launch``'s variables on top of ``inherited`` (the node's
    environment); variables ``launch`` does not name are left alone by the caller."""
    mode = path_env_merge_mode(launch, inherited)
    path_like = PATH_LIKE_ENV_VARS | {
        name.strip()
        for name in launch.get(EXTRA_PATH_VARS_VAR, inherited.get(EXTRA_PATH_VARS_VAR, ""))
        .split(",") if name.strip()
    }
    merged: dict[str, str] = {}
    for key, value in launch.items():
        if mode == "append" and key in path_like and inherited.get(key):
            merged[key] = merge_path_list(value, inherited[key])
        else:
            merged[key] = value
    return merged
