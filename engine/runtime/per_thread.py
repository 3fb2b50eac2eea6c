"""Settings a sweep gives the run its thread trains (engine/sweep/submesh.py trains a trial on a
thread of its own): a registry keyed by thread, set while inside `given`. Imports no jax."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def given(registry: dict[int, Any], value: Any) -> Iterator[None]:
    """While inside, registry[this thread] is `value`."""
    ident = threading.get_ident()
    registry[ident] = value
    try:
        yield
    finally:
        registry.pop(ident, None)
