"""The `data` section's schema: the keys every source takes (DataConfig), and for each source of
engine/data/sources.py a dataclass that adds the keys it reads, chosen by data.name as model.name
chooses the model's section. `DataConfig(name=..., **keys)` builds the chosen source's section.

Imports no jax: a sweep's process reads every run's config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

from contract.fields import option
from engine.data import sources
from engine.data.sources import SOURCES


def _name(read: Callable) -> Any:
    """data.name's field of the section of the source `read` (its default: that source)."""
    source = next(name for name, function in SOURCES.items() if function is read)
    return option(
        source, "the dataset: a source of engine/data/sources.py (see docs/data.md)", choices=lambda: tuple(SOURCES)
    )


@dataclass(frozen=True)
class DataConfig:
    """The keys of every source (data.path: of those that read files); the chosen source's own keys
    are in its section below."""

    reads: ClassVar[Optional[Callable]] = None  # the source (engine/data/sources.py) a section is of

    name: str = _name(sources.digits)
    path: Optional[str] = option(
        None, "the file or directory for npz, idx, cifar10, text, tokens, table, chat, preferences and prompts"
    )
    shuffle: bool = option(True, "reshuffle every epoch; the order is a function of (seed, epoch)")
    prefetch: int = option(
        2,
        "blocks of batches prepared and put on the devices ahead of the step, in a background thread (0 = none)",
        at_least=0,
    )
    steps_per_transfer: int = option(
        1,
        "training batches moved to the devices in one copy ([K, batch, ...]; "
        "each step picks its own); raised to a multiple of train.steps_per_call",
        at_least=1,
    )
    placement: str = option(
        "auto",
        "device: the whole train split lives on every device and each step gathers "
        "its rows inside the compiled step; host: batches are gathered on the host; "
        "auto: device when it fits in data.device_memory_fraction",
        choices=("auto", "host", "device"),
    )
    device_memory_fraction: float = option(
        0.25,
        "placement=auto: the share of one device's memory (CPU: the host's memory per device) the train split may take",
        above=0.0,
    )

    def __new__(cls, *args: Any, **keys: Any) -> Any:
        """DataConfig(name=source, ...) is that source's section (its class in DATA_CONFIGS)."""
        chosen = DATA_CONFIGS.get(keys.get("name", "digits"), cls) if cls is DataConfig else cls
        return object.__new__(chosen)

    if TYPE_CHECKING:

        def __getattr__(self, key: str) -> Any: ...  # the chosen source's own keys


# The keys several sources read: one declaration each.
def _eval_fraction() -> Any:
    return option(0.2, "held-out share when the source has no test split (a fixed split, whatever the seed)", above=0.0)


def _eval_path() -> Any:
    return option(
        None,
        "table, text, chat, preferences, prompts: the held-out split read from these files (as data.path takes "
        "them) instead of data.eval_fraction of data.path; all of data.path then trains",
    )


def _num_examples() -> Any:
    return option(4096, "synthetic, synthetic_text: training examples generated (eval gets a quarter)", at_least=1)


def _num_classes() -> Any:
    return option(10, "synthetic: classes made; npz: labels must lie in [0, num_classes)")


def _seq_len() -> Any:
    return option(128, "token sources: tokens the model sees per example (it predicts the next)", at_least=1)


def _packing() -> Any:
    return option(
        True,
        "tokens: pack whole documents into windows with segment ids and positions "
        "(else windows are cut from the concatenated stream)",
    )


def _overflow() -> Any:
    return option(
        "truncate",
        "chat: a conversation longer than data.seq_len + 1 tokens is cut to them (truncate), left out (drop) or "
        "refused (error: exit 2 naming its file and line); preferences: a pair's longer response is cut so that "
        "the prompt (kept whole) and it fit (a pair whose prompt alone fills them is left out), the pair left "
        "out, or refused; the counts are said at the start",
        choices=("truncate", "drop", "error"),
    )


