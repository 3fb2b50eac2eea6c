"""`data.name=prompts`: prompts for train.objective=grpo, whose completions the run samples and
its reward functions score (engine/lm/rewards.py).

A record is `{"prompt": P, ...}`: P a string or a list of `{"role": ..., "content": ...}` messages,
and any other fields (e.g. `answer`), which reach the reward functions as TRL's GRPOTrainer passes
a dataset's columns. A message list is rendered with the model's chat template and the generation
prompt (what the assistant's reply follows); a string is one user's message rendered the same way,
or in TRL's standard format (data.format=standard, or a model without a chat template) its plain
text, the tokenizer's special tokens (BOS) added, as data.name=chat and preferences read them
(engine/data/chat_data.py `model_text`). Each prompt is tokenized with the model's tokenizer and
left-padded: the split's arrays are `prompt_tokens` int32 [prompts, width], `prompt_mask` bool
(True on the prompt's tokens) and `record_index` int32 (the record's index in its split's
`PromptRecord` list, Dataset.records, where the rewards find its prompt and fields). The source
pads to its longest prompt; `fit_prompts` pads to grpo.max_prompt_tokens and refuses a longer
prompt naming its file and line (TRL cuts a prompt's start instead: a cut prompt is another
question, whose answer field no longer fits it). The pipeline batches, shuffles and shards the rows
as any arrays. A record that is no JSON object, has no prompt, an empty one, a prompt of another
type or a field named as a reward function's own argument is a UsageError naming the file, the line
and the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from engine.data.base import DataInfo, Dataset
from engine.data.chat_data import held_out, model_text
from engine.data.conversations import PlainText, as_messages, json_records
from engine.errors import UsageError
from engine.lm.chat import Renderer

FORMAT = (
    'JSON Lines of {"prompt": ..., and the fields your reward functions read, e.g. "answer": ...} (the prompt a '
    'string, or a list of {"role": ..., "content": ...} messages)'
)
RESERVED = ("prompts", "completions", "completion_ids")  # a reward function's own arguments (engine/lm/rewards.py)


@dataclass(frozen=True)
class PromptRecord:
    """One record, for the reward functions: where it was read (file:line), its prompt as given (a
    string, or a list of messages: TRL's conversational format) and its other fields."""

    where: str
    prompt: Union[str, list]
    fields: dict[str, Any]

    @property
    def conversational(self) -> bool:
        """TRL's test of a record: its prompt is a list of messages (completions are then messages too)."""
        return isinstance(self.prompt, list)


def prompts(cfg) -> Dataset:
    """The prompts of JSON Lines (data.path; data.eval_path, or data.eval_fraction of data.path held
    out), rendered, tokenized and left-padded to the longest (see the module's docstring)."""
    tokenizer_file, tokenizer, render = model_text(cfg)
    standard = isinstance(render, PlainText)
    train = read_prompts(Path(cfg.path).expanduser(), "data.path", standard)
    if cfg.eval_path:
        held = read_prompts(Path(cfg.eval_path).expanduser(), "data.eval_path", standard)
    else:
        train, held = held_out(train, cfg.eval_fraction, cfg.path, "prompt")
    encoded = [_encoded(part, render, tokenizer) for part in (train, held)]
    width = max(len(ids) for part in encoded for ids in part)
    notes = []
    if standard:
        notes.append(
            f"data: prompts: TRL's standard format (data.format={cfg.format}): each string prompt as plain text, no "
            "chat template, the tokenizer's special tokens added"
        )
    notes += [_line(what, part) for what, part in zip(("train", "eval"), encoded)]
    info = DataInfo(
        "tokens",
        len(train),
        len(held),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        seq_len=width,
        text_codec="tokenizer",
        tokenizer=str(tokenizer_file),
        notes=tuple(notes),
    )
    return Dataset(_arrays(encoded[0], width), _arrays(encoded[1], width), info, records=(train, held))


def _line(what: str, encoded: list[np.ndarray]) -> str:
    lengths = [len(ids) for ids in encoded]
    return (
        f"data: prompts {what}: {len(lengths):,} prompts of {sum(lengths):,} tokens, the longest {max(lengths):,} "
        "(left-padded to grpo.max_prompt_tokens)"
    )


def read_prompts(path: Path, key: str, standard: bool = False) -> list[PromptRecord]:
    """The records of a JSON Lines file (blank lines skipped); UsageError naming the file, the line
    and the field for the first bad one, and for a file that holds none."""
    if not path.is_file():
        raise UsageError(f"{key}={path} is not a file; give {FORMAT}")
    records = [_record(record, where, standard) for where, record in json_records(path, FORMAT)]
    if not records:
        raise UsageError(f"{key}={path} holds no prompts; give {FORMAT}")
    return records


def _record(record: Any, where: str, standard: bool) -> PromptRecord:
    if not isinstance(record, dict):
        raise UsageError(f"{where}: a JSON {type(record).__name__}, not an object; {FORMAT}")
    if "prompt" not in record:
        raise UsageError(f'{where}: no "prompt" field (the record has {sorted(record)}); {FORMAT}')
    prompt = record["prompt"]
    if not isinstance(prompt, (str, list)):
        raise UsageError(
            f'{where}: "prompt" is a JSON {type(prompt).__name__}; give a string or a list of '
            '{"role": ..., "content": ...} messages'
        )
    messages = as_messages(prompt, "prompt", "user", where, standard)
    if not any(message["content"].strip() for message in messages):
        raise UsageError(f'{where}: "prompt" is empty; give the prompt\'s text (or leave the record out)')
    clash = [name for name in RESERVED if name in record]
    if clash:
        raise UsageError(
            f'{where}: a field named "{clash[0]}", which is a reward function\'s own argument (prompts, completions, '
            "completion_ids); rename the field"
        )
    return PromptRecord(where, prompt, {k: v for k, v in record.items() if k != "prompt"})


def _encoded(records: list[PromptRecord], render: Union[Renderer, PlainText], tokenizer) -> list[np.ndarray]:
    """Each record's prompt rendered with the generation prompt and tokenized."""
    texts = []
    for record in records:
        where = f"{record.where}: prompt: "
        messages = as_messages(record.prompt, "prompt", "user", record.where, isinstance(render, PlainText))
        with render.record(where) if isinstance(render, Renderer) else contextlib.nullcontext():
            texts.append(render(messages, add_generation_prompt=True, where=where))
    encodings = tokenizer.encode_batch(texts, add_special_tokens=render.special_tokens)
    return [np.asarray(encoding.ids, np.int64) for encoding in encodings]


def _arrays(encoded: list[np.ndarray], width: int) -> dict[str, np.ndarray]:
    """The prompts left-padded to `width` tokens."""
    tokens = np.zeros((len(encoded), width), np.int32)
    mask = np.zeros((len(encoded), width), bool)
    for row, ids in enumerate(encoded):
        tokens[row, width - len(ids) :] = ids
        mask[row, width - len(ids) :] = True
    return {"prompt_tokens": tokens, "prompt_mask": mask, "record_index": np.arange(len(encoded), dtype=np.int32)}


def fit_prompts(dataset: Dataset, max_prompt_tokens: int, max_completion_tokens: int) -> Dataset:
    """`dataset` (data.name=prompts) with its prompts left-padded to grpo.max_prompt_tokens, and
    DataInfo.seq_len the rows the update trains on (prompt and completion); UsageError naming the
    file and line of a prompt longer than max_prompt_tokens."""
    splits = []
    for split, records in zip((dataset.train, dataset.eval), dataset.records):
        lengths = split["prompt_mask"].sum(axis=1)
        if len(lengths) and lengths.max() > max_prompt_tokens:
            row = int(np.argmax(lengths > max_prompt_tokens))
            raise UsageError(
                f"{records[row].where}: the prompt is {int(lengths[row]):,} tokens (rendered and tokenized), more "
                f"than grpo.max_prompt_tokens={max_prompt_tokens}; set grpo.max_prompt_tokens={int(lengths.max())} "
                "(the longest prompt's), or shorten the prompt"
            )
        tokens, mask = split["prompt_tokens"][:, -max_prompt_tokens:], split["prompt_mask"][:, -max_prompt_tokens:]
        pad = max_prompt_tokens - tokens.shape[1]
        tokens = np.pad(tokens, ((0, 0), (pad, 0)))
        mask = np.pad(mask, ((0, 0), (pad, 0)))
        splits.append({"prompt_tokens": tokens, "prompt_mask": mask, "record_index": split["record_index"]})
    info = dataclasses.replace(dataset.info, seq_len=max_prompt_tokens + max_completion_tokens)
    return dataclasses.replace(dataset, train=splits[0], eval=splits[1], info=info)
