"""data.name=chat (issue 45, item 1): conversations rendered with the model's chat template as
transformers renders them, tokenized with its tokenizer, packed, and a loss mask that covers
exactly the rendered spans data.loss_on names; overflow and bad data."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import QUIET, ROOT, run_cli
from engine.config.data_sections import data_config
from engine.data.conversations import Conversation, loss_spans, read_conversations
from engine.data.sources import load_dataset
from engine.errors import UsageError
from engine.lm.chat import Renderer, read_chat_template
from engine.parallel.sharding import unbox
from engine.run.step import make_loss_fn
from models import REGISTRY
from models.family import NextToken
from models.llama import LlamaConfig

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


def test_the_sft_loss_is_the_masked_mean_over_the_assistant_tokens(tmp_path, model_dir):
    data = chat_data(tmp_path, model_dir, RECORDS, seq_len=48)
    batch = {name: jnp.asarray(array) for name, array in data.train.items()}
    module = REGISTRY["llama"].build(LlamaConfig(**LLAMA), data.info, jnp.float32, jnp.float32)
    inputs, targets = batch["tokens"][:, :-1].astype(jnp.int32), batch["tokens"][:, 1:].astype(jnp.int32)
    params = unbox(module.init(jax.random.key(0), inputs, train=False))["params"]
    documents = {"positions": batch["positions"][:, :-1], "segment_ids": batch["segments"][:, :-1]}
    logits = module.apply({"params": params}, inputs, train=False, **documents)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    trained = batch["loss_mask"][:, 1:]  # the assistant's tokens, as targets
    by_hand = float(jnp.sum(nll * trained) / jnp.sum(trained))

    def loss(task):
        return float(make_loss_fn(module, task)(params, {}, batch, None, False)[0])

    unchanged = loss(NextToken())
    assert unchanged == pytest.approx(by_hand, rel=1e-5)
    segments = np.asarray(batch["segments"])
    prompt = np.argwhere((np.asarray(trained) == 0) & (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0))
    answer = np.argwhere(np.asarray(trained) == 1)
    for (row, column), same in ((prompt[len(prompt) // 2], True), (answer[len(answer) // 2], False)):

        class Changed(NextToken):  # one target other than the data's: nothing else changes
            def model_inputs(self, batch):
                inputs, targets, extra = super().model_inputs(batch)
                targets = targets.at[row, column].set((targets[row, column] + 1) % data.info.vocab_size)
                return inputs, targets, {**extra, "targets": targets}

        assert (loss(Changed()) == unchanged) == same


def _cli_data(tmp_path, model_dir, records, *keys):
    path = write_jsonl(tmp_path / "train.jsonl", records)
    return [
        "--config",
        str(ROOT / "configs" / "mnist_mlp.yaml"),
        "model.name=llama",
        *(f"model.{key}={value}" for key, value in LLAMA.items()),
        "data.name=chat",
        f"data.path={path}",
        "data.eval_fraction=0.25",
        "data.seq_len=64",
        "train.global_batch_size=4",
        *QUIET,
        *keys,
    ]


def test_sft_runs_end_to_end_with_the_workdirs_template(tmp_path, model_dir):
    """A workdir holding a model's tokenizer and template (as import-hf leaves it) fine-tunes on
    conversations without naming them (data.tokenizer="" is the model's)."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (work / name).write_bytes((model_dir / name).read_bytes())
    records = [RECORDS[0], RECORDS[1], RECORDS[2]] * 4
    proc = run_cli(*_cli_data(tmp_path, model_dir, records, "train.steps=3"), "--workdir", str(work))
    assert proc.returncode == 0, proc.stderr
    assert "data: chat train: 9 conversations" in proc.stdout
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["split"] for r in records if "loss" in r] == ["train", "eval"]
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
    assert (work / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize(
    "line, keys, message",
    [
        ('{"messages": [{"role": "tool", "content": "x"}]}', [], "train.jsonl:4: .*unknown role: tool"),
        (json.dumps({"prompt": "hello " * 80, "completion": "hi"}), ["data.overflow=error"], "train.jsonl:4: the con"),
        (
            json.dumps(RECORDS[1]),
            ["data.tokenizer=nowhere/tokenizer.json"],
            "data.tokenizer=nowhere/tokenizer.json is neither a file nor a dir",
        ),
    ],
)
def test_bad_data_exits_2_with_one_line(tmp_path, model_dir, line, keys, message):
    records = [*RECORDS[:3], line]
    proc = run_cli(
        *_cli_data(tmp_path, model_dir, records, f"data.tokenizer={model_dir}", *keys), "--workdir", str(tmp_path / "w")
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    import re

    assert re.search(message, proc.stderr), proc.stderr
    assert not (tmp_path / "w").exists()
