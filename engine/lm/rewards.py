"""Reward functions with TRL's signature, `f(prompts, completions, **fields) -> list[float]`, named
in a config as `module:function` or `path/to/file.py:function`: loaded once, called with a batch,
and their answers checked (one number or None a completion, none NaN or infinite).

As TRL's GRPOTrainer calls them: keyword arguments `prompts` (each record's prompt: a string, or a
list of messages in the conversational format), `completions` (strings; in the conversational
format, each a list of one assistant message), `completion_ids` (each completion's token ids), and
every other field of the records, each a list over the batch. None means the function does not
apply to that completion (TRL's convention): it is left out of that function's mean. A function
that raises, answers with the wrong length, or answers NaN, infinity or something not a number is
the user's input gone wrong: UsageError (exit 2) naming the function and the prompt.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from engine.errors import UsageError

SIGNATURE = "f(prompts, completions, **fields) -> list[float]"
RESERVED = ("prompts", "completions", "completion_ids")  # keyword arguments of the call, not fields


@dataclass(frozen=True)
class RewardFunction:
    """One reward function: as the config names it (`spec`), its name in metrics, the function."""

    spec: str
    name: str
    function: Callable[..., Any]


def load_rewards(specs: Sequence[str], key: str) -> list[RewardFunction]:
    """The functions `specs` name (the config's `key`); UsageError for one that cannot be loaded,
    and for two of the same name (their metrics would collide)."""
    rewards = [load_reward(spec, key) for spec in specs]
    names = [reward.name for reward in rewards]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UsageError(f"{key}: two reward functions are named {twice[0]}; give each function its own name")
    return rewards


def load_reward(spec: str, key: str) -> RewardFunction:
    """The function `module:function` or `path/to/file.py:function` names."""
    where, _, attribute = spec.rpartition(":")
    form = f"name a reward function {SIGNATURE} as module:function or path/to/file.py:function"
    if not where or not attribute:
        raise UsageError(f"{key}: {spec!r} is not module:function or path/to/file.py:function; {form}")
    try:
        module = _from_file(Path(where).expanduser()) if where.endswith(".py") else importlib.import_module(where)
    except UsageError:
        raise
    except Exception as e:  # the user's module: whatever its import raises is said in one line
        raise UsageError(f"{key}: importing {where} for {spec} failed ({type(e).__name__}: {e}); {form}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        found = "is not callable" if function is not None else "does not exist"
        raise UsageError(f"{key}: {attribute} in {where} {found}; {form}")
    return RewardFunction(spec, attribute, function)


def _from_file(path: Path):
    if not path.is_file():
        raise UsageError(f"reward function file {path} does not exist")
    name = f"engine_reward_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.util.spec_from_file_location(name, path)
    assert loader is not None and loader.loader is not None  # (a .py file always has one)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    try:
        loader.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def call_reward(
    reward: RewardFunction,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    fields: dict[str, list],
    key: str,
) -> list[Optional[float]]:
    """`reward`'s numbers for the batch (None where it does not apply); UsageError naming the
    function (and the prompt) when it raises or answers wrongly."""
    named = f"{key}: reward function {reward.spec}"
    try:
        values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
    except Exception as e:  # the user's function: whatever it raises is said in one line
        raise UsageError(f"{named} raised {type(e).__name__}: {e}; fix the function ({SIGNATURE})") from None
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise UsageError(f"{named} returned a {type(values).__name__}, not a list of {len(completions)} numbers")
    values = list(values)
    if len(values) != len(completions):
        raise UsageError(f"{named} returned {len(values)} values for {len(completions)} completions; return one each")
    out: list[Optional[float]] = []
    for index, value in enumerate(values):
        number = _number(value)
        if value is not None and (number is None or not math.isfinite(number)):
            raise UsageError(
                f"{named} returned {value!r} for completion {index} (prompt {_short(prompts[index])}); return a "
                f"finite number, or None where the function does not apply"
            )
        out.append(number)
    return out


def _number(value: Any) -> Optional[float]:
    if value is None or isinstance(value, bool):
        return None if value is None else float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _short(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else repr(prompt)
    return repr(text[:80] + ("…" if len(text) > 80 else ""))
