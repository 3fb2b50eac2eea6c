"""`data.name=preferences`: preference pairs (a prompt, a chosen and a rejected response) rendered
and tokenized as data.name=chat renders a prompt/completion record, one pair an example.

A record is `{"prompt": P, "chosen": C, "rejected": R}`: P a string (one user's message) or a list
of messages, C and R strings (one assistant's message) or lists of messages (the response's
turns). Each side, P + C and P + R, is a conversation rendered with the model's chat template and
tokenized with its tokenizer exactly as data.name=chat with data.loss_on=completion renders and
tokenizes it (engine/data/conversations.py, engine/data/chat_data.py): its loss mask is 1 on the
response's tokens (the template's span of the response: its content and end-of-turn, not the role
header), 0 on the prompt's. In TRL's standard format (data.format=standard, or a model without a
chat template: engine/data/chat_data.py), the fields are strings only and each side is their
plain text, prompt + response + the tokenizer's end-of-text token, with the tokenizer's special
tokens (BOS) added. The split's arrays are [pairs, 2, seq_len + 1] (index 0 the chosen side, 1
the rejected), each row one side right-padded: `tokens`, `segments` (1 on real tokens,
0 on padding) and `positions` (0, 1, ... on real tokens) int32, `loss_mask` uint8. Nothing is
packed: the pipeline batches, shuffles and shards the pairs along their first axis as any arrays.

A pair longer than the window (data.seq_len + 1 tokens) is refused (data.overflow=error), left out
(drop) or has the end of its longer responses cut (truncate: the prompt is kept whole; a pair whose
prompt alone fills the window, or whose sides become the same once cut, is left out); the counts
are said at the run's start (DataInfo.notes). A pair whose chosen and rejected responses are the
same teaches nothing and is refused, as records and as tokens (the two sides rendered and tokenized:
records that differ only in spaces the tokenizer drops, a message key the template ignores or
characters that both become the unknown token are the same pair to the model), as are a missing
field, an empty response and a role the template does not know: each a UsageError naming the
file, the line and the field.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from engine.data.base import Dataset
from engine.data.chat_data import held_out, model_text, token_mask, tokenized_dataset
from engine.data.conversations import Conversation, PlainText, as_messages, json_records, loss_spans
from engine.errors import UsageError
from engine.lm.chat import Renderer

FORMAT = (
    'JSON Lines of {"prompt": ..., "chosen": ..., "rejected": ...} (each a string, or a list of '
    '{"role": ..., "content": ...} messages)'
)
SIDES = ("chosen", "rejected")  # the rows of a pair, in order
Side = tuple[np.ndarray, np.ndarray]  # one side's token ids and loss mask


@dataclass(frozen=True)
class Pair:
    """One record: where it was read (file:line) and its three parts as message lists."""

    where: str
    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]

    def sides(self) -> list[Conversation]:
        """Prompt + chosen and prompt + rejected, each a conversation whose completion is the response."""
        return [
            Conversation(f"{self.where}: {side}", self.prompt + getattr(self, side), len(self.prompt)) for side in SIDES
        ]


@dataclass
class Counts:
    """What happened to a split's pairs on their way into examples."""

    read: int = 0
    truncated: int = 0  # a response cut so that the pair fits
    dropped: int = 0  # longer with data.overflow=drop, or no response token left in the window
    tokens: int = 0  # tokens kept, both sides
    trained: int = 0  # of them, in the loss

    def line(self, what: str, window: int, kept: int) -> str:
        return (
            f"data: preferences {what}: {self.read:,} pairs ({self.truncated:,} with a response cut to fit "
            f"{window} tokens, {self.dropped:,} dropped as longer or with no response token left), {kept:,} "
            f"kept; {self.trained:,} of {self.tokens:,} tokens trained on"
        )


def preferences(cfg) -> Dataset:
    """Preference pairs of JSON Lines (data.path; data.eval_path, or data.eval_fraction of
    data.path held out), rendered, tokenized and fitted (see the module's docstring)."""
    tokenizer_file, tokenizer, render = model_text(cfg)
    standard = isinstance(render, PlainText)  # TRL's standard format: strings as plain text
    train = read_pairs(Path(cfg.path).expanduser(), "data.path", standard)
    if cfg.eval_path:
        held = read_pairs(Path(cfg.eval_path).expanduser(), "data.eval_path", standard)
    else:
        train, held = held_out(train, cfg.eval_fraction, cfg.path, "preference pair")
    build = lambda part: _examples(part, render, tokenizer, cfg)  # noqa: E731
    return tokenized_dataset((train, held), build, tokenizer_file, tokenizer, cfg, render)


def read_pairs(path: Path, key: str, standard: bool = False) -> list[Pair]:
    """The pairs of a JSON Lines file (blank lines skipped); UsageError naming the file, the line
    and the field for the first bad one, and for a file that holds none."""
    if not path.is_file():
        raise UsageError(f"{key}={path} is not a file; give {FORMAT}")
    pairs = [_pair(record, where, standard) for where, record in json_records(path, FORMAT)]
    if not pairs:
        raise UsageError(f"{key}={path} holds no preference pairs; give {FORMAT}")
    return pairs


