"""Reading a YAML file people wrote (a config, a sweep file, a run's saved config): safe loading
(nothing constructed from tags), aliases expanded to at most MAX_YAML_VALUES values, and one
UsageError naming the file, the place and the problem."""

from __future__ import annotations

from pathlib import Path

import yaml

from engine.errors import UsageError

MAX_YAML_VALUES = 100_000  # a config or sweep file expanding to more is refused (YAML alias bombs)


def _too_many_values(data, limit: int = MAX_YAML_VALUES) -> bool:
    """Whether `data`, with YAML aliases expanded, holds more than `limit` values (stops counting there)."""
    count, todo = 0, [data]
    while todo:
        item = todo.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return False


# PyYAML's safe loader in C (libyaml) where PyYAML was built with it: ~10x faster, the same
# documents, tags refused alike; a sweep's processes each read every config and its bases
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml_mapping(path: Path, what: str) -> dict:
    """A YAML file (safe loading: nothing is constructed from tags) that must hold a mapping
    of at most MAX_YAML_VALUES values once its aliases are expanded."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=SAFE_LOADER)
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{what} {path}{_yaml_place(e)} is not valid YAML: {yaml_problem(e)}") from None
    if _too_many_values(data):
        raise UsageError(
            f"{what} {path} expands to more than {MAX_YAML_VALUES:,} values (through YAML aliases "
            "&name / *name?); write the values out"
        )
    if data is None:
        raise UsageError(
            f"{what} {path} is empty; it must hold a mapping of keys (see configs/ and docs/configuration.md)"
        )
    if not isinstance(data, dict):
        raise UsageError(f"{what} {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def _yaml_place(error: yaml.YAMLError) -> str:
    """':line:column' of a YAML error, where PyYAML knows it."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def yaml_problem(error: yaml.YAMLError) -> str:
    return getattr(error, "problem", None) or str(error).splitlines()[0]
