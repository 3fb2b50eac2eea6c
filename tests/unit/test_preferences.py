"""data.name=preferences (issue 45, item 2): preference pairs rendered with the model's chat
template as data.name=chat renders a prompt/completion record, one pair an example of
[2, seq_len + 1] rows that share the prompt and mask exactly the responses; overflow and bad data."""

import json

import jax
import numpy as np
import pytest
from support import preferences as preferences_helpers
from support.chat_data import END, TEMPLATE, write_jsonl
from support.preferences import RECORDS, preference_data

from engine.config.data_sections import data_config
from engine.config.schema import Config
from engine.data.chat_data import with_model
from engine.data.pipeline import TrainBatches, eval_batches, process_rows
from engine.data.sources import load_dataset
from engine.errors import UsageError
from engine.lm.chat import Renderer, read_chat_template
from engine.parallel.mesh import make_mesh
from engine.parallel.sharding import batch_sharding

model_dir = preferences_helpers.model_dir  # the fixture


def texts(record: dict, side: str) -> tuple[list[dict], str]:
    """The record's prompt as messages, and the text its `side` trains on."""
    prompt = record["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    response = record[side]
    return messages, (response if isinstance(response, str) else response[0]["content"]) + END


def tokenizer_of(directory):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json"))


@pytest.mark.nocompile
def test_a_pairs_rows_share_the_prompt_and_the_loss_mask_covers_exactly_each_response(tmp_path, model_dir):
    data = preference_data(tmp_path, model_dir, RECORDS)
    tokenizer, window = tokenizer_of(model_dir), 65
    template = read_chat_template(model_dir)
    assert template is not None
    render = Renderer(template, "fix it")
    assert {name: array.shape for name, array in data.train.items()} == {
        name: (3, 2, window) for name in ("tokens", "segments", "positions", "loss_mask")
    }
    assert data.info.num_train == 3 and data.info.num_eval == 1 and data.info.seq_len == 64
    for record, tokens, segments, positions, mask in zip(
        RECORDS, data.train["tokens"], data.train["segments"], data.train["positions"], data.train["loss_mask"]
    ):
        prompt_messages, _ = texts(record, "chosen")
        prompt = tokenizer.encode(render(prompt_messages), add_special_tokens=False).ids
        for row, side in enumerate(("chosen", "rejected")):
            size = int(segments[row].sum())
            assert segments[row, :size].tolist() == [1] * size and not segments[row, size:].any()  # padding: 0
            assert positions[row, :size].tolist() == list(range(size))
            assert not tokens[row, size:].any() and not mask[row, size:].any()
            assert tokens[row, : len(prompt)].tolist() == prompt  # the rendered prompt, ready for the reply
            assert mask[row].tolist() == [0] * len(prompt) + [1] * (size - len(prompt)) + [0] * (window - size)
            trained = tokens[row][mask[row] == 1].tolist()
            assert tokenizer.decode(trained, skip_special_tokens=False) == texts(record, side)[1]
    assert data.info.notes[0].startswith("data: preferences train: 3 pairs (0 with a response cut")
    assert "0 dropped as longer or with no response token left), 3 kept" in data.info.notes[0]


@pytest.mark.nocompile
def test_pairs_render_as_transformers_renders_them(tmp_path, model_dir):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>", eos_token="<|im_end|>"
    )
    reference.chat_template = TEMPLATE
    data = preference_data(tmp_path, model_dir, RECORDS)
    for record, tokens, segments in zip(RECORDS, data.train["tokens"], data.train["segments"]):
        for row, side in enumerate(("chosen", "rejected")):
            prompt, response = texts(record, side)
            messages = [*prompt, {"role": "assistant", "content": response.removesuffix(END)}]
            text = reference.apply_chat_template(messages, tokenize=False)
            ids = reference(text, add_special_tokens=False)["input_ids"]
            assert tokens[row, : int(segments[row].sum())].tolist() == ids


