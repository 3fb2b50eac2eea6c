"""`data.name=chat`: conversations rendered with the model's chat template, tokenized with its
tokenizer, packed into windows with document boundaries, and a loss mask of the trained tokens.

Each conversation (engine/data/conversations.py) is one document of the packing that token
corpora get (engine/data/tokens.py: `segments`, `positions`, no document split across windows),
and each window also carries `loss_mask`: 1 for a token of a span data.loss_on trains on (a
token that overlaps the span's characters, by the tokenizer's offsets), which NextToken
(models/family.py) multiplies into its targets' weights. A conversation longer than a window
(data.seq_len + 1 tokens: the inputs and the shifted targets) is cut to it, left out, or refused
(data.overflow); a conversation with no token left to train on is left out; the counts are said at
the run's start (DataInfo.notes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np

from engine.data import tokens as tk
from engine.data.base import SPLIT_SEED, DataInfo, Dataset
from engine.data.conversations import Conversation, PlainText, loss_spans, read_conversations, text
from engine.errors import UsageError
from engine.lm.chat import Renderer
from engine.lm.chat_files import CONFIG_FILE, JINJA_FILE, read_chat_template, special_tokens, tokenizer_config
from engine.lm.tokenizer import END_OF_TEXT, MAX_TOKENIZER_BYTES, TOKENIZER, check_size, load_tokenizer_file

# the sources whose data.tokenizer is a model's (or "": the run's)
MODEL_TEXT_SOURCES = ("chat", "preferences", "prompts")


def with_model(data, model_dir: Union[str, Path]):
    """`data` with data.tokenizer="" of data.name=chat (or preferences) set to `model_dir`: the
    directory of the model the run trains (its finetune.base or checkpoint.restore_from's workdir,
    else its own), whose tokenizer and chat template the conversations are rendered and tokenized with."""
    if data.name not in MODEL_TEXT_SOURCES or data.tokenizer:
        return data
    return dataclasses.replace(data, tokenizer=str(model_dir))


@dataclass
class Counts:
    """What happened to a split's conversations on their way into windows."""

    read: int = 0
    truncated: int = 0
    dropped: int = 0  # longer than a window, with data.overflow=drop
    untrained: int = 0  # no token to train on (after truncation): left out
    tokens: int = 0  # tokens kept
    trained: int = 0  # of them, in the loss

    def line(self, what: str, window: int, windows: int) -> str:
        return (
            f"data: chat {what}: {self.read:,} conversations ({self.truncated:,} truncated to {window} tokens, "
            f"{self.dropped:,} dropped as longer, {self.untrained:,} with no token to train on left out) in "
            f"{windows:,} windows of {window} tokens; {self.trained:,} of {self.tokens:,} tokens trained on"
        )


def chat(cfg) -> Dataset:
    """Conversations of JSON Lines (data.path, data.eval_path or data.eval_fraction of data.path
    held out), rendered, tokenized and packed (see the module's docstring)."""
    tokenizer_file, tokenizer, render = model_text(cfg)
    standard = isinstance(render, PlainText)
    train = read_conversations(Path(cfg.path).expanduser(), "data.path", standard)
    if cfg.eval_path:
        held = read_conversations(Path(cfg.eval_path).expanduser(), "data.eval_path", standard)
    else:
        train, held = held_out(train, cfg.eval_fraction, cfg.path)
    build = lambda part: _packed(part, render, tokenizer, cfg)  # noqa: E731
    return tokenized_dataset((train, held), build, tokenizer_file, tokenizer, cfg, render)


