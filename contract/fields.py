"""A config field with its documentation: `option(default, "what it means", choices=...)`.

The schema's dataclasses (engine/config/schema.py, models/configs.py) declare every key this
way; validation reads the choices and bounds, and docs/configuration.md is generated from the
docs (python -m engine.config.reference)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

Choices = Union[Sequence[Any], Callable[[], Sequence[Any]]]


def option(
    default: Any,
    doc: str,
    *,
    choices: Optional[Choices] = None,
    at_least: Optional[float] = None,
    above: Optional[float] = None,
) -> Any:
    """A dataclass field: `doc` says what it means (unit, meaning); `choices` the allowed values (or
    a function giving them: a registry's names); `at_least` / `above` its lower bound."""
    metadata = {"doc": doc, "choices": choices, "at_least": at_least, "above": above}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def choices_of(f: dataclasses.Field) -> Optional[tuple]:
    """A field's allowed values (None: any value of its type)."""
    found = f.metadata.get("choices")
    if found is None:
        return None
    return tuple(found() if callable(found) else found)


def doc_of(f: dataclasses.Field) -> str:
    return f.metadata.get("doc", "")
