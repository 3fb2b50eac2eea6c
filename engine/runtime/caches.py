"""Where the engine keeps what it can make again (tokenized corpora, a table's fitted features, XLA's
compiled programs): under ~/.cache/jax-engine, or under $JAX_ENGINE_CACHE where that is set (the
tests point it at a folder of their own, so that nothing depends on what a machine ran before)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_ROOT = "~/.cache/jax-engine"  # the config keys' defaults name folders under it
ENV = "JAX_ENGINE_CACHE"


def cache_path(path: str) -> Path:
    """`path` with ~ expanded, and the default root (DEFAULT_ROOT, as the config keys' defaults
    give it) moved to $JAX_ENGINE_CACHE where that is set; a path set elsewhere stays as given."""
    root = os.environ.get(ENV)
    if root and (path == DEFAULT_ROOT or path.startswith(DEFAULT_ROOT + "/")):
        path = root + path[len(DEFAULT_ROOT) :]
    return Path(path).expanduser()