def tokenized_dataset(
    parts: tuple[list, list], build: Callable, tokenizer_file: Path, tokenizer, cfg, render: Any = None
) -> Dataset:
    """The Dataset of the (train, eval) records `parts`, each made into arrays and their counts by
    `build` (the counts' line said at the run's start), tokenized by `tokenizer` (of `tokenizer_file`);
    the format said where `render` is the standard format's PlainText."""
    splits, notes = [], []
    if isinstance(render, PlainText):
        notes.append(
            f"data: {cfg.name}: TRL's standard format (data.format={cfg.format}): each prompt and completion as plain "
            f"text, no chat template, {render.eos!r} after each completion, the tokenizer's special tokens added"
        )
    for what, records in zip(("train", "eval"), parts):
        arrays, counts = build(records)
        notes.append(counts.line(what, cfg.seq_len + 1, len(arrays["tokens"])))
        splits.append(arrays)
    info = DataInfo(
        "tokens",
        len(splits[0]["tokens"]),
        len(splits[1]["tokens"]),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        seq_len=cfg.seq_len,
        text_codec="tokenizer",
        tokenizer=str(tokenizer_file),
        notes=tuple(notes),
    )
    return Dataset(splits[0], splits[1], info)


def model_text(cfg) -> tuple[Path, Any, Union[Renderer, PlainText]]:
    """data.tokenizer's tokenizer file (itself where it names a file, a Hugging Face tokenizers
    JSON of any name; else its directory's tokenizer.json), that tokenizer (tokenizers.Tokenizer)
    and what turns records into text: the chat template (compiled) of that directory (a file's
    own), or in TRL's standard format (data.format=standard, or auto and no template) PlainText."""
    if not cfg.tokenizer:
        raise UsageError(
            f"data.name={cfg.name} reads the model's tokenizer and chat template: set data.tokenizer=DIR (a workdir "
            "import-hf made, or a Hugging Face directory)"
        )
    given = Path(cfg.tokenizer).expanduser()
    fix = "import a chat model (launch.py import-hf) and train from its workdir, or set data.tokenizer=DIR to one"
    if given.is_file():
        tokenizer_file, directory = given, given.parent
    elif given.is_dir():
        tokenizer_file, directory = given / TOKENIZER, given
        if not tokenizer_file.is_file():
            raise UsageError(
                f"data.tokenizer={given}: the directory has no {TOKENIZER} to tokenize the conversations with; {fix}"
            )
    else:
        raise UsageError(
            f"data.tokenizer={given} is neither a file nor a directory; give the model's directory (an import-hf "
            f"workdir, or a Hugging Face directory) or its {TOKENIZER}"
        )
    check_size(tokenizer_file, MAX_TOKENIZER_BYTES, "tokenizer.json")  # every file's size before any is read
    template = read_chat_template(directory)
    if template is None and cfg.format == "conversational":
        raise UsageError(
            f"data.tokenizer={given}: {directory} has no chat template (no {JINJA_FILE}, nor chat_template in "
            f"{CONFIG_FILE}) to render the conversations with (data.format=conversational); {fix}, or set "
            "data.format=auto to read string records as plain text"
        )
    tokenizer = load_tokenizer_file(
        tokenizer_file,
        "set data.tokenizer to the model's tokenizer.json, or to the directory that holds it (and its chat template)",
        "data.tokenizer: ",
    )
    if template is None or cfg.format == "standard":
        return tokenizer_file, tokenizer, _plain_text(directory, tokenizer)
    return tokenizer_file, tokenizer, Renderer(template, "correct the conversation, or the template")


def _plain_text(directory: Path, tokenizer) -> PlainText:
    """The standard format's PlainText, ending each completion with the end-of-text token: the one
    tokenizer_config.json names (eos_token), else the first of END_OF_TEXT the tokenizer has; UsageError
    where there is none, or it is not one token of the tokenizer's."""
    config = directory / CONFIG_FILE
    named = text(special_tokens(tokenizer_config(config))["eos_token"], str(config), "eos_token")
    found = [token for token in END_OF_TEXT if tokenizer.token_to_id(token) is not None]
    eos = named or (found[0] if found else "")
    where = f"data.tokenizer: the standard format (string records as plain text) ends each completion with {directory}"
    if not eos:
        raise UsageError(
            f"{where}'s end-of-text token, and it has none (no eos_token in {CONFIG_FILE}, nor any of "
            f"{list(END_OF_TEXT)} in {TOKENIZER}); name the model's in {CONFIG_FILE} (eos_token)"
        )
    if tokenizer.encode(eos, add_special_tokens=False).ids != [tokenizer.token_to_id(eos)]:
        raise UsageError(
            f"{where}'s end-of-text token {eos!r} ({CONFIG_FILE}'s eos_token), which {TOKENIZER} does not read as "
            f"one token; name one of its special tokens in {CONFIG_FILE} (eos_token)"
        )
    return PlainText(eos)