def _model_tokenizer() -> Any:
    return option(
        "",
        "chat, preferences, prompts: the directory (an import-hf workdir, or a Hugging Face directory) whose "
        "tokenizer.json and chat template render and tokenize the conversations, or a tokenizers JSON file of any "
        "name (with its directory's chat template); \"\" = the model's: finetune.base's or "
        "checkpoint.restore_from's workdir, else the run's own",
    )


def _format() -> Any:
    return option(
        "auto",
        "chat, preferences, prompts: how string records are read: standard (TRL's standard format: prompt and "
        "completion concatenated as plain text, the tokenizer's end-of-text token after the completion, its BOS as it "
        "adds it; no chat template, message lists refused), conversational (each string one user's or assistant's "
        "message, rendered with the chat template, as message lists are), auto (standard where the model has no chat "
        "template, else conversational)",
        choices=("auto", "standard", "conversational"),
    )


def _verify() -> Any:
    return option(True, "tokens: check every shard's SHA-256 against the manifest at start")


@dataclass(frozen=True)
class DigitsData(DataConfig):
    reads: ClassVar[Callable] = sources.digits
    name: str = _name(reads)
    eval_fraction: float = _eval_fraction()


@dataclass(frozen=True)
class SyntheticData(DataConfig):
    reads: ClassVar[Callable] = sources.synthetic
    name: str = _name(reads)
    num_examples: int = _num_examples()
    image_shape: list[int] = option([8, 8, 1], "synthetic: [height, width, channels]")
    num_classes: int = _num_classes()


@dataclass(frozen=True)
class NpzData(DataConfig):
    reads: ClassVar[Callable] = sources.npz
    name: str = _name(reads)
    eval_fraction: float = _eval_fraction()
    num_classes: int = _num_classes()


@dataclass(frozen=True)
class IdxData(DataConfig):
    reads: ClassVar[Callable] = sources.idx
    name: str = _name(reads)


@dataclass(frozen=True)
class Cifar10Data(DataConfig):
    reads: ClassVar[Callable] = sources.cifar10
    name: str = _name(reads)


@dataclass(frozen=True)
class TextData(DataConfig):
    reads: ClassVar[Callable] = sources.text
    name: str = _name(reads)
    eval_fraction: float = _eval_fraction()
    eval_path: Optional[str] = _eval_path()
    seq_len: int = _seq_len()


@dataclass(frozen=True)
class SyntheticTextData(DataConfig):
    reads: ClassVar[Callable] = sources.synthetic_text
    name: str = _name(reads)
    eval_fraction: float = _eval_fraction()
    num_examples: int = _num_examples()
    seq_len: int = _seq_len()
    vocab_size: int = option(256, "synthetic_text: the vocabulary (byte-level text is always 256)")


@dataclass(frozen=True)
class PythonSourceData(DataConfig):
    reads: ClassVar[Callable] = sources.python_source
    name: str = _name(reads)
    eval_fraction: float = _eval_fraction()
    seq_len: int = _seq_len()
    max_bytes: int = option(4_000_000, "python_source: bytes of text read")
    packing: bool = _packing()
    verify: bool = _verify()
    tokenizer: str = option(
        "bytes",
        "python_source: bytes (ids are UTF-8 bytes), bpe:N (a byte-level BPE of N tokens trained on the "
        "text) or a tokenizer.json (an imported model's); tokenized once into data.cache_dir",
    )
    cache_dir: str = option(
        "~/.cache/jax-engine/tokens", "python_source with a tokenizer: where the tokenized corpus is kept and reused"
    )


@dataclass(frozen=True)
class TokensData(DataConfig):
    reads: ClassVar[Callable] = sources.tokens
    name: str = _name(reads)
    seq_len: int = _seq_len()
    packing: bool = _packing()
    sources: list[Any] = option(
        [], "tokens: a mixture instead of data.path: [{path: DIR, weight: 0.7, name: web}, ...] (one tokenizer for all)"
    )
    verify: bool = _verify()


