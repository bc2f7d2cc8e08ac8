"""Typed hardware: a registry of hardware types, each with a config schema (a dataclass).

A node group that declares ``hardware: {type: Franka, configs: [...]}`` gets one
config object per unit, built from the schema registered for ``Franka``: required
fields must be given, unknown fields are rejected, so a typo such as ``robot_pi``
fails when the config is read instead of when a robot does not answer. Types nobody
registered stay usable as *custom* hardware with free-form fields (aiorl accepted
them before the registry existed, and a config that only counts units needs no
schema).

Register your own type with `register_hardware`::

    @register_hardware("ur5", kind="robot")
    @dataclass
    class UR5Config(HardwareConfig):
        robot_ip: str                  # required: no default
        payload_kg: float = 0.0

Type names are matched without regard to case (``franka`` finds ``Franka``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiorl.errors import PlacementError

__all__ = [
    "HARDWARE_KINDS",
    "CustomHardwareConfig",
    "FrankaConfig",
    "HardwareConfig",
    "HardwareType",
    "NodeHardware",
    "build_hardware_config",
    "get_hardware_type",
    "hardware_types",
    "register_hardware",
]

#: What a registered type is, for people and for ``aiorl plan``; placement counts
#: units the same way whatever the kind.
HARDWARE_KINDS = ("robot", "accelerator", "custom")


@dataclass
class HardwareConfig:
    """Base of every hardware schema: the unit's node. Subclasses add their fields;
    a field without a default is required."""

    node_rank: int

    def __post_init__(self) -> None:
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int):
            raise PlacementError(
                f"'node_rank' in a hardware config must be an integer, got {self.node_rank!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain mapping (what the YAML said, defaults filled in)."""
        return dataclasses.asdict(self)


@dataclass
class CustomHardwareConfig(HardwareConfig):
    """A unit of a hardware type with no registered schema: its other fields, as given."""

    fields: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"node_rank": self.node_rank, **self.fields}


@dataclass(frozen=True)
class HardwareType:
    """A registered hardware type: its name as registered, kind and schema."""

    name: str
    kind: str
    config_class: type[HardwareConfig]

    @property
    def required_fields(self) -> list[str]:
        return [
            f.name
            for f in dataclasses.fields(self.config_class)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]

    @property
    def known_fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.config_class)]


_REGISTRY: dict[str, HardwareType] = {}
_C = TypeVar("_C", bound=type[HardwareConfig])


def register_hardware(name: str, kind: str = "custom") -> Callable[[_C], _C]:
    """Class decorator: register a `HardwareConfig` dataclass as the schema of
    hardware type ``name``.

    Raises:
        PlacementError: an unknown ``kind``, a name already registered (case-insensitive),
            a reserved name, or a class that is not a HardwareConfig dataclass.
    """
    if kind not in HARDWARE_KINDS:
        raise PlacementError(
            f"hardware kind {kind!r} is unknown; expected one of {', '.join(HARDWARE_KINDS)}"
        )
    key = str(name).strip().lower()
    if not key or key in ("accelerator", "node"):
        raise PlacementError(f"hardware type name {name!r} is empty or reserved")

    def decorate(cls: _C) -> _C:
        if not (isinstance(cls, type) and issubclass(cls, HardwareConfig)
                and dataclasses.is_dataclass(cls)):
            raise PlacementError(
                f"hardware type {name!r}: {cls!r} must be a dataclass deriving from HardwareConfig"
            )
        if key in _REGISTRY:
            raise PlacementError(
                f"hardware type {name!r} is already registered (as {_REGISTRY[key].name!r})"
            )
        _REGISTRY[key] = HardwareType(str(name).strip(), kind, cls)
        return cls

    return decorate


def get_hardware_type(name: str) -> HardwareType | None:
    """The registered type called ``name`` (any case), or None for custom hardware."""
    return _REGISTRY.get(str(name).strip().lower())


