"""TRL's standard format (issue 53, item 4): prompt/completion and preference records whose fields
are strings are plain text, concatenated with no chat template, the completion ended by the
tokenizer's end-of-text token and the tokenizer's BOS added as a base model expects; the loss
covers the completion only. A model without a chat template trains on them; message lists need
a template (the conversational format)."""

import json

import numpy as np
import pytest
from support import standard_format as standard_format_helpers
from support.chat_data import chat_data, write_model_dir
from support.preferences import preference_data
from support.standard_format import RECORDS, write_base_model

from engine.errors import UsageError

base_dir = standard_format_helpers.base_dir  # the fixture


def trl_rows(directory, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """What TRL's SFTTrainer makes of a standard prompt/completion: the completion with the eos
    token appended (unless it ends with it), tokenizer(prompt) and tokenizer(prompt + completion),
    the completion mask 0 on the prompt's tokens and 1 after."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    completion = completion if completion.endswith("</s>") else completion + "</s>"
    prompt_ids = tokenizer.encode(prompt).ids
    ids = tokenizer.encode(prompt + completion).ids
    assert ids[: len(prompt_ids)] == prompt_ids
    return ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))


def documents(split) -> list[tuple[list[int], list[int]]]:
    """The (tokens, loss mask) of each document of packed windows, by their segments."""
    out = []
    for tokens, segments, mask in zip(split["tokens"].tolist(), split["segments"], split["loss_mask"].tolist()):
        for segment in range(1, int(segments.max()) + 1):
            where = np.flatnonzero(segments == segment)
            out.append(([tokens[k] for k in where], [mask[k] for k in where]))
    return out


@pytest.mark.nocompile
def test_string_records_train_a_model_without_a_template_on_the_completion_as_trl_tokenizes_it(tmp_path, base_dir):
    data = chat_data(tmp_path, base_dir, RECORDS, seq_len=32)
    expected = [trl_rows(base_dir, r["prompt"], r["completion"]) for r in RECORDS]
    assert documents(data.train) == expected
    assert expected[0][0][0] == 0 and expected[0][0][-1] == 1  # <s> first, </s> last (once, for the third too)
    assert documents(data.eval) == expected[:1]
    assert "TRL's standard format (data.format=auto)" in data.info.notes[0] and "'</s>'" in data.info.notes[0]
    whole = chat_data(tmp_path, base_dir, RECORDS, seq_len=32, loss_on="all")
    # every target: all but the BOS the tokenizer adds (no text of the record's: a document's first token is no target)
    assert [mask for _, mask in documents(whole.train)] == [[0] + [1] * (len(ids) - 1) for ids, _ in expected]


@pytest.mark.nocompile
def test_string_preference_pairs_are_plain_text_with_the_response_trained(tmp_path, base_dir):
    pairs = [
        {"prompt": "sort: 3 1 4", "chosen": " 1 3 4", "rejected": " 3 1 4"},
        {"prompt": "hello", "chosen": " there", "rejected": " the cat"},
    ]
    data = preference_data(tmp_path, base_dir, pairs, seq_len=16)
    for pair, tokens, mask, segments in zip(
        pairs, data.train["tokens"], data.train["loss_mask"], data.train["segments"]
    ):
        for row, side in enumerate(("chosen", "rejected")):
            ids, trained = trl_rows(base_dir, pair["prompt"], pair[side])
            size = int(segments[row].sum())
            assert (tokens[row, :size].tolist(), mask[row, :size].tolist()) == (ids, trained)


@pytest.mark.nocompile
def test_which_records_each_format_takes(tmp_path, base_dir):
    messages = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "there"}]}
    with pytest.raises(UsageError, match=r'train.jsonl:2: a "messages" record: this data is read in the standard'):
        chat_data(tmp_path, base_dir, [RECORDS[0], messages])
    listed = {"prompt": "hello", "completion": [{"role": "assistant", "content": "there"}]}
    with pytest.raises(UsageError, match=r'train.jsonl:2: "completion" is a JSON list, not a string: this data is'):
        chat_data(tmp_path, base_dir, [RECORDS[0], listed])
    with pytest.raises(UsageError, match=r"has no chat template .*data.format=conversational"):
        chat_data(tmp_path, base_dir, RECORDS, format="conversational")

    # a chat model's string records: rendered with its template, or (standard) as plain text
    chat_model = write_model_dir(tmp_path)  # (its eos_token: <|im_end|>)
    templated = chat_data(tmp_path, chat_model, RECORDS[:2], seq_len=64)
    plain = chat_data(tmp_path, chat_model, RECORDS[:2], seq_len=64, format="standard")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    first = [tokenizer.decode(ids, skip_special_tokens=False) for ids, _ in documents(templated.train)][0]
    assert first.startswith("<s><|im_start|>user\nhello there<|im_end|>")
    ids, mask = documents(plain.train)[0]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "hello there the cat<|im_end|>"
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == " the cat<|im_end|>"


@pytest.mark.nocompile
def test_a_tokenizer_without_an_end_of_text_token_is_refused_for_the_standard_format(tmp_path):
    bare = write_base_model(tmp_path / "bare", eos=False)
    with pytest.raises(UsageError, match=r"ends each completion with .*bare's end-of-text token, and it has none"):
        chat_data(tmp_path, bare, RECORDS[:2])
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<end>"}))  # not one of its tokens
    with pytest.raises(UsageError, match=r"end-of-text token '<end>' .*does not read as one token"):
        chat_data(tmp_path, bare, RECORDS[:2])
