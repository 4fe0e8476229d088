"""Python source files of the prompt corpus, each read and parsed once per process.

Code prompts (:mod:`corpus_code`: the functions of a file) and text prompts
(:mod:`corpus_text`: its docstrings and comments) read the same ``.py`` files of the standard
library and of the documentation packages. A module registers what it takes from a parsed
file with :func:`extractor`; :func:`facts` reads and parses a file at its first request, runs
every registered extractor on that one parse, and keeps their results (never the tree) for the
rest of the process, keyed by the file's path, size and modification time.

Contract: an extractor is a pure function of the file's text and its tree, so what a caller
gets does not depend on which caller (or which earlier build in the process) asked first.
Results are shared between callers and must be treated as read-only (extractors return
tuples).
"""

from __future__ import annotations

import ast
import os
from typing import Any, Callable

Extractor = Callable[[str, ast.Module], Any]

_EXTRACTORS: dict[str, Extractor] = {}
# (path, size, mtime) -> {extractor name: result}, or None for a file that cannot be parsed
_FACTS: dict[tuple[str, int, int], dict[str, Any] | None] = {}


def extractor(name: str) -> Callable[[Extractor], Extractor]:
    """Decorator: register ``fn(text, tree)`` as what :func:`facts` (path, ``name``) returns."""
    def register(fn: Extractor) -> Extractor:
        _EXTRACTORS[name] = fn
        return fn
    return register


def facts(path: str, name: str) -> Any:
    """What the extractor ``name`` takes from the ``.py`` file at ``path``, or None if the
    file cannot be read as UTF-8 or does not parse (the callers skip such files)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    key = (path, stat.st_size, stat.st_mtime_ns)
    known = _FACTS.get(key, {})
    if known is not None and name not in known:
        known = _FACTS[key] = _parse(path, known)
    return None if known is None else known[name]


def _parse(path: str, known: dict[str, Any]) -> dict[str, Any] | None:
    """``known`` completed with every registered extractor it lacks, from one parse."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    return {**known, **{n: fn(text, tree) for n, fn in _EXTRACTORS.items() if n not in known}}