@pytest.mark.nocompile
def test_pairs_are_held_out_batched_and_sharded_along_their_first_axis(tmp_path, model_dir):
    records = [{**RECORDS[0], "chosen": f"hi {'there ' * k}"} for k in range(12)]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    cfg = data_config(name="preferences", path=str(train), seq_len=32, eval_fraction=0.25)  # the model's tokenizer
    data = load_dataset(with_model(cfg, model_dir))
    assert (data.info.num_train, data.info.num_eval) == (9, 3)
    chosen = {tuple(row) for row in data.train["tokens"][:, 0].tolist() + data.eval["tokens"][:, 0].tolist()}
    assert len(chosen) == 12  # each pair in one split, whole
    mesh = make_mesh(Config().mesh)
    sharding = batch_sharding(mesh)
    batch = TrainBatches(data.train, 8, seed=0, rows=process_rows(sharding, 8))(0)
    assert batch["tokens"].shape == (8, 2, 33)
    for name in ("segments", "loss_mask"):  # the rows are whole pairs, as the data holds them
        index = [data.train["tokens"].tolist().index(pair) for pair in batch["tokens"].tolist()]
        assert np.array_equal(batch[name], data.train[name][index])
    placed = jax.device_put(batch["tokens"], sharding)
    assert {shard.data.shape for shard in placed.addressable_shards} == {(8 // len(mesh.devices.flat), 2, 33)}
    last = list(eval_batches(data.eval, 2))[-1]
    assert last["tokens"].shape == (2, 2, 33) and last["mask"].tolist() == [1.0, 0.0]


@pytest.mark.nocompile
def test_overflow_cuts_the_response_drops_or_refuses_and_is_counted(tmp_path, model_dir):
    long = {"prompt": "hello", "chosen": "cat " * 40, "rejected": "hi"}
    long_prompt = {"prompt": "hello " * 40, "chosen": "hi", "rejected": "the mat"}
    same_once_cut = {"prompt": "hello", "chosen": "cat " * 40 + "hi", "rejected": "cat " * 40 + "the mat"}
    records = [RECORDS[0], long, long_prompt, RECORDS[2], same_once_cut]
    data = preference_data(tmp_path, model_dir, records, seq_len=29, held=RECORDS[:1])
    assert "5 pairs (1 with a response cut to fit 30 tokens, 2 dropped as longer" in data.info.notes[0]
    assert data.info.num_train == 3
    cut = data.train["tokens"][1]
    assert (data.train["segments"][1, 0] == 1).all() and data.train["segments"][1, 1, -1] == 0  # only chosen cut
    text = tokenizer_of(model_dir).decode(cut[0][data.train["loss_mask"][1, 0] == 1].tolist())
    assert text.startswith("cat cat") and not text.endswith(END)  # the end of the response is cut off
    assert (
        tokenizer_of(model_dir)
        .decode(cut[0].tolist(), skip_special_tokens=False)
        .startswith("<s><|im_start|>user\nhello<|im_end|>")
    )

    data = preference_data(tmp_path, model_dir, records, seq_len=29, held=RECORDS[:1], overflow="drop")
    assert "5 pairs (0 with a response cut to fit 30 tokens, 3 dropped as longer" in data.info.notes[0]
    assert data.info.num_train == 2

    with pytest.raises(UsageError, match=r'train.jsonl:2: "chosen": the prompt and its response are \d+ tokens, more'):
        preference_data(tmp_path, model_dir, records, seq_len=29, overflow="error")
    with pytest.raises(UsageError, match=r"held.jsonl: none of its 1 preference pair\(s\) fits in data.seq_len"):
        preference_data(tmp_path, model_dir, [long_prompt, RECORDS[0]], seq_len=29, held=[long_prompt])


@pytest.mark.nocompile
def test_a_pair_with_no_response_token_to_score_is_left_out(tmp_path, model_dir):
    """A row's first token is no one's target: under a template that writes nothing before an
    empty prompt's response, a one-token response has none to score."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (bare / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    records = [{"prompt": "", "chosen": "a", "rejected": "b"}, RECORDS[0]]
    data = preference_data(tmp_path, bare, records, held=RECORDS[:1])
    assert "2 pairs (0 with a response cut to fit 65 tokens, 1 dropped as longer or" in data.info.notes[0]
    assert data.info.num_train == 1


BAD = [
    ('{"chosen": "a", "rejected": "b"}', r'train.jsonl:2: no "prompt" field'),
    ('{"prompt": "a", "rejected": "b"}', r'train.jsonl:2: no "chosen" field'),
    ('{"prompt": "a", "chosen": "b"}', r'train.jsonl:2: no "rejected" field'),
    ('{"prompt": 3, "chosen": "a", "rejected": "b"}', r'train.jsonl:2: "prompt" is a JSON int; give a string or'),
    ('{"prompt": "a", "chosen": {"x": 1}, "rejected": "b"}', r'train.jsonl:2: "chosen" is a JSON dict; give'),
    ('{"prompt": "a", "chosen": "", "rejected": "b"}', r'train.jsonl:2: "chosen" is empty'),
    ('{"prompt": "a", "chosen": "b", "rejected": []}', r'train.jsonl:2: "rejected" is empty'),
    ('{"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant"}]}', r'2: rejected\[0\] has no "content"'),
    (
        '{"prompt": "a", "chosen": "b", "rejected": [{"role": "tool", "content": "c"}]}',
        r"train.jsonl:2: rejected: .*refused the messages: unknown role: tool",
    ),
    (
        '{"prompt": [{"role": "tool", "content": "a"}], "chosen": "b", "rejected": "c"}',
        r"train.jsonl:2: prompt: .*refused the messages: unknown role: tool",
    ),
    (
        '{"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "b"}]}',
        r'train.jsonl:2: "chosen" and "rejected" are the same response, a pair that teaches nothing',
    ),
    ("[1, 2]", r"train.jsonl:2: a JSON list, not an object"),
    ("{not json", r"train.jsonl:2: not a JSON record .*prompt.*chosen.*rejected"),
]


@pytest.mark.nocompile
@pytest.mark.parametrize("line, match", BAD)
def test_bad_data_names_the_file_the_line_and_the_field(tmp_path, model_dir, line, match):
    with pytest.raises(UsageError, match=match):
        preference_data(tmp_path, model_dir, [RECORDS[0], line])


@pytest.mark.nocompile
def test_an_empty_file_is_refused(tmp_path, model_dir):
    with pytest.raises(UsageError, match=r"train.jsonl holds no preference pairs"):
        preference_data(tmp_path, model_dir, ["", " "], held=RECORDS[:1])


def word_model_dir(directory):
    """A model directory whose tokenizer splits on whitespace and knows a few words (others: <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "hello", "there", "hi", "the", "cat", "user", "assistant", "\n"]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "tokenizer, chosen, rejected",
    [
        ("words", "the  cat ", "the cat"),  # spaces the word tokenizer drops
        # a message key the template ignores
        ("bpe", [{"role": "assistant", "content": "on the mat", "name": "a"}], "on the mat"),
        ("words", "é", "ü"),  # both one unknown token
    ],
)
def test_a_pair_whose_sides_tokenize_the_same_is_refused_naming_its_line(
    tmp_path, model_dir, tokenizer, chosen, rejected
):
    directory = model_dir if tokenizer == "bpe" else word_model_dir(tmp_path)
    records = [RECORDS[0], {"prompt": "hello there", "chosen": chosen, "rejected": rejected}]
    same = r'train.jsonl:2: "chosen" and "rejected" render and tokenize to the same \d+ tokens'
    with pytest.raises(UsageError, match=same):
        preference_data(tmp_path, directory, records)
    assert preference_data(tmp_path, directory, records[:1]).info.num_train == 1  # (a pair that differs: kept)
