"""Conversations for supervised fine-tuning: JSON Lines records read and checked, rendered with
the model's chat template, and the character spans of the rendered text the loss covers.

A record is `{"messages": [{"role": ..., "content": ...}, ...]}` or `{"prompt": ..., "completion":
...}` (each a string, read as one user's and one assistant's message, or a list of messages).
Which text is trained on (data.loss_on) comes from the template's own rendering, not from token
ids: an assistant message's span starts where the conversation before it, rendered ready for the
assistant's reply (add_generation_prompt), ends, and ends where the conversation up to and
including it ends. So it holds the message's content and whatever the template writes after it
inside the message (an end-of-turn token such as `<|im_end|>` or `</s>`, a newline), as the
assistant must learn to end its turn; not the role header the template writes before it.
The completion of a prompt/completion record is the same span taken over all of its messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from engine.errors import UsageError
from engine.lm.chat import Renderer

MAX_RECORD_CHARS = 1 << 24  # one JSON Lines record (a conversation): 16 Mi characters
FORMAT = 'JSON Lines of {"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "completion": ...}'


@dataclass(frozen=True)
class Conversation:
    """One record: where it was read (file:line), its messages, and where its completion begins
    (the prompt's messages before it; None: a messages record whose last message is not the assistant's)."""

    where: str
    messages: list[dict]
    completion: Optional[int]


def read_conversations(path: Path, key: str) -> list[Conversation]:
    """The records of a JSON Lines file (blank lines skipped); UsageError naming the file, the line
    and the field for the first bad one, and for a file that holds none."""
    if not path.is_file():
        raise UsageError(f"{key}={path} is not a file; give {FORMAT}")
    conversations = [_conversation(record, where) for where, record in json_records(path, FORMAT)]
    if not conversations:
        raise UsageError(f"{key}={path} holds no conversations; give {FORMAT}")
    return conversations


def json_records(path: Path, form: str) -> Iterator[tuple[str, Any]]:
    """(file:line, the decoded JSON value) of each of the file's lines but blank ones, each line
    decoded strictly: invalid UTF-8 is refused (file:line and its byte offset), not trained on as
    U+FFFD. A line over MAX_RECORD_CHARS characters is refused, one over 4 bytes a character
    (UTF-8's most) before it is decoded. `form`: the records' format, said where a line is no JSON."""
    start = 0  # the line's byte offset in the file
    with open(path, "rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(4 * MAX_RECORD_CHARS + 1), b""), 1):
            where = f"{path}:{number}"
            too_long = f"{where}: a record longer than {MAX_RECORD_CHARS:,} characters; shorten it"
            if len(raw) > 4 * MAX_RECORD_CHARS:  # (UTF-8 takes at most 4 bytes a character)
                raise UsageError(too_long)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(
                    f"{where}: not UTF-8 text (byte {start + e.start:,} of the file, {raw[e.start : e.end]!r}: "
                    f"{e.reason}); save the file as UTF-8"
                ) from None
            start += len(raw)
            if len(line) > MAX_RECORD_CHARS:
                raise UsageError(too_long)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                reason = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
                raise UsageError(f"{where}: not a JSON record ({reason}); {form}, one per line") from None
            yield where, record


def _conversation(record: Any, where: str) -> Conversation:
    if not isinstance(record, dict):
        raise UsageError(f"{where}: a JSON {type(record).__name__}, not an object; {FORMAT}")
    if "messages" in record:
        messages = _messages(record["messages"], "messages", where)
        if not messages:
            raise UsageError(f'{where}: "messages" is empty; give the conversation\'s messages')
        last = len(messages) - 1
        return Conversation(where, messages, last if messages[last]["role"] == "assistant" else None)
    if "prompt" not in record:
        raise UsageError(f'{where}: no "messages" or "prompt" field (the record has {sorted(record)}); {FORMAT}')
    if "completion" not in record:
        raise UsageError(f'{where}: "prompt" without "completion" (the record has {sorted(record)}); {FORMAT}')
    prompt = as_messages(record["prompt"], "prompt", "user", where)
    completion = as_messages(record["completion"], "completion", "assistant", where)
    return Conversation(where, prompt + completion, len(prompt))


def as_messages(value: Any, field: str, role: str, where: str) -> list[dict]:
    """A prompt or a completion: a string (one message of `role`) or a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, field, where)


def _messages(value: Any, field: str, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise UsageError(f'{where}: "{field}" is a JSON {type(value).__name__}; it must be a list of messages')
    for k, message in enumerate(value):
        at = f"{field}[{k}]"
        if not isinstance(message, dict):
            raise UsageError(f'{where}: {at} is a JSON {type(message).__name__}, not a {{"role", "content"}} object')
        for name in ("role", "content"):
            if name not in message:
                raise UsageError(f'{where}: {at} has no "{name}" (it has {sorted(message)})')
            if not isinstance(message[name], str):
                raise UsageError(f"{where}: {at}.{name} is a JSON {type(message[name]).__name__}, not a string")
    return value


def loss_spans(render: Renderer, conversation: Conversation, loss_on: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered whole (as transformers' apply_chat_template(messages,
    tokenize=False)) and the [start, end) character spans of it that the loss covers: every
    assistant message's (`assistant`), the completion's (`completion`) or the whole text (`all`)."""
    where = f"{conversation.where}: "
    messages = conversation.messages
    text = _rendered(render, messages, False, where)
    if loss_on == "all":
        return text, [(0, len(text))]
    if loss_on == "completion":
        first = conversation.completion
        return text, [] if first is None else [(_start(render, conversation, first, text), len(text))]
    spans = []
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            end = len(_prefix(render, conversation, k + 1, False, text))
            spans.append((_start(render, conversation, k, text), end))
    return text, spans


def _start(render: Renderer, conversation: Conversation, first: int, text: str) -> int:
    """Where the message `first` of the conversation begins in `text`: after the messages before
    it rendered ready for the assistant's reply (the generation prompt, a role header, is not
    trained on), or, for a template whose generation prompt differs from how it writes the
    message, after those messages alone."""
    before = _rendered(render, conversation.messages[:first], True, f"{conversation.where}: ")
    if text.startswith(before):
        return len(before)
    return len(_prefix(render, conversation, first, False, text))


def _prefix(render: Renderer, conversation: Conversation, count: int, prompt: bool, text: str) -> str:
    """The first `count` messages rendered; UsageError unless the whole conversation's text starts
    with it (a template that writes earlier messages otherwise once later ones follow)."""
    before = _rendered(render, conversation.messages[:count], prompt, f"{conversation.where}: ")
    if not text.startswith(before):
        raise UsageError(
            f"{conversation.where}: the chat template ({render.template.source}) renders the conversation's first "
            f"{count} message(s) otherwise than the whole conversation begins, so where message {count} begins or "
            "ends in the text cannot be found; use data.loss_on=all, or a template that renders earlier messages "
            "alike whatever follows"
        )
    return before


def _rendered(render: Renderer, messages: list[dict], prompt: bool, where: str) -> str:
    text = render(messages, add_generation_prompt=prompt, where=where)
    assert text is not None  # (refusals are errors here)
    return text
