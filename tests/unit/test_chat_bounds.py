"""Hostile chat and preference data and model files (issue 57, items 5, 6 and 10): the rendering
of one record is bounded as a whole (messages, loop iterations, characters, time), a lone
surrogate is named by file, line and field, and oversized template and tokenizer files are
refused by their size before a byte is read. Each is one UsageError; nothing is compiled."""

import json
import time

import pytest
from support.chat_data import RECORDS, chat_data, write_jsonl, write_model_dir
from support.preferences import RECORDS as PAIRS
from support.preferences import preference_data

from engine.data.conversations import MAX_MESSAGES, Conversation, loss_spans, read_conversations
from engine.errors import UsageError
from engine.lm import chat
from engine.lm.chat import Renderer, read_chat_template
from engine.lm.tokenizer import MAX_CONFIG_BYTES, MAX_TEMPLATE_BYTES, MAX_TOKENIZER_BYTES

pytestmark = pytest.mark.nocompile


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model"))


def _conversation(count: int) -> list[dict]:
    return [{"role": "user" if k % 2 == 0 else "assistant", "content": "the cat sat"} for k in range(count)]


def test_a_record_of_30000_messages_is_refused_in_well_under_a_second(tmp_path):
    """Before: one 1 MB line of 30,000 empty messages was still loading after 180 s."""
    line = json.dumps({"messages": [{"role": "user", "content": ""}] * 30_000})
    path = write_jsonl(tmp_path / "train.jsonl", [RECORDS[1], line])
    began = time.monotonic()
    with pytest.raises(
        UsageError, match=rf'train.jsonl:2: "messages" holds 30,000 messages, more than the {MAX_MESSAGES:,}'
    ):
        read_conversations(path, "data.path")
    assert time.monotonic() - began < 1  # (0.05 s here alone; the bound is checked before any message)


@pytest.mark.parametrize(
    "bound, value, match",
    [
        ("RECORD_ITERATIONS", 100, "runs more than 100 loop iterations for one record"),
        ("RECORD_OUTPUT_CHARS", 2_000, "writes more than 2,000 characters for one record"),
        ("RECORD_SECONDS", 0.0, "takes longer than 0 s for one record"),
    ],
)
def test_all_the_renders_of_one_record_share_its_bounds(model_dir, monkeypatch, bound, value, match):
    """A record of 40 messages renders within each render's bounds, but its ~40 renders (two
    prefixes per assistant message) together pass the record's."""
    template = read_chat_template(model_dir)
    assert template is not None
    render = Renderer(template, "fix it")
    conversation = Conversation("train.jsonl:7", _conversation(40), None)
    loss_spans(render, conversation, "assistant")  # within the bounds as they are
    monkeypatch.setattr(chat, bound, value)
    with pytest.raises(UsageError, match=rf"^train.jsonl:7: .*tokenizer_config.json \(chat_template\): .*{match}"):
        loss_spans(render, conversation, "assistant")
    render(conversation.messages)  # (a render that is no record's keeps each render's own bounds)


def test_a_template_that_loops_far_more_than_its_messages_is_refused_at_the_first_record(tmp_path, model_dir):
    """Before: a template inside every per-render bound (891,000 loop iterations) had not loaded
    4,200 conversations after 120 s. A render of training data may run 1,000 loop iterations, 100
    a message and 1 a character (20 conversations: seconds each without that bound)."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    loops = "{% for i in range(1000) %}{% for j in range(891) %}{% endfor %}{% endfor %}"  # 891,000 iterations
    template = loops + "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (slow / "chat_template.jinja").write_text(template)
    began = time.monotonic()
    with pytest.raises(UsageError, match=r"train.jsonl:1: .*runs more than 1,2\d\d loop iterations to render 2 mess"):
        chat_data(tmp_path, slow, [RECORDS[1]] * 20)
    assert time.monotonic() - began < 5
    assert chat.render_chats(read_chat_template(slow), [RECORDS[0]["messages"]], "fix")  # (sample --chat's: 1,000,000)
    # preference pairs: each prompt is rendered alone first (to name a role the template refuses in it): a
    # record's bounds too (it ran 891,000 iterations a pair, the per-render 1,000,000 allowing it)
    began = time.monotonic()
    with pytest.raises(
        UsageError, match=r"train.jsonl:1: prompt: .*runs more than 1,\d{3} loop iterations to render 1 mes"
    ):
        preference_data(tmp_path, slow, [PAIRS[0]] * 20)
    assert time.monotonic() - began < 5


@pytest.mark.parametrize(
    "record, field",
    [
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, r"messages\[0\].content"),
        ({"prompt": "\udfff", "completion": "x"}, "prompt"),
        ({"prompt": "x", "completion": [{"role": "assistant\ud800", "content": "y"}]}, r"completion\[0\].role"),
    ],
)
def test_a_lone_surrogate_in_chat_data_is_named_by_file_line_and_field(tmp_path, model_dir, record, field):
    """Before: a TypeError traceback from the tokenizer. JSON's \\ud800 escape is valid JSON."""
    line = json.dumps(record)  # (json writes the lone surrogate as its escape, as a user's file has it)
    with pytest.raises(UsageError, match=rf"train.jsonl:2: {field} holds a lone surrogate \(\\u[0-9a-f]{{4}}, at char"):
        chat_data(tmp_path, model_dir, [RECORDS[1], line])


