"""The method registry: name -> drafter class (its options, whether it needs a draft
checkpoint and a Domino head, whether it proposes trees: then only ``match`` verifies it).

To add a method, write its drafter (the contract: :mod:`domino_jax.decode.contract`) and
add one entry to :data:`METHODS`; the CLI's ``--method``, ``load_pair``, ``DecodeConfig``
and ``generate`` pick it up from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from domino_jax.decode.contract import Drafter, NoDrafter
from domino_jax.decode.drafters import DFlashDrafter, DominoDrafter
from domino_jax.decode.ngram import NgramDrafter
from domino_jax.decode.tree_drafters import DDTreeDrafter, DominoLookupDrafter, DominoTreeDrafter

METHODS: dict[str, type[Drafter]] = {cls.method: cls for cls in (
    NoDrafter, NgramDrafter, DFlashDrafter, DominoDrafter, DDTreeDrafter, DominoTreeDrafter,
    DominoLookupDrafter)}


def register_method(cls: type[Drafter]) -> type[Drafter]:
    """Add a drafter class to :data:`METHODS` under ``cls.method`` (usable as a class
    decorator); ``ValueError`` if the name is taken by another class."""
    if METHODS.get(cls.method, cls) is not cls:
        raise ValueError(f"method {cls.method!r} is already registered "
                         f"({METHODS[cls.method].__name__})")
    METHODS[cls.method] = cls
    return cls


def drafter_class(method: str) -> type[Drafter]:
    """The drafter class of ``method``; ``ValueError`` naming the choices otherwise."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return METHODS[method]


def method_options(method: str, options: Any = None, **values) -> Any:
    """The options dataclass of ``method``: ``options`` itself (checked to be of the
    method's type), or built from keyword ``values`` (``ValueError`` naming an option the
    method does not take)."""
    cls = drafter_class(method).Options
    if options is not None:
        if values:
            raise ValueError("give the options either as a dataclass or as keywords, not both")
        if type(options) is not cls:       # a subclass would carry options the method ignores
            raise ValueError(f"method {method!r} takes {cls.__name__}, got "
                             f"{type(options).__name__}")
        return options
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"method {method!r} has no option {', '.join(unknown)} (its options: "
                         f"{', '.join(sorted(names)) or 'none'})")
    return cls(**values)


def make_drafter(draft_config, target, method: str, options: Any = None) -> Drafter:
    """The drafter of ``method`` for a loaded checkpoint (``draft_config`` may be ``None``
    for methods that need none); ``options``: the method's options dataclass (default:
    its defaults)."""
    cls = drafter_class(method)
    if cls.needs_checkpoint and draft_config is None:
        raise ValueError(f"method {method!r} needs a drafter: pass --draft DIR")
    return cls.build(draft_config, target, method_options(method, options))
