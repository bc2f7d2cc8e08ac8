"""Which method names a worker class may not use, and the one error that lists them all.

Two kinds of name are refused when a group is described (``Worker.create_group``):

* a public method that a [`WorkerGroup`][aiorl.WorkerGroup] attribute of the same name would
  hide: ``group.close()`` reaches the group, never the workers, so the method could not be
  called through the group at all;
* a method that re-defines the worker base class's own API (``send``, ``recv``,
  ``create_group``, ...): aiorl calls that API itself (a peer's ``send`` lands in ``recv``),
  so a method named ``send`` by accident breaks messaging far from its cause.

A framework that re-defines the API on purpose (a compatibility layer whose ``send`` keeps
another default and calls ``super().send``) marks the method with PEP 698's ``@override``;
such a definition is accepted. Both ``typing.override`` (Python 3.12+) and
``typing_extensions.override`` set ``__override__ = True`` on what they decorate, so the
marker is read from that attribute: either spelling works and aiorl depends on neither.

Every refused name is reported in one error, so a class is fixed in one pass rather than one
kind of mistake per attempt.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["check_method_names", "is_marked_override", "shadowed_api"]


def is_marked_override(attribute: object) -> bool:
    """Whether a class attribute carries PEP 698's ``@override`` marker.

    The marker may sit on the attribute itself (``@override`` above ``@classmethod`` or
    ``@staticmethod``, which accept attributes on 3.10+) or on the function it wraps
    (``@classmethod`` above ``@override``; a ``property``'s getter, since a property object
    takes no attributes and ``@override`` above ``@property`` silently marks nothing).
    """
    for candidate in (attribute, getattr(attribute, "__func__", None),
                      getattr(attribute, "fget", None)):
        if candidate is not None and getattr(candidate, "__override__", False) is True:
            return True
    return False


def shadowed_api(cls: type, base: type) -> list[str]:
    """The public names of ``base`` (the framework's worker class) that ``cls`` re-defines.

    Only the definition that wins in ``cls``'s MRO counts. It is allowed when it comes from
    aiorl itself (an aiorl subclass such as PollingWorker refines the base) or when it is
    marked with ``@override`` (a deliberate re-definition).
    """
    if base is object:
        return []
    shadowed = []
    for name in dir(base):
        if name.startswith("_"):
            continue
        owner = next((c for c in cls.__mro__ if name in vars(c)), base)
        if owner.__module__.startswith("aiorl."):
            continue
        if is_marked_override(vars(owner)[name]):
            continue
        shadowed.append(name)
    return sorted(shadowed)


def _group_clashes(cls: type, base: type, group_attributes: Collection[str]) -> list[str]:
    # ``base``'s own attributes may share a name with a group attribute on purpose
    # (``world_size``); only what ``cls`` adds or replaces can clash.
    return sorted(
        n for n in dir(cls)
        if not n.startswith("_") and n in group_attributes
        and callable(getattr(cls, n, None)) and getattr(cls, n) is not getattr(base, n, None)
    )


def _listing(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " and " + names[-1]


def check_method_names(cls: type, base: type, group_attributes: Collection[str]) -> None:
    """Raise one ``ValueError`` naming every method of ``cls`` that a group would hide or that
    re-defines ``base``'s API without ``@override``; do nothing when there is none.

    Args:
        cls: The worker class being described.
        base: The framework class ``cls`` derives from (``aiorl.Worker``), or ``object``.
        group_attributes: The public attribute names of ``WorkerGroup``.

    Raises:
        ValueError: With one sentence per kind of problem, each naming its methods and
            what to do.
    """
    clashes = _group_clashes(cls, base, group_attributes)
    shadowed = shadowed_api(cls, base)
    sentences = []
    if clashes:
        one = len(clashes) == 1
        sentences.append(
            f"{_listing(clashes)}, which {'clashes' if one else 'clash'} with "
            f"{'a WorkerGroup attribute' if one else 'WorkerGroup attributes'} of the same "
            f"name (a call on the group would reach the group, never the workers); rename "
            f"{'it' if one else 'them'}"
        )
    if shadowed:
        one = len(shadowed) == 1
        sentences.append(
            f"{_listing(shadowed)}, which {'shadows' if one else 'shadow'} aiorl."
            f"{base.__qualname__}'s own API of the same name (aiorl itself calls it, e.g. "
            f"send and recv carry messages between workers); rename {'it' if one else 'them'}, "
            f"or mark {'it' if one else 'each'} with @typing.override if you mean it "
            f"(typing_extensions.override before Python 3.12) and call super()"
        )
    if sentences:
        raise ValueError(f"{cls.__name__} defines " + "; it also defines ".join(sentences))