def _pair(record: Any, where: str, standard: bool) -> Pair:
    if not isinstance(record, dict):
        raise UsageError(f"{where}: a JSON {type(record).__name__}, not an object; {FORMAT}")
    parts: dict[str, list[dict]] = {}
    for field, role in (("prompt", "user"), ("chosen", "assistant"), ("rejected", "assistant")):
        if field not in record:
            raise UsageError(f'{where}: no "{field}" field (the record has {sorted(record)}); {FORMAT}')
        value = record[field]
        if not isinstance(value, (str, list)):
            raise UsageError(
                f'{where}: "{field}" is a JSON {type(value).__name__}; give a string or a list of '
                '{"role": ..., "content": ...} messages'
            )
        parts[field] = as_messages(value, field, role, where, standard)
        if field in SIDES and not any(message["content"].strip() for message in parts[field]):
            raise UsageError(f'{where}: "{field}" is empty; give the response\'s text (or leave the pair out)')
    if parts["chosen"] == parts["rejected"]:
        raise UsageError(
            f'{where}: "chosen" and "rejected" are the same response, a pair that teaches nothing; '
            "correct the rejected response, or leave the pair out"
        )
    return Pair(where, parts["prompt"], parts["chosen"], parts["rejected"])


def _examples(pairs: list[Pair], render: Union[Renderer, PlainText], tokenizer, cfg) -> tuple[dict, Counts]:
    """The pairs as [pairs, 2, seq_len + 1] arrays, and what happened to them."""
    window = cfg.seq_len + 1
    for pair in pairs:  # a role the template refuses in the prompt: said of the prompt, not of a side
        where = f"{pair.where}: prompt: "
        with render.record(where) if isinstance(render, Renderer) else contextlib.nullcontext():
            render(pair.prompt, add_generation_prompt=True, where=where)  # (within a record's bounds, as the sides)
    rendered = [loss_spans(render, side, "completion") for pair in pairs for side in pair.sides()]
    encodings = tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=render.special_tokens)
    sides = [
        (np.asarray(encoding.ids, np.int64), token_mask(encoding.offsets, spans))
        for (_, spans), encoding in zip(rendered, encodings)
    ]
    for k, pair in enumerate(pairs):  # the same tokens both sides: the records may differ in what the tokens lose
        _check_differ(pair, sides[2 * k][0], sides[2 * k + 1][0])
    counts = Counts(read=len(pairs))
    kept: list[list[Side]] = []
    for k, pair in enumerate(pairs):
        fitted = _fitted(pair, sides[2 * k : 2 * k + 2], window, cfg.overflow, counts)
        if fitted is not None:
            kept.append(fitted)
    if not kept:
        where = pairs[0].where.rsplit(":", 1)[0]
        raise UsageError(
            f"{where}: none of its {len(pairs)} preference pair(s) fits in data.seq_len + 1 = {window} tokens with "
            f"a response token to train on (data.overflow={cfg.overflow}); use a longer data.seq_len, or shorter "
            "prompts"
        )
    counts.tokens = sum(len(ids) for pair in kept for ids, _ in pair)
    counts.trained = sum(int(mask[1:].sum()) for pair in kept for _, mask in pair)
    return _arrays(kept, window), counts


def _check_differ(pair: Pair, chosen: np.ndarray, rejected: np.ndarray) -> None:
    """UsageError when the pair's two sides are the same tokens (prompt + chosen as prompt +
    rejected, rendered and tokenized): spaces the tokenizer drops, a message key the template
    ignores, characters that become one unknown token; the DPO loss of such a pair is log 2, its gradient 0."""
    if np.array_equal(chosen, rejected):
        raise UsageError(
            f'{pair.where}: "chosen" and "rejected" render and tokenize to the same {len(chosen):,} tokens (they '
            "differ only in what the chat template or the tokenizer drops), a pair that teaches nothing; make the "
            "responses differ in their text, or leave the pair out"
        )


def _fitted(pair: Pair, sides: list[Side], window: int, overflow: str, counts: Counts) -> Optional[list[Side]]:
    """The pair's two sides fitted to `window` tokens as data.overflow says, or None: left out (counted)."""
    lengths = [len(ids) for ids, _ in sides]
    if max(lengths) > window:
        if overflow == "error":
            side = int(np.argmax(lengths))
            raise UsageError(
                f'{pair.where}: "{SIDES[side]}": the prompt and its response are {lengths[side]:,} tokens, more than '
                f"data.seq_len + 1 = {window}; give a longer data.seq_len, shorten the pair, or set "
                "data.overflow=truncate or drop"
            )
        if overflow == "drop":
            counts.dropped += 1
            return None
        sides = [(ids[:window], mask[:window]) for ids, mask in sides]
        if np.array_equal(sides[0][0], sides[1][0]):  # cut where the responses still agree
            counts.dropped += 1
            return None
        counts.truncated += 1
    # a side whose prompt alone fills the window: no response token to score (a row's first is no one's target)
    if not all(mask[1:].any() for _, mask in sides):
        counts.dropped += 1
        return None
    return sides


def _arrays(kept: list[list[Side]], window: int) -> dict[str, np.ndarray]:
    """The fitted pairs' sides right-padded into [pairs, 2, window] rows."""
    shape = (len(kept), len(SIDES), window)
    tokens, segments, positions = (np.zeros(shape, np.int32) for _ in range(3))
    loss_mask = np.zeros(shape, np.uint8)
    for row, pair in enumerate(kept):
        for side, (ids, mask) in enumerate(pair):
            size = len(ids)
            tokens[row, side, :size] = ids
            segments[row, side, :size] = 1
            positions[row, side, :size] = np.arange(size)
            loss_mask[row, side, :size] = mask
    return {"tokens": tokens, "segments": segments, "positions": positions, "loss_mask": loss_mask}