@pytest.mark.parametrize("side", ["prompt", "chosen", "rejected"])
def test_a_lone_surrogate_in_a_preference_pair_is_named_by_file_line_and_field(tmp_path, model_dir, side):
    line = json.dumps({**PAIRS[0], side: "hi \ud800"})
    with pytest.raises(UsageError, match=rf"train.jsonl:2: {side} holds a lone surrogate"):
        preference_data(tmp_path, model_dir, [PAIRS[0], line])


def test_a_template_that_writes_a_lone_surrogate_is_named(tmp_path, model_dir):
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (other / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ '\\ud800' }}")
    with pytest.raises(UsageError, match=r"train.jsonl:1: .*chat_template.jinja: the chat template writes a lone surr"):
        chat_data(tmp_path, other, [RECORDS[1]] * 2, loss_on="all")


@pytest.mark.parametrize(
    "name, bound",
    [
        ("chat_template.jinja", MAX_TEMPLATE_BYTES),
        ("tokenizer_config.json", MAX_CONFIG_BYTES),
        ("tokenizer.json", MAX_TOKENIZER_BYTES),
    ],
)
def test_an_oversized_template_or_tokenizer_file_is_refused_by_its_size_before_it_is_read(
    tmp_path, model_dir, monkeypatch, name, bound
):
    """Before: a 1.5 GB chat_template.jinja took 4.85 GB of memory to say it 'takes longer than 5 s
    to render'. A file one byte over its bound (sparse: nothing is written) is refused by a stat;
    reading it would be refused too (open() is not called)."""
    huge = tmp_path / "huge"
    huge.mkdir()
    for kept in ("tokenizer.json", "tokenizer_config.json"):
        (huge / kept).write_bytes((model_dir / kept).read_bytes())
    with open(huge / name, "r+b" if (huge / name).exists() else "wb") as f:
        f.truncate(bound + 1)
    opened = []
    real_open = open

    def watched(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watched)
    with pytest.raises(UsageError, match=rf"{name} holds {bound + 1:,} bytes, more than the {bound:,} \("):
        chat_data(tmp_path, huge, RECORDS[1:3])
    assert not [path for path in opened if path.startswith(str(huge))]


def test_tokenize_refuses_an_oversized_tokenizer_json_by_its_size(tmp_path):
    from engine.data.pretokenize import load_tokenizer

    with open(tmp_path / "tokenizer.json", "wb") as f:
        f.truncate(MAX_TOKENIZER_BYTES + 1)  # (sparse: nothing is written, nor read)
    with pytest.raises(UsageError, match=rf"tokenizer.json holds {MAX_TOKENIZER_BYTES + 1:,} bytes, more than the"):
        load_tokenizer(str(tmp_path))


def test_import_hf_refuses_an_oversized_template_before_it_reads_the_directory(tmp_path, model_dir):
    """Before: import-hf read a 1.5 GB chat_template.jinja whole (4.85 GB of memory)."""
    from engine.hub.hf import _tokenizer_files

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    with open(hf / "chat_template.jinja", "wb") as f:
        f.truncate(MAX_TEMPLATE_BYTES + 1)
    with pytest.raises(UsageError, match=rf"chat_template.jinja holds {MAX_TEMPLATE_BYTES + 1:,} bytes, more than"):
        _tokenizer_files(hf)


GENERATION = (  # the test's ChatML template, the assistant's turns marked as transformers' assistant masks read them
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_generation_blocks_gives_a_records_spans_from_one_render(tmp_path, model_dir, monkeypatch):
    """Two prefixes per assistant message made 4,000 messages take 42.6 s; {% generation %} blocks
    say where each assistant's turn is in one render. A block the template writes into a macro's
    buffer after other text is not where it is said to be: the prefixes are rendered instead."""
    from support.chat_data import END, masked_runs

    marked = tmp_path / "marked"
    marked.mkdir()
    (marked / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (marked / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": GENERATION}))
    renders = []
    counted = Renderer.__call__
    monkeypatch.setattr(Renderer, "__call__", lambda self, *a, **k: renders.append(1) or counted(self, *a, **k))
    conversation = RECORDS[0]["messages"]  # (two assistant messages)
    data = chat_data(tmp_path, marked, [RECORDS[0]])
    assert len(renders) == 2  # one a record (train, held out)
    assert masked_runs(marked, data.train) == [
        m["content"] + END.strip() for m in conversation if m["role"] == "assistant"
    ]
    template = read_chat_template(marked)
    assert template is not None
    long = Conversation("x.jsonl:1", _conversation(MAX_MESSAGES), None)
    began = time.monotonic()
    text, spans = loss_spans(Renderer(template, "fix"), long, "assistant")
    assert len(spans) == MAX_MESSAGES // 2 and all(text[a:b] == "the cat sat<|im_end|>" for a, b in spans)
    assert time.monotonic() - began < 1

    turn = "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    macro = "{% macro turn(m) %}{{ m['content'] }}{% generation %}<|im_end|>{% endgeneration %}{% endmacro %}"
    buffered = macro + GENERATION.replace(turn, "{{ turn(m) }}")  # (the same text; the block's place unknown)
    (marked / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": buffered}))
    renders.clear()
    data = chat_data(tmp_path, marked, [RECORDS[0]])
    assert len(renders) > 2  # the prefixes
    assert masked_runs(marked, data.train) == [m["content"] + END for m in conversation if m["role"] == "assistant"]
