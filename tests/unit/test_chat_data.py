"""data.name=chat (issue 45, item 1): conversations rendered with the model's chat template as
transformers renders them, tokenized with its tokenizer, packed, and a loss mask that covers
exactly the rendered spans data.loss_on names; overflow and bad data."""

import json

import numpy as np
import pytest
from support import chat_data as chat_data_helpers
from support.chat_data import CONVERSATION, END, RECORDS, TEMPLATE, chat_data, masked_runs, write_jsonl

from engine.config.data_sections import data_config
from engine.data.conversations import Conversation, loss_spans, read_conversations
from engine.data.sources import load_dataset
from engine.errors import UsageError
from engine.lm.chat import Renderer, read_chat_template

model_dir = chat_data_helpers.model_dir  # the fixture


@pytest.mark.nocompile
def test_conversations_render_as_transformers_renders_them(model_dir):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>", eos_token="<|im_end|>"
    )
    reference.chat_template = TEMPLATE
    template = read_chat_template(model_dir)
    assert template is not None
    render = Renderer(template, "fix it")
    for end in range(1, len(CONVERSATION) + 1):
        messages = CONVERSATION[:end]
        text, _ = loss_spans(render, Conversation("x.jsonl:1", messages, None), "assistant")
        assert text == reference.apply_chat_template(messages, tokenize=False)
        prompt = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render(messages, add_generation_prompt=True) == prompt
    # and the packed tokens are the reference tokenizer's ids of that text
    text = reference.apply_chat_template(CONVERSATION, tokenize=False)
    ids = reference(text, add_special_tokens=False)["input_ids"]
    from tokenizers import Tokenizer

    packed = load_dataset(
        data_config(
            name="chat",
            path=str(write_jsonl(model_dir / "one.jsonl", [{"messages": CONVERSATION}] * 2)),
            tokenizer=str(model_dir),
            seq_len=128,
            eval_fraction=0.5,
        )
    ).train
    assert packed["tokens"][0, : len(ids)].tolist() == ids
    assert Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=False) == text


