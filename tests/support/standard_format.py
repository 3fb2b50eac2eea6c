"""Helpers of tests/**/test_standard_format*.py that other test files (or its other tiers) share."""

import pytest

WORDS = ["the", "cat", "sat", "on", "mat", "hello", "there", "sort", ":", "3", "1", "4", "2"]


RECORDS = [
    {"prompt": "hello there", "completion": " the cat"},
    {"prompt": "sort: 3 1 4", "completion": " 1 3 4"},
    {"prompt": "the cat sat on", "completion": " the mat</s>"},  # (ends with it already: not added again)
]


def write_base_model(directory, eos=True):
    """A base model's files: a word-level tokenizer whose post-processor adds <s> (as Llama's does),
    with </s> (or no end-of-text token), and no chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    specials = ["<s>", "</s>", "<unk>"] if eos else ["<s>", "<unk>"]
    vocab = {token: k for k, token in enumerate([*specials, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    directory.mkdir(exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return write_base_model(tmp_path_factory.mktemp("base"))