@dataclass(frozen=True)
class TableData(DataConfig):
    reads: ClassVar[Callable] = sources.table
    name: str = _name(reads)
    eval_fraction: float = _eval_fraction()
    eval_path: Optional[str] = _eval_path()
    label: str = option("", "table: the label column")
    target: str = option(
        "classification",
        "table: classification (the label's values are the classes) or regression (a number)",
        choices=("classification", "regression"),
    )
    classes: list[Any] = option(
        [],
        "table, classification: the classes in order (a label outside them is an error); "
        "[] = the label's values, sorted",
    )
    weight: str = option("", 'table: a column of per-row loss weights ("" = every row counts 1)')
    features: list[Any] = option(
        [],
        "table: the feature columns, [{name: age, kind: numeric, normalize: zscore}, ...]: numeric, "
        "bucketized, categorical, crossed, indicator, embedding (docs/data.md#tables)",
    )


@dataclass(frozen=True)
class ChatData(DataConfig):
    reads: ClassVar[Callable] = sources.chat
    name: str = _name(reads)
    eval_fraction: float = _eval_fraction()
    eval_path: Optional[str] = _eval_path()
    seq_len: int = _seq_len()
    loss_on: str = option(
        "assistant",
        "chat: the tokens the loss covers: assistant (each assistant message's span of the rendered text: its "
        "content and what the template writes after it, such as the end-of-turn token), completion (a "
        "prompt/completion record's completion; a messages record's last message, where it is the assistant's) "
        "or all",
        choices=("assistant", "completion", "all"),
    )
    overflow: str = _overflow()
    tokenizer: str = _model_tokenizer()
    format: str = _format()


@dataclass(frozen=True)
class PreferencesData(DataConfig):
    """Preference pairs (JSON Lines of prompt, chosen, rejected) for train.objective=dpo."""

    reads: ClassVar[Callable] = sources.preferences
    name: str = _name(reads)
    eval_fraction: float = _eval_fraction()
    eval_path: Optional[str] = _eval_path()
    seq_len: int = _seq_len()
    overflow: str = _overflow()
    tokenizer: str = _model_tokenizer()
    format: str = _format()


@dataclass(frozen=True)
class PromptsData(DataConfig):
    """Prompts (JSON Lines of prompt and the fields the reward functions read) for train.objective=grpo."""

    reads: ClassVar[Callable] = sources.prompts
    name: str = _name(reads)
    eval_fraction: float = _eval_fraction()
    eval_path: Optional[str] = _eval_path()
    tokenizer: str = _model_tokenizer()
    format: str = _format()


_SECTIONS = (
    DigitsData,
    SyntheticData,
    NpzData,
    IdxData,
    Cifar10Data,
    TextData,
    SyntheticTextData,
    PythonSourceData,
    TokensData,
    TableData,
    ChatData,
    PreferencesData,
    PromptsData,
)


def _section_of(name: str, read: Callable) -> type:
    sections = [cls for cls in _SECTIONS if cls.reads is read]
    if len(sections) != 1:
        raise TypeError(f"data source {name!r} needs one section class in _SECTIONS (engine/config/data_sections.py)")
    return sections[0]


DATA_CONFIGS: dict[str, type] = {  # data.name → its section, in engine/data/sources.py's order
    name: _section_of(name, read) for name, read in SOURCES.items()
}


def own_keys(source: str) -> list[dataclasses.Field]:
    """The fields of a source's section that DataConfig does not have."""
    common = {f.name for f in dataclasses.fields(DataConfig)}
    return [f for f in dataclasses.fields(DATA_CONFIGS[source]) if f.name not in common]


def owners(key: str) -> list[str]:
    """The sources whose section has `key`."""
    return [source for source in DATA_CONFIGS if any(f.name == key for f in own_keys(source))]


def with_keys(data: DataConfig, **keys: Any) -> DataConfig:
    """`data` with these of its source's keys changed (a new section)."""
    return dataclasses.replace(data, **keys)


def data_config(**keys: Any) -> DataConfig:
    """The section of data.name=keys["name"] (default digits) with these keys."""
    return DataConfig(**keys)