@pytest.mark.nocompile
def test_the_loss_mask_covers_exactly_the_spans_loss_on_names(tmp_path, model_dir):
    data = chat_data(tmp_path, model_dir, RECORDS)
    assistant = [m["content"] + END for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(model_dir, data.train) == [*assistant, "hi" + END, "on the mat" + END]
    assert masked_runs(model_dir, data.eval) == assistant
    assert (
        "train: 4 conversations (0 truncated to 129 tokens, 0 dropped as longer, 1 with no token" in data.info.notes[0]
    )

    data = chat_data(tmp_path, model_dir, RECORDS, loss_on="completion")
    assert masked_runs(model_dir, data.train) == ["well, thank you" + END, "hi" + END, "on the mat" + END]
    data = chat_data(tmp_path, model_dir, RECORDS, loss_on="all")
    assert np.array_equal(data.train["loss_mask"], data.train["segments"] > 0)
    assert (
        "train: 4 conversations (0 truncated to 129 tokens, 0 dropped as longer, 0 with no token" in data.info.notes[0]
    )


@pytest.mark.nocompile
def test_a_template_whose_generation_prompt_differs_trains_from_the_message_on(tmp_path, model_dir):
    """Where the generation prompt is not how the template begins a message, the span begins
    where the messages before it end (the role header included)."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (other / "chat_template.jinja").write_text(template + "{% if add_generation_prompt %}reply:{% endif %}")
    data = chat_data(tmp_path, other, [{"prompt": "hello", "completion": "hi"}, *RECORDS[:1]])
    assert masked_runs(other, data.train)[0] == "assistant: hi\n"


@pytest.mark.nocompile
def test_overflow_truncates_drops_or_refuses_and_is_counted(tmp_path, model_dir):
    long = {"messages": [{"role": "user", "content": "hello " * 2}, {"role": "assistant", "content": "cat " * 30}]}
    records = [RECORDS[1], long, RECORDS[2]]
    data = chat_data(tmp_path, model_dir, records, seq_len=40)
    assert "3 conversations (1 truncated to 41 tokens, 0 dropped as longer, 0 with no token" in data.info.notes[0]
    assert data.info.num_train == 3 and (data.train["segments"][1] == 1).all()  # the long one fills its window
    cut = masked_runs(model_dir, data.train)[1]
    assert cut.startswith("cat cat") and not cut.endswith(END)  # the end of the long one is cut off

    data = chat_data(tmp_path, model_dir, records, seq_len=40, overflow="drop")
    assert "3 conversations (0 truncated to 41 tokens, 1 dropped as longer, 0 with no token" in data.info.notes[0]
    assert masked_runs(model_dir, data.train) == ["hi" + END, "on the mat" + END]

    with pytest.raises(UsageError, match=r"train.jsonl:2: the conversation is \d+ tokens, more than data.seq_len"):
        chat_data(tmp_path, model_dir, records, seq_len=40, overflow="error")


BAD = [
    ('{"messages": [{"role": "user"}]}', r'train.jsonl:2: messages\[0\] has no "content"'),
    ('{"messages": [{"role": "user", "content": 3}]}', r"train.jsonl:2: messages\[0\].content is a JSON int"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', r"train.jsonl:2: .*refused the messages: unknown role: tool"),
    ('{"prompt": "hi"}', r'train.jsonl:2: "prompt" without "completion"'),
    ('{"prompt": [{"content": "hi"}], "completion": "x"}', r'train.jsonl:2: prompt\[0\] has no "role"'),
    ('{"text": "hi"}', r'train.jsonl:2: no "messages" or "prompt" field'),
    ('{"messages": []}', r'train.jsonl:2: "messages" is empty'),
    ("[1, 2]", r"train.jsonl:2: a JSON list, not an object"),
    ("{not json", r"train.jsonl:2: not a JSON record"),
]


@pytest.mark.nocompile
@pytest.mark.parametrize("line, match", BAD)
def test_bad_data_names_the_file_the_line_and_the_field(tmp_path, model_dir, line, match):
    with pytest.raises(UsageError, match=match):
        chat_data(tmp_path, model_dir, [RECORDS[1], line])


@pytest.mark.nocompile
def test_an_empty_file_and_a_template_that_renders_prefixes_otherwise_are_refused(tmp_path, model_dir):
    with pytest.raises(UsageError, match=r"train.jsonl holds no conversations"):
        chat_data(tmp_path, model_dir, ["", " "])
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (other / "chat_template.jinja").write_text(
        "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(UsageError, match=r"train.jsonl:1: the chat template .* use data.loss_on=all"):
        chat_data(tmp_path, other, RECORDS[:2])
    chat_data(tmp_path, other, RECORDS[:2], loss_on="all")  # all needs no spans


@pytest.mark.nocompile
def test_data_tokenizer_is_a_tokenizers_file_of_any_name_or_a_directory_holding_tokenizer_json(tmp_path, model_dir):
    """A file is used as it is (the chat template is its directory's); a directory gives its
    tokenizer.json; anything else is refused naming data.tokenizer."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer_config.json").write_bytes((model_dir / "tokenizer_config.json").read_bytes())
    (other / "custom.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (other / "tokenizer.json").write_text("{}")  # not the one named: never read
    by_file = chat_data(tmp_path, other / "custom.json", RECORDS)
    by_directory = chat_data(tmp_path, model_dir, RECORDS)
    assert by_file.info.tokenizer == str(other / "custom.json")
    assert by_directory.info.tokenizer == str(model_dir / "tokenizer.json")
    assert all(np.array_equal(by_file.train[k], by_directory.train[k]) for k in by_directory.train)
    with pytest.raises(UsageError, match=r"data.tokenizer: .*tokenizer.json is not a readable Hugging Face tokenizers"):
        chat_data(tmp_path, other, RECORDS)  # (its tokenizer.json is no tokenizer)
    (other / "tokenizer.json").unlink()
    with pytest.raises(UsageError, match=r"data.tokenizer=.*other: the directory has no tokenizer.json"):
        chat_data(tmp_path, other, RECORDS)
    with pytest.raises(UsageError, match=r"data.tokenizer=.*missing is neither a file nor a directory; give"):
        chat_data(tmp_path, tmp_path / "missing", RECORDS)
    (other / "not_a_tokenizer.json").write_text("not json")
    with pytest.raises(UsageError, match=r"data.tokenizer: .*not_a_tokenizer.json is not .*set data.tokenizer"):
        chat_data(tmp_path, other / "not_a_tokenizer.json", RECORDS)


@pytest.mark.nocompile
def test_a_line_that_is_not_utf8_is_refused_naming_its_file_line_and_byte(tmp_path):
    first = json.dumps(RECORDS[1]).encode() + b"\n"
    (tmp_path / "train.jsonl").write_bytes(first + b'{"prompt": "caf\xe9", "completion": "x"}\n')
    offset = len(first) + len(b'{"prompt": "caf')
    with pytest.raises(
        UsageError, match=rf"train.jsonl:2: not UTF-8 text \(byte {offset} of the file, b'\\xe9'.*UTF-8"
    ):
        read_conversations(tmp_path / "train.jsonl", "data.path")
    (tmp_path / "train.jsonl").write_bytes(first + '{"prompt": "café", "completion": "x"}\r\n'.encode())
    assert read_conversations(tmp_path / "train.jsonl", "data.path")[1].messages[0]["content"] == "café"
