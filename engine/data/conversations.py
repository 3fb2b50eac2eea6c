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

A template that marks an assistant's turn with transformers' {% generation %} blocks (what its
return_assistant_tokens_mask reads) gives the `assistant` spans from one render: each message's
span is its block, where the blocks are one per assistant message and their recorded places hold
their text (else the prefixes below are rendered).

Finding those spans renders the conversation's prefixes (two per assistant message), so a record
holds at most MAX_MESSAGES messages, and all the renders of one record share the bounds of
engine/lm/chat.py's RECORD_* (loop iterations, characters written, time) besides each render's own.

Records read in TRL's standard format (data.format=standard, or a model without a chat template:
engine/data/chat_data.py decides) are strings, not message lists: a prompt and a completion,
their text concatenated as it is (PlainText: no template), the completion ended with the
tokenizer's end-of-text token unless it ends with it, and tokenized with the tokenizer's own
special tokens (a base model's BOS) as transformers' tokenizer(text) adds them; the loss covers the
completion (its end-of-text token included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from engine.errors import UsageError
from engine.lm.chat import Renderer

MAX_RECORD_CHARS = 1 << 24  # one JSON Lines record (a conversation): 16 Mi characters
MAX_MESSAGES = 1024  # messages in one record (finding the trained spans renders two prefixes per assistant message)
FORMAT = 'JSON Lines of {"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "completion": ...}'


@dataclass(frozen=True)
class Conversation:
    """One record: where it was read (file:line), its messages, and where its completion begins
    (the prompt's messages before it; None: a messages record whose last message is not the assistant's)."""

    where: str
    messages: list[dict]
    completion: Optional[int]


class PlainText:
    """TRL's standard format in place of a chat template: a conversation's messages (a prompt's and
    a completion's strings) concatenated as they are, the completion ended with `eos` (the
    tokenizer's end-of-text token) unless it ends with it; the tokenizer adds its special tokens."""

    special_tokens = True  # the tokenizer adds its own (a base model's BOS), as transformers' tokenizer(text) does

    def __init__(self, eos: str) -> None:
        self.eos = eos

    def __call__(self, messages: list[dict], add_generation_prompt: bool = True, where: str = "") -> str:
        """The messages' text, concatenated (a prompt: nothing is added for the reply)."""
        return "".join(message["content"] for message in messages)

    def spans(self, conversation: Conversation, loss_on: str) -> tuple[str, list[tuple[int, int]]]:
        """The prompt's and completion's text, and the span the loss covers: the completion (with its
        end-of-text token), or all of it (`all`)."""
        first = conversation.completion
        assert first is not None  # (a standard record is a prompt and a completion)
        prompt = self(conversation.messages[:first])
        completion = self(conversation.messages[first:])
        text = prompt + (completion if completion.endswith(self.eos) else completion + self.eos)
        return text, [(0 if loss_on == "all" else len(prompt), len(text))]


STANDARD_ONLY = (
    "this data is read in the standard format (strings, as plain text: data.format=standard, or a model "
    "without a chat template), and message lists are the conversational format, rendered with a chat "
    "template; give the prompt and completion as strings, or train a model that has a chat template"
)


def read_conversations(path: Path, key: str, standard: bool = False) -> list[Conversation]:
    """The records of a JSON Lines file (blank lines skipped); UsageError naming the file, the line
    and the field for the first bad one, and for a file that holds none. `standard`: TRL's
    standard format (prompt and completion strings only)."""
    if not path.is_file():
        raise UsageError(f"{key}={path} is not a file; give {FORMAT}")
    conversations = [_conversation(record, where, standard) for where, record in json_records(path, FORMAT)]
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


def _conversation(record: Any, where: str, standard: bool) -> Conversation:
    if not isinstance(record, dict):
        raise UsageError(f"{where}: a JSON {type(record).__name__}, not an object; {FORMAT}")
    if "messages" in record and standard:
        raise UsageError(f'{where}: a "messages" record: {STANDARD_ONLY}')
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
    prompt = as_messages(record["prompt"], "prompt", "user", where, standard)
    completion = as_messages(record["completion"], "completion", "assistant", where, standard)
    return Conversation(where, prompt + completion, len(prompt))


def as_messages(value: Any, field: str, role: str, where: str, standard: bool = False) -> list[dict]:
    """A prompt or a completion: a string (one message of `role`) or a list of messages (not in
    the `standard` format)."""
    if isinstance(value, str):
        return [{"role": role, "content": text(value, where, field)}]
    if standard:
        raise UsageError(f'{where}: "{field}" is a JSON {type(value).__name__}, not a string: {STANDARD_ONLY}')
    return _messages(value, field, where)


def text(value: str, where: str, field: str) -> str:
    """`value`, refused (UsageError naming `where` and `field`) where it holds a lone surrogate: JSON
    writes one (\\ud800) and Python reads it, but it is no character and no tokenizer takes it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        code = f"\\u{ord(value[e.start]):04x}"
        raise UsageError(
            f"{where}: {field} holds a lone surrogate ({code}, at character {e.start:,}), which is no character; "
            "JSON's \\ud800-\\udfff escapes must come in pairs (a high one, then a low one): correct the text"
        ) from None
    return value


def _messages(value: Any, field: str, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise UsageError(f'{where}: "{field}" is a JSON {type(value).__name__}; it must be a list of messages')
    if len(value) > MAX_MESSAGES:
        raise UsageError(f'{where}: "{field}" holds {len(value):,} messages, {TOO_MANY}')
    for k, message in enumerate(value):
        at = f"{field}[{k}]"
        if not isinstance(message, dict):
            raise UsageError(f'{where}: {at} is a JSON {type(message).__name__}, not a {{"role", "content"}} object')
        for name in ("role", "content"):
            if name not in message:
                raise UsageError(f'{where}: {at} has no "{name}" (it has {sorted(message)})')
            if not isinstance(message[name], str):
                raise UsageError(f"{where}: {at}.{name} is a JSON {type(message[name]).__name__}, not a string")
            text(message[name], where, f"{at}.{name}")
    return value


TOO_MANY = (
    f"more than the {MAX_MESSAGES:,} a record may hold (the spans the loss covers are found by rendering the "
    "conversation's beginnings, two for each assistant message); split the conversation into shorter records"
)


def loss_spans(
    render: Union[Renderer, PlainText], conversation: Conversation, loss_on: str
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered whole (as transformers' apply_chat_template(messages,
    tokenize=False)) and the [start, end) character spans of it that the loss covers: every
    assistant message's (`assistant`), the completion's (`completion`) or the whole text (`all`);
    all of its renders within one record's bounds. In the standard format (PlainText), its text."""
    if len(conversation.messages) > MAX_MESSAGES:  # (a preference pair's prompt and response together)
        raise UsageError(
            f"{conversation.where}: the conversation holds {len(conversation.messages):,} messages, {TOO_MANY}"
        )
    if isinstance(render, PlainText):
        return render.spans(conversation, loss_on)
    with render.record(f"{conversation.where}: "):
        rendered, spans = _spans(render, conversation, loss_on)
    try:
        rendered.encode("utf-8")
    except UnicodeEncodeError as e:  # (the messages hold none: the template, or its special tokens, wrote it)
        raise UsageError(
            f"{conversation.where}: {render.template.source}: the chat template writes a lone surrogate "
            f"(\\u{ord(rendered[e.start]):04x}), which is no character and no tokenizer takes; correct the template "
            "or its special tokens"
        ) from None
    return rendered, spans


def _spans(render: Renderer, conversation: Conversation, loss_on: str) -> tuple[str, list[tuple[int, int]]]:
    where = f"{conversation.where}: "
    messages = conversation.messages
    generated: list[tuple[int, int, str]] = []  # the template's {% generation %} blocks, if it writes them
    text = _rendered(render, messages, False, where, generated if loss_on == "assistant" else None)
    assistants = sum(message["role"] == "assistant" for message in messages)
    if generated and len(generated) == assistants and all(text[a:b] == block for a, b, block in generated):
        return text, [(a, b) for a, b, _ in generated]  # one render, whatever the messages (not a prefix each)
    if loss_on == "all":
        return text, [(0, len(text))]
    if loss_on == "completion":
        first = conversation.completion
        return text, [] if first is None else [(_start(render, conversation, first, text), len(text))]
    spans = []
    for k, message in enumerate(messages):
        if message["role"] == "assistant":  # (the last message ends where the text does: no render)
            end = len(text) if k + 1 == len(messages) else len(_prefix(render, conversation, k + 1, False, text))
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


def _rendered(
    render: Renderer, messages: list[dict], prompt: bool, where: str, generated: Optional[list] = None
) -> str:
    text = render(messages, add_generation_prompt=prompt, where=where, generated=generated)
    assert text is not None  # (refusals are errors here)
    return text
