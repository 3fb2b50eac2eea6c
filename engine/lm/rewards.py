"""Reward functions with TRL's signature, `f(prompts, completions, **fields) -> list[float]`, named
in a config as `module:function` or `path/to/file.py:function`: loaded once, called with a batch,
and their answers checked (one number or None a completion, none NaN or infinite).

As TRL's GRPOTrainer calls them: keyword arguments `prompts` (each record's prompt: a string, or a
list of messages in the conversational format), `completions` (strings; in the conversational
format, each a list of one assistant message), `completion_ids` (each completion's token ids), and
every other field of the records, each a list over the batch. None means the function does not
apply to that completion (TRL's convention): it is left out of that function's mean. A function
that raises, answers with the wrong length, or answers NaN, infinity or something not a number is
the user's input gone wrong: UsageError (exit 2) naming the function and the prompt. A file's path
(`path/to/file.py:function`) is relative to the working directory, as data.path is.

Shipped, for grpo.rewards and eval.generate.rewards: `exact_match` (the completion's answer, its last
<answer>...</answer> or else its text, against each record's `answer` field) and `format_match`
(the completion is <answer>...</answer>, optionally after <think>...</think>; `format_reward(pattern)`
makes one of another pattern). `grpo_rewards` scores a GRPO batch as TRL's GRPOTrainer does.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

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
        on = _raising_prompt(reward, prompts, completions, completion_ids, fields)
        raise UsageError(f"{named} raised {type(e).__name__}: {e}{on}; fix the function ({SIGNATURE})") from None
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


def _raising_prompt(reward: RewardFunction, prompts: list, completions: list, completion_ids: list, fields: dict):
    """Where the function raised, for its message: the first completion it raises on alone (it
    raised on the batch) and that completion's prompt; "" where it raises on none alone."""
    if len(completions) < 2:
        return f" (prompt {_short(prompts[0])})" if prompts else ""
    for index in range(len(completions)):
        one = {name: values[index : index + 1] for name, values in fields.items()}
        try:
            reward.function(
                prompts=prompts[index : index + 1],
                completions=completions[index : index + 1],
                completion_ids=completion_ids[index : index + 1],
                **one,
            )
        except Exception:  # (the culprit, found: said by the caller)
            return f" (completion {index}, prompt {_short(prompts[index])})"
    return ""


def completion_text(completion: Any) -> str:
    """A completion's text: itself, or in the conversational format (a list of messages) the last
    message's content."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
DEFAULT_FORMAT = r"\s*(?:<think>.*?</think>\s*)?<answer>.*?</answer>\s*"  # format_match's pattern


def extracted_answer(text: str) -> str:
    """The answer a completion gives: the content of its last <answer>...</answer>, else the whole
    text; its words joined by single spaces."""
    tagged = ANSWER_TAG.findall(text)
    return " ".join((tagged[-1] if tagged else text).split())


def exact_match(prompts: list, completions: list, answer: Optional[list] = None, **fields: Any) -> list:
    """1.0 where the completion's answer (`extracted_answer`: the last <answer>...</answer>, else the
    whole text, spaces collapsed) is the record's `answer` field (a string or a number, spaces
    collapsed), else 0.0; None where a record's answer is null (the function does not apply)."""
    if answer is None:
        raise ValueError(
            'exact_match compares each completion with its record\'s "answer" field, and the records have none; '
            'add "answer" to the prompts\' records'
        )
    return [
        None if want is None else float(extracted_answer(completion_text(got)) == " ".join(str(want).split()))
        for got, want in zip(completions, answer)
    ]


def format_reward(pattern: str, name: str = "format_match") -> Callable[..., list[float]]:
    """A reward function of TRL's signature: 1.0 where the whole completion matches the regular
    expression `pattern` (re.fullmatch, `.` matching newlines too), else 0.0. In a file of yours:
    `my_format = format_reward(r"...")`, then grpo.rewards=[path/to/file.py:my_format]."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions: list, **fields: Any) -> list[float]:
        return [float(compiled.fullmatch(completion_text(c)) is not None) for c in completions]

    reward.__name__ = reward.__qualname__ = name
    return reward


format_match = format_reward(DEFAULT_FORMAT)  # <answer>...</answer>, optionally after <think>...</think>


def grpo_rewards(
    rewards: Sequence[RewardFunction],
    prompts: list,
    fields: list[dict],
    completions: list[str],
    completion_ids: list[list[int]],
    num_generations: int,
    key: str = "grpo.rewards",
) -> np.ndarray:
    """Each completion's reward from each function, [completions, functions] float64, NaN where a
    function answered None (TRL's "does not apply": grpo_math.weighted_rewards leaves it out).
    `prompts` and `fields` are the batch's records' (data.name=prompts: PromptRecord.prompt and
    .fields), `completions` their decoded texts, `num_generations` consecutive ones a prompt. Called
    as TRL's GRPOTrainer calls them: each prompt and its fields repeated for its completions, every
    field a list (None where a record lacks it), and where the prompt is a list of messages (TRL's
    conversational format) each completion a list of one assistant message."""
    if len(completions) != len(prompts) * num_generations:
        raise ValueError(f"{len(completions)} completions for {len(prompts)} prompts x {num_generations}")
    repeated = [k for k in range(len(prompts)) for _ in range(num_generations)]
    names = list(dict.fromkeys(name for record in fields for name in record))
    given = [
        [{"role": "assistant", "content": text}] if isinstance(prompts[k], list) else text
        for k, text in zip(repeated, completions)
    ]
    columns = {name: [fields[k].get(name) for k in repeated] for name in names}
    batch_prompts = [prompts[k] for k in repeated]
    scores = np.full((len(completions), len(rewards)), np.nan)
    for column, reward in enumerate(rewards):
        values = call_reward(reward, batch_prompts, given, completion_ids, columns, key)
        scores[:, column] = [np.nan if value is None else value for value in values]
    return scores
