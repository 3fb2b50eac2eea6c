"""A run's tokenizer: the one file that turns its token ids into text and back.

A workdir's `tokenizer.json` is the model's tokenizer: copied there from the corpus a run
trains on, or from the Hugging Face directory a model was imported from. Data whose token
ids mean something else (byte-level text, a corpus of another tokenizer) is refused, and
`sample` decodes with that file only."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from engine.errors import UsageError

TOKENIZER = "tokenizer.json"
HF_CONFIG = "hf_config.json"  # an imported model's config.json, kept in its workdir (eos ids, context)
# kept beside the tokenizer when a model is imported: special tokens, chat template, eos ids
TOKENIZER_COMPANIONS = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",  # transformers 5 keeps the chat template apart (engine/lm/chat.py reads and renders it)
)
# the end-of-text tokens a sample stops at, where the tokenizer has them
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
# what import-hf writes into a workdir besides config and weights: the model's facts (tokenizer,
# special tokens, chat template, generation settings, context length and eos ids); a run that
# starts from that workdir's weights gets a copy (carry_model_files), so its readers find them
MODEL_FILES = (TOKENIZER, *TOKENIZER_COMPANIONS, HF_CONFIG)
# the most a tokenizer.json may hold, checked by its size before it is read (the largest published
# ones are tens of MiB: Gemma 3's, of 262,144 tokens, is 33 MiB); a larger one is refused, not parsed
MAX_TOKENIZER_BYTES = 128 << 20
MAX_CONFIG_BYTES = 16 << 20  # tokenizer_config.json (with its added tokens), config.json, generation_config.json
MAX_TEMPLATE_BYTES = 1 << 20  # chat_template.jinja, and tokenizer_config.json's chat_template (1 MiB)


def check_size(path: Path, limit: int, what: str) -> None:
    """UsageError when the file at `path` holds more than `limit` bytes (its size, from a stat:
    nothing of it is read). `what`: the file's kind, said in the message."""
    size = path.stat().st_size if path.is_file() else 0
    if size > limit:
        raise UsageError(
            f"{path} holds {size:,} bytes, more than the {limit:,} ({limit / 2**20:g} MiB) a {what} may hold; "
            "give the model's own file (this one is damaged, or not what its name says)"
        )


def check_model_files(directory: Path) -> None:
    """check_size for each of the model files (MODEL_FILES) in `directory`: each refused by its size
    before any of them is read."""
    bounds = {TOKENIZER: MAX_TOKENIZER_BYTES, "chat_template.jinja": MAX_TEMPLATE_BYTES}
    for name in MODEL_FILES:
        check_size(directory / name, bounds.get(name, MAX_CONFIG_BYTES), name)


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """The bytes of the file at `path`, refused (check_size) when it holds more than `limit`; at
    most `limit` + 1 bytes are read, whatever the file does between the stat and the read."""
    check_size(path, limit, what)
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        check_size(path, limit, what)  # (it grew: said as of now)
        raise UsageError(f"{path} holds more than the {limit:,} bytes a {what} may hold; give the model's own file")
    return data


def load_tokenizer_file(path: Path, fix: str, where: str = ""):
    """The tokenizers.Tokenizer of `path`, its size checked first (MAX_TOKENIZER_BYTES); UsageError
    naming `where` (a key), the file and `fix` for a file tokenizers cannot read."""
    from tokenizers import Tokenizer

    check_size(path, MAX_TOKENIZER_BYTES, "tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for a malformed file
        raise UsageError(f"{where}{path} is not a readable Hugging Face tokenizers file ({e}); {fix}") from None


def run_tokenizer(work: Path, info) -> Optional[Path]:
    """The tokenizer.json a run's model reads: the copy in its workdir, else its corpus's."""
    if (work / TOKENIZER).is_file():
        return work / TOKENIZER
    return Path(info.tokenizer) if info.tokenizer and Path(info.tokenizer).is_file() else None


def copy_tokenizer(work: Path, info, out: Path) -> None:
    """The run's tokenizer into an export `out`, with an imported model's companions (special
    tokens, chat template, eos ids) where the workdir has them."""
    tokenizer = run_tokenizer(work, info)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / TOKENIZER)
    for name in TOKENIZER_COMPANIONS:
        if (work / name).is_file():
            shutil.copyfile(work / name, out / name)


def carry_model_files(base: Optional[Path], workdir: Path) -> None:
    """The model files (MODEL_FILES) of the workdir whose weights a run starts from, copied into the
    run's own workdir (each whole: a reader sees no half-written file). Copied once: a resume keeps
    what the run recorded at its start, whatever the base's files say now."""
    if base is None or base.resolve() == workdir.resolve():
        return
    for name in MODEL_FILES:
        if (base / name).is_file() and not (workdir / name).exists():
            partial = workdir / f".{name}.{os.getpid()}.tmp"
            try:
                shutil.copyfile(base / name, partial)
                os.replace(partial, workdir / name)
            finally:
                partial.unlink(missing_ok=True)


