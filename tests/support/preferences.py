"""Helpers of tests/**/test_preferences*.py that other test files (or its other tiers) share."""

import pytest

from engine.config.data_sections import data_config
from engine.data.sources import load_dataset
from support.chat_data import write_jsonl, write_model_dir

PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "where is the cat?"}]


RECORDS = [
    {"prompt": "hello there", "chosen": "hi", "rejected": "how are you"},
    {
        "prompt": PROMPT,
        "chosen": [{"role": "assistant", "content": "on the mat"}],
        "rejected": [{"role": "assistant", "content": "the cat sat"}],
    },
    {"prompt": PROMPT[1:], "chosen": "the mat", "rejected": [{"role": "assistant", "content": "be brief"}]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model"))


def preference_data(tmp_path, model_dir, records, seq_len=64, held=None, **keys):
    """The preferences dataset of `records` (the held-out split: `held`, else the first record)."""
    train = write_jsonl(tmp_path / "train.jsonl", records)
    held = write_jsonl(tmp_path / "held.jsonl", held or records[:1])
    cfg = data_config(
        name="preferences", path=str(train), eval_path=str(held), tokenizer=str(model_dir), seq_len=seq_len, **keys
    )
    return load_dataset(cfg)
