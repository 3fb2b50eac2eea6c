"""Helpers of tests/**/test_chat_data*.py that other test files (or its other tiers) share."""

import json

import numpy as np
import pytest

from engine.config.data_sections import data_config
from engine.data.sources import load_dataset

SPECIAL = ["<s>", "<|im_start|>", "<|im_end|>"]


# ChatML, as Qwen's templates write it, with a bos token and a refusal of roles it does not know
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


END = "<|im_end|>\n"  # what the template writes after a message's content, inside its span


CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the cat sat"},  # the same text as the assistant's answer: not trained on
    {"role": "assistant", "content": "the cat sat"},
    {"role": "user", "content": "how are you?"},
    {"role": "assistant", "content": "well, thank you"},
]


RECORDS = [
    {"messages": CONVERSATION},
    {"prompt": "hello there", "completion": "hi"},
    {"prompt": [{"role": "user", "content": "where?"}], "completion": [{"role": "assistant", "content": "on the mat"}]},
    {"messages": [{"role": "user", "content": "no answer"}]},  # nothing to train on (assistant, completion)
]


LLAMA = dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=48)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model"))


def write_model_dir(directory):
    """`directory` made a model's directory as import-hf leaves it: a byte-level BPE tokenizer.json
    (trained here, offline) and tokenizer_config.json with the chat template and special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["hello there how are you", "the cat sat on the mat", "be brief", "system user assistant"]
    tokenizer.train_from_iterator(text * 20, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat_data(tmp_path, model_dir, records, seq_len=128, **keys):
    """The chat dataset of `records`, every one trained (the held-out split: the first record)."""
    train = write_jsonl(tmp_path / "train.jsonl", records)
    held = write_jsonl(tmp_path / "held.jsonl", records[:1])
    cfg = data_config(
        name="chat", path=str(train), eval_path=str(held), tokenizer=str(model_dir), seq_len=seq_len, **keys
    )
    return load_dataset(cfg)


def masked_runs(model_dir, split) -> list[str]:
    """The text of each run of consecutive tokens the loss mask marks, window by window."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    runs = []
    for tokens, mask in zip(split["tokens"].tolist(), split["loss_mask"]):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        for start, stop in zip(edges[::2], edges[1::2]):
            runs.append(tokenizer.decode(tokens[start:stop], skip_special_tokens=False))
    return runs
