"""The ``profiling:`` section: which worker processes start under a profiler, and how.

Two backends, as in RLinf:

* ``nsys`` (alias ``nsight``, RLinf's name): the worker runs as
  ``nsys profile [--flag...] [--option=value...] -o PREFIX PYTHON -m ...``;
* ``rocprof-sys`` (alias ``rocprof_sys``): ``rocprof-sys-python [-k v | --key=v...] --
  PYTHON -m ...``, with ``ROCPROFSYS_OUTPUT_PATH``/``ROCPROFSYS_OUTPUT_PREFIX`` set.

The section sits at the top of the cluster config (RLinf's place; ``worker_groups``
names the groups to profile, ``all`` for every one) or inside one node group (then
every worker placed through that group is profiled unless ``worker_groups`` narrows
it). ``steps: [5, 10]`` asks for step-gated capture: nsys then gets
``--capture-range=cudaProfilerApi --capture-range-end=stop`` unless the options say
otherwise, and the worker finds the steps in ``AIORL_PROFILE_STEPS`` to call
``torch.cuda.profiler.start()/stop()`` around them.

Everything is checked when the config is read (``aiorl plan`` shows errors offline).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiorl.errors import PlacementError

__all__ = ["BACKENDS", "ProfilerLaunch", "ProfilingConfig", "parse_profiling"]

#: Accepted backend names -> the canonical one.
BACKENDS = {"nsys": "nsys", "nsight": "nsys", "rocprof-sys": "rocprof-sys",
            "rocprof_sys": "rocprof-sys"}

_KEYS = ("backend", "enabled", "worker_groups", "steps", "output_dir", "options", "flags",
         "args", "env")
_NSYS_ONLY = ("options", "flags")
_ROCPROF_ONLY = ("args", "env")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@dataclass(frozen=True)
class ProfilerLaunch:
    """How to start one worker under the profiler: the command before the Python
    interpreter, and the environment the profiler needs."""

    argv: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ProfilingConfig:
    """A parsed ``profiling:`` section. Build it with `parse_profiling`.

    Attributes:
        backend: ``"nsys"`` or ``"rocprof-sys"``.
        enabled: False keeps the section but profiles nothing.
        worker_groups: group names to profile (``"all"`` matches every group, case is
            ignored); ``None`` means every group for a node-group section and none for
            the cluster-level section (RLinf's rule).
        steps: step indices to capture, or ``None`` for the whole run.
        output_dir: where reports go (default: the system temporary directory).
        options: nsys ``--name=value`` options (one-letter names become ``-n value``).
        flags: nsys bare flags (``--name``).
        args: rocprof-sys arguments, rendered like ``options``.
        env: extra environment for profiled workers (rocprof-sys reads its settings there).
        applies_to_all: whether ``worker_groups=None`` means every group.
    """

    backend: str
    enabled: bool = True
    worker_groups: list[str] | None = None
    steps: list[int] | None = None
    output_dir: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    applies_to_all: bool = False

    def profiles(self, group_name: str) -> bool:
        """Whether workers of the group called ``group_name`` run under the profiler."""
        if not self.enabled:
            return False
        if self.worker_groups is None:
            return self.applies_to_all
        wanted = {g.lower() for g in self.worker_groups}
        return "all" in wanted or group_name.lower() in wanted

    def should_profile_step(self, step: int) -> bool:
        """Whether ``step`` is one to capture (every step when ``steps`` is None)."""
        return self.enabled and (self.steps is None or step in self.steps)

    def to_cli_tokens(self, default_output_prefix: str | None = None) -> list[str]:
        """The profiler's own command-line tokens (RLinf's ``to_cli_tokens``).

        nsys: the ``nsys profile`` options alone, flags first (``--name``, or ``-n`` for a
        one-letter name), then options (``--name=value``, or ``-n value``); with
        ``default_output_prefix``, ``-o PREFIX`` is added unless the options name an
        output (``o`` or ``output``). rocprof-sys: ``rocprof-sys-python``, its
        arguments and ``--`` (RLinf's ``RocprofSysConfig.to_cli_tokens``); the prefix
        does not apply, rocprof-sys takes its output place from the environment.
        """
        if self.backend != "nsys":
            return ["rocprof-sys-python", *_render(self.args), "--"]
        options = dict(self.options)
        if default_output_prefix is not None and "o" not in options and "output" not in options:
            options["o"] = default_output_prefix
        return [*(_flag(f) for f in self.flags), *_render(options)]

    def launch(self, worker_name: str) -> ProfilerLaunch:
        """The command prefix and environment for the worker called ``worker_name``."""
        output_dir = self.output_dir or tempfile.gettempdir()
        safe_name = re.sub(r"[^A-Za-z0-9._-]", "_", worker_name)
        prefix = os.path.join(output_dir, f"aiorl_profile_{safe_name}_%p")
        env = {"AIORL_PROFILER": self.backend, "AIORL_PROFILE_OUTPUT_DIR": output_dir}
        if self.steps is not None:
            env["AIORL_PROFILE_STEPS"] = ",".join(map(str, self.steps))
        if self.backend == "nsys":
            argv = ["nsys", "profile", *self.to_cli_tokens(prefix)]
        else:
            argv = self.to_cli_tokens()
            env["ROCPROFSYS_OUTPUT_PATH"] = output_dir
            env["ROCPROFSYS_OUTPUT_PREFIX"] = f"aiorl_profile_{safe_name}_"
        env.update(self.env)  # the user's settings win
        return ProfilerLaunch(tuple(argv), env)


def _flag(name: str) -> str:
    return f"--{name}" if len(name) > 1 else f"-{name}"


def _render(options: Mapping[str, str]) -> list[str]:
    tokens: list[str] = []
    for name, value in options.items():
        if len(name) > 1:
            tokens.append(f"--{name}={value}")
        else:
            tokens.extend([f"-{name}", value])
    return tokens


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# RLinf's name for the config class that owns each mapping, for its messages.
_OWNER = {"options": "Nsight", "args": "RocprofSys", "env": "RocprofSys"}


def _mapping(value: Any, name: str, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PlacementError(
            f"{where}: {_OWNER[name]} {name} must be a dictionary in cluster profiling config. "
            f"But got {type(value)}: {value}; give a mapping of names to values")
    out: dict[str, str] = {}
    for key, item in value.items():
        key_text = str(key).strip()
        if not key_text:
            raise PlacementError(f"{where}: {name} has an empty name")
        if item is None:
            raise PlacementError(f"{where}: {name} entry {key_text!r} has no value")
        out[key_text] = _text(item)
    return out


def _names(value: Any, name: str, where: str) -> list[str] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Sequence) or isinstance(items, (bytes, Mapping)):
        raise PlacementError(f"{where}: {name} must be a string or a list of strings, got {value!r}")
    names = [str(v).strip() for v in items]
    if any(not n for n in names):
        raise PlacementError(f"{where}: {name} has an empty entry")
    return names


def parse_profiling(raw: Any, where: str = "profiling", *, applies_to_all: bool = False
                    ) -> ProfilingConfig | None:
    """Parse a ``profiling:`` mapping (``None`` gives ``None``).

    Args:
        raw: the section.
        where: prefix of error messages (``"node group 'gpu' profiling"``).
        applies_to_all: what ``worker_groups`` left out means (see `ProfilingConfig`).

    Raises:
        PlacementError: not a mapping, unknown key, missing or unknown backend, a key of
            the other backend, options/args/env that are not mappings, a name given both
            as a flag and as an option, ``stop-on-range-end`` beside ``capture-range-end``,
            ``o`` beside ``output``, or steps that are not non-negative integers.
    """
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise PlacementError(f"{where}: expected a mapping, got {raw!r}")
    unknown = sorted(str(k) for k in raw if k not in _KEYS)
    if unknown:
        raise PlacementError(
            f"{where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(_KEYS)}")
    if not raw.get("backend"):
        raise PlacementError(
            f"{where}: backend must be specified: one of {', '.join(sorted(BACKENDS))}")
    name = str(raw["backend"]).strip().lower()
    if name not in BACKENDS:
        raise PlacementError(
            f"{where}: Unknown profiling backend '{raw['backend']}'. Known backends: "
            f"{sorted(BACKENDS)}")
    backend = BACKENDS[name]
    foreign = _ROCPROF_ONLY if backend == "nsys" else _NSYS_ONLY
    misplaced = [k for k in foreign if raw.get(k) is not None]
    if misplaced:
        raise PlacementError(
            f"{where}: {', '.join(misplaced)} belong(s) to the other backend, not {backend}")
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        raise PlacementError(f"{where}: enabled must be true or false, got {enabled!r}")
    config = ProfilingConfig(
        backend=backend,
        enabled=enabled,
        worker_groups=_names(raw.get("worker_groups"), "worker_groups", where),
        steps=_steps(raw.get("steps"), where),
        output_dir=None if raw.get("output_dir") is None else str(raw["output_dir"]),
        options=_mapping(raw.get("options"), "options", where),
        flags=_names(raw.get("flags"), "flags", where) or [],
        args=_mapping(raw.get("args"), "args", where),
        env=_mapping(raw.get("env"), "env", where),
        applies_to_all=applies_to_all,
    )
    if backend == "nsys":
        _normalise_nsys(config, where)
    return config


def _steps(value: Any, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise PlacementError(f"{where}: steps must be a list of integers, got {value!r}")
    steps = []
    for step in value:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise PlacementError(
                f"{where}: steps must be non-negative integers, got {list(value)!r}")
        steps.append(step)
    return steps


def _normalise_nsys(config: ProfilingConfig, where: str) -> None:
    options = config.options
    if "stop-on-range-end" in options:
        if "capture-range-end" in options:
            raise PlacementError(
                f"{where}: Nsight options must not specify both 'stop-on-range-end' and "
                "'capture-range-end'. The first is an alias of the second")
        alias = options.pop("stop-on-range-end").strip().lower()
        options["capture-range-end"] = "stop" if alias in _TRUE else (
            "none" if alias in _FALSE else alias)
    if "o" in options and "output" in options:
        raise PlacementError(
            f"{where}: Nsight options must not specify both 'o' and 'output'. They name "
            "the same setting")
    if config.steps is not None:
        # Without a capture range nsys ignores cudaProfilerStart/Stop and records the
        # whole process, so the step gating would silently do nothing.
        options.setdefault("capture-range", "cudaProfilerApi")
        options.setdefault("capture-range-end", "stop")
    both = sorted(set(config.flags) & set(options))
    if both:
        raise PlacementError(
            f"{where}: Nsight flags and options must not specify the same names. Got "
            f"duplicates: {both}")