def hardware_types() -> list[HardwareType]:
    """Every registered type, in registration order."""
    return list(_REGISTRY.values())


def build_hardware_config(type_name: str, raw: Mapping[str, Any], where: str) -> HardwareConfig:
    """One unit's config object from its YAML mapping, checked against the type's schema.

    Raises:
        PlacementError: ``raw`` is not a mapping, lacks a required field, has a field the
            schema does not know, or a field value the schema rejects. The message starts
            with ``where``, then RLinf's words, then names the fields.
    """
    if not isinstance(raw, Mapping):
        raise PlacementError(
            f"{where}: Each hardware config must be a dictionary. But got {type(raw)}: {raw}"
        )
    values = {str(k): v for k, v in raw.items()}
    hw_type = get_hardware_type(type_name)
    if hw_type is None:
        if "node_rank" not in values:
            raise PlacementError(f"{where}: {_missing_text(['node_rank'], values)}")
        node_rank = values.pop("node_rank")
        return _construct(CustomHardwareConfig, {"node_rank": node_rank, "fields": values}, where)
    missing = [name for name in hw_type.required_fields if name not in values]
    if missing:
        raise PlacementError(
            f"{where}: {_missing_text(missing, values)} Hardware type {hw_type.name!r} "
            f"requires {', '.join(hw_type.required_fields)}"
        )
    unknown = sorted(set(values) - set(hw_type.known_fields))
    if unknown:
        raise PlacementError(
            f"{where}: Unknown fields '{_set_text(unknown)}' detected {_SUFFIX}. Valid fields "
            f"are: {_set_text(hw_type.known_fields)}. Hardware type {hw_type.name!r} has no "
            f"field {', '.join(unknown)}"
        )
    return _construct(hw_type.config_class, values, where)


# RLinf's words for where a hardware config field check failed.
_SUFFIX = "in cluster node_group hardware yaml config"


def _missing_text(missing: list[str], values: dict[str, Any]) -> str:
    return f"Missing fields '{missing}' detected {_SUFFIX}. Only got: {values.keys()}."


def _set_text(names: list[str]) -> str:
    """A set of names written as Python writes a set, in a stable order."""
    return "{" + ", ".join(repr(n) for n in names) + "}"


def _construct(cls: type[HardwareConfig], values: dict[str, Any], where: str) -> HardwareConfig:
    try:
        return cls(**values)
    except PlacementError as exc:
        raise PlacementError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:  # a schema's own validation
        raise PlacementError(f"{where}: {exc}") from None


@dataclass
class NodeHardware:
    """A node group's ``hardware`` section, typed: the type name and one config per unit,
    in unit order (RLinf's ``NodeHardwareConfig``)."""

    type: str
    configs: list[HardwareConfig]

    @property
    def kind(self) -> str:
        """``robot``, ``accelerator`` or ``custom`` (unregistered types are custom)."""
        hw_type = get_hardware_type(self.type)
        return hw_type.kind if hw_type is not None else "custom"

    def on_node(self, node_rank: int) -> list[HardwareConfig]:
        """The units on ``node_rank``, in unit order."""
        return [c for c in self.configs if c.node_rank == node_rank]


@register_hardware("Franka", kind="robot")
@dataclass
class FrankaConfig(HardwareConfig):
    """A Franka arm, with RLinf's fields; ``robot_ip`` may stay unset (found later)."""

    robot_ip: str | None = None
    camera_serials: list[str] | None = None
    camera_type: str = "realsense"
    gripper_type: str = "franka"
    gripper_connection: str | None = None
    controller_node_rank: int | None = None
    disable_validate: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.robot_ip is not None:
            try:
                ipaddress.ip_address(str(self.robot_ip))
            except ValueError:
                raise PlacementError(
                    f"'robot_ip' in a Franka config must be an IP address, got {self.robot_ip!r}"
                ) from None
        if self.camera_serials is not None:
            self.camera_serials = [str(s) for s in self.camera_serials]