def held_out(records: list, fraction: float, path: str, what: str = "conversation") -> tuple[list, list]:
    """A fixed share of the records (`what`s) held out (whatever the run's seed), the rest in file order."""
    count = len(records)
    held = max(1, int(round(count * fraction)))
    if held >= count:
        raise UsageError(
            f"data.path={path} holds {count} {what}(s): too few to hold out data.eval_fraction={fraction} "
            "of them and train on the rest; give more, or the held-out ones in data.eval_path"
        )
    out = set(np.random.default_rng(SPLIT_SEED).permutation(count)[:held].tolist())
    return [c for k, c in enumerate(records) if k not in out], [c for k, c in enumerate(records) if k in out]


def _packed(
    conversations: list[Conversation], render: Union[Renderer, PlainText], tokenizer, cfg
) -> tuple[dict, Counts]:
    """The conversations as packed windows: tokens, segments, positions and loss_mask [windows, seq_len + 1]."""
    window = cfg.seq_len + 1
    rendered = [loss_spans(render, c, cfg.loss_on) for c in conversations]
    encodings = tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=render.special_tokens)
    counts = Counts(read=len(conversations))
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for conversation, (_, spans), encoding in zip(conversations, rendered, encodings):
        tokens, mask = np.asarray(encoding.ids, np.int64), token_mask(encoding.offsets, spans)
        if len(tokens) > window:
            if cfg.overflow == "error":
                raise UsageError(
                    f"{conversation.where}: the conversation is {len(tokens):,} tokens, more than data.seq_len + 1 = "
                    f"{window}; give a longer data.seq_len, shorten it, or set data.overflow=truncate or drop"
                )
            if cfg.overflow == "drop":
                counts.dropped += 1
                continue
            counts.truncated += 1
            tokens, mask = tokens[:window], mask[:window]
        if not mask[1:].any():  # (a document's first token is no one's target)
            counts.untrained += 1
            continue
        ids.append(tokens)
        masks.append(mask)
    counts.tokens, counts.trained = sum(map(len, ids)), int(sum(m[1:].sum() for m in masks))
    if not ids:
        where = conversations[0].where.rsplit(":", 1)[0]
        raise UsageError(
            f"{where}: none of its {len(conversations)} conversation(s) leaves a token to train on "
            f"(data.loss_on={cfg.loss_on}, data.overflow={cfg.overflow}, data.seq_len={cfg.seq_len}); check the "
            "conversations' roles, or use a longer data.seq_len"
        )
    return _windows(ids, masks, window, tokenizer.get_vocab_size(with_added_tokens=True)), counts


def token_mask(offsets: Any, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap one of `spans`."""
    where = np.asarray(offsets, np.int64).reshape(-1, 2)
    mask = np.zeros(len(where), np.uint8)
    for start, end in spans:
        mask |= ((where[:, 0] < end) & (where[:, 1] > start)).astype(np.uint8)
    return mask


def _windows(ids: list[np.ndarray], masks: list[np.ndarray], window: int, vocab: int) -> dict[str, np.ndarray]:
    """Documents packed as token corpora are (tokens.Windows): whole, in order, padding after."""
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    stream = tk.TokenStream([np.concatenate(ids).astype(dtype)], [np.cumsum([len(t) for t in ids])])
    packed = tk.Windows(stream, window - 1, packing=True)
    arrays = tk.Examples(packed, len(packed), packed.spec(), ordered=True).take(range(len(packed)))
    loss_mask = np.zeros((len(packed), window), np.uint8)
    mask = np.concatenate(masks)
    for row, (start, stop) in enumerate(zip(packed.cuts[:-1].tolist(), packed.cuts[1:].tolist())):
        loss_mask[row, : stop - start] = mask[start:stop]
    return {**arrays, "loss_mask": loss_mask}
