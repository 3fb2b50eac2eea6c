"""A chat template's files: chat_template.jinja (transformers 5), or tokenizer_config.json's
chat_template (a string, or named templates), with the special tokens tokenizer_config.json gives;
every file's size checked before any is read (engine/lm/tokenizer.py's bounds). engine/lm/chat.py
renders what is read here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from engine.errors import UsageError
from engine.lm.tokenizer import MAX_CONFIG_BYTES, MAX_TEMPLATE_BYTES, check_model_files, read_bounded

JINJA_FILE = "chat_template.jinja"  # transformers 5 keeps the template apart from tokenizer_config.json
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    text: str  # the Jinja source
    source: str  # where it was read, for messages: a file, or a key of a file
    special: dict[str, str]  # bos_token, eos_token, ...: the text tokenizer_config.json gives


def short(text: Any) -> str:
    """`text` on one line, cut at 200 characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= 200 else line[:200] + "..."


def read_chat_template(directory: Path) -> Optional[ChatTemplate]:
    """The chat template kept in `directory` (a workdir, or a Hugging Face directory):
    chat_template.jinja where it has one (transformers 5), else tokenizer_config.json's
    chat_template; None where there is none; UsageError for a file that cannot be read."""
    check_model_files(directory)  # every file's size before any is read
    jinja = directory / JINJA_FILE
    config = tokenizer_config(directory / CONFIG_FILE)
    special = special_tokens(config)
    if jinja.is_file():
        try:
            text = read_bounded(jinja, MAX_TEMPLATE_BYTES, "chat template").decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(
                f"{jinja} cannot be read as UTF-8 text ({short(e)}); save the chat template as UTF-8"
            ) from None
        if text:
            return ChatTemplate(text, str(jinja), special)
    configured = _configured(config.get("chat_template"), directory / CONFIG_FILE)
    if configured is not None and len(configured) > MAX_TEMPLATE_BYTES:
        raise UsageError(
            f"{directory / CONFIG_FILE}: chat_template is {len(configured):,} characters, more than the "
            f"{MAX_TEMPLATE_BYTES:,} a chat template may be; give the model's own template"
        )
    return ChatTemplate(configured, f"{directory / CONFIG_FILE} (chat_template)", special) if configured else None


def special_tokens(config: dict) -> dict[str, str]:
    """bos_token, eos_token, ...: the text tokenizer_config.json's settings (`config`) give each."""
    return {key: _token_text(config.get(key)) for key in SPECIAL_TOKENS}


def tokenizer_config(path: Path) -> dict:
    """tokenizer_config.json's settings ({} where there is no file); UsageError unless it is a JSON
    object of at most MAX_CONFIG_BYTES."""
    if not path.is_file():
        return {}
    fix = "write it as transformers does (a JSON object of the tokenizer's settings), or remove it"
    try:
        config = json.loads(read_bounded(path, MAX_CONFIG_BYTES, "tokenizer_config.json").decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UsageError(f"{path} is not valid JSON ({short(e)}); {fix}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path} holds a JSON {_json_kind(config)}, not an object; {fix}")
    return config


def _configured(template: Any, path: Path) -> Optional[str]:
    """tokenizer_config.json's chat_template: a string, or a list of named templates of which
    the one named "default" is used (as transformers does)."""
    if template is None or isinstance(template, str):
        return template
    form = 'a string, or a list of {"name": ..., "template": ...} entries of strings'
    if not isinstance(template, list):
        raise UsageError(f"{path}: chat_template is a JSON {_json_kind(template)}; it must be {form}")
    for entry in template:
        if not (isinstance(entry, dict) and all(isinstance(entry.get(key), str) for key in ("name", "template"))):
            raise UsageError(f"{path}: chat_template holds {short(json.dumps(entry))[:80]}; it must be {form}")
    named = {entry["name"]: entry["template"] for entry in template}
    if "default" not in named:
        names = short(", ".join(map(repr, named)) or "none")
        raise UsageError(f'{path}: chat_template names no "default" template (it names {names}); rename the one to use')
    return named["default"]


def _json_kind(value: Any) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")


def _token_text(token: Any) -> str:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...}."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