def model_tokenizer_file(workdir: Path, base: Optional[Path]) -> Path:
    """The tokenizer.json whose ids a run's model reads: its base's (carried into the workdir at
    start), else the workdir's own (an import's)."""
    return base / TOKENIZER if base is not None and (base / TOKENIZER).is_file() else workdir / TOKENIZER


def canonical(path: Path) -> str:
    """The tokenizer in `path` as `tokenizers` writes it; UsageError for a file it cannot read."""
    return load_tokenizer_file(path, "put the model's tokenizer.json there").to_str()


def check_data_tokenizer(model_tokenizer: Path, info, where: str = "data") -> None:
    """UsageError when the model's tokenizer (a workdir's tokenizer.json, where it has one) and the
    data's token ids disagree: byte-level text for a model with a tokenizer, or a corpus tokenized
    by another tokenizer."""
    _check_ids(model_tokenizer, info.text_codec, info.tokenizer, where)


def _check_ids(model_tokenizer: Path, text_codec: str, data_tokenizer: str, where: str) -> None:
    if not model_tokenizer.is_file() or text_codec not in ("bytes", "tokenizer"):
        return
    fix = (
        f"tokenize the text with the model's tokenizer (python launch.py tokenize --input TEXT... --out CORPUS "
        f"--tokenizer {model_tokenizer}) and train with data.name=tokens data.path=CORPUS, or use data.name="
        f"python_source data.tokenizer={model_tokenizer}"
    )
    if text_codec == "bytes":
        raise UsageError(f"{where} gives byte-level token ids, but the model reads {model_tokenizer}'s; {fix}")
    if canonical(Path(data_tokenizer)) != canonical(model_tokenizer):
        raise UsageError(
            f"{where} was tokenized with {data_tokenizer}, not the model's tokenizer ({model_tokenizer}); {fix}"
        )


def check_config_data(model_tokenizer: Path, data) -> None:
    """check_data_tokenizer for a config's data section, from the config alone (nothing is read or
    tokenized: import-hf leaves that to the first training run, which checks a corpus's own
    tokenizer): byte-level text, or the standard library (python_source) tokenized by another
    tokenizer, or by one without an end-of-text token to end each module with."""
    where = f"data (data.name={data.name})"
    if data.name == "text" or (data.name == "python_source" and data.tokenizer == "bytes"):
        _check_ids(model_tokenizer, "bytes", "", where)
    if data.name != "python_source" or data.tokenizer == "bytes":
        return
    if data.tokenizer.startswith("bpe:"):
        raise UsageError(
            f"{where} data.tokenizer={data.tokenizer} trains another tokenizer than the model's "
            f"({model_tokenizer}); use data.tokenizer={model_tokenizer}"
        )
    path = str(Path(data.tokenizer).expanduser())
    _check_ids(model_tokenizer, "tokenizer", path, where)
    tokenizer = load_tokenizer_file(Path(path), f"set data.tokenizer to the model's ({model_tokenizer})")
    if not any(tokenizer.token_to_id(token) is not None for token in END_OF_TEXT):
        raise UsageError(
            f"{data.tokenizer} has none of the end-of-text tokens {list(END_OF_TEXT)} that {where} ends each "
            f"module with; tokenize your text with the end token of your choice (python launch.py tokenize --input "
            f"TEXT... --out CORPUS --tokenizer {data.tokenizer} --eod-token TOKEN) and run import-hf with "
            f"data.name=tokens data.path=CORPUS"
        )


def eos_ids(work: Path, tokenizer) -> list[int]:
    """The ids a sample ends at: the imported model's eos_token_id(s) (config.json, generation_config.json)
    and the tokenizer's end-of-text tokens."""
    ids: set[int] = set()
    for name in (HF_CONFIG, "generation_config.json"):
        path = work / name
        if path.is_file():
            try:
                settings = json.loads(read_bounded(path, MAX_CONFIG_BYTES, name).decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise UsageError(
                    f"{path} is not valid JSON ({e}); import the model again, or remove the file"
                ) from None
            found = settings.get("eos_token_id") if isinstance(settings, dict) else None
            ids.update(int(i) for i in (found if isinstance(found, list) else [found]) if isinstance(i, int))
    if tokenizer is not None:
        ids.update(i for i in (tokenizer.token_to_id(token) for token in END_OF_TEXT) if i is not None)
    return sorted(ids)


def context_length(work: Path, info) -> int:
    """Tokens of context the model was trained at: data.seq_len, or an imported model's
    max_position_embeddings where larger."""
    context = int(info.seq_len)
    if (work / HF_CONFIG).is_file():
        imported = json.loads((work / HF_CONFIG).read_text()).get("max_position_embeddings")
        if isinstance(imported, int):
            context = max(context, imported)
    return context
