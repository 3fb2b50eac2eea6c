"""data.name=prompts (engine/data/prompts.py, issue 55): prompts rendered with the model's chat
template and its generation prompt (or as plain text in TRL's standard format), tokenized,
left-padded with a mask, their other fields kept by record index for the reward functions; a bad
line or a prompt longer than grpo.max_prompt_tokens refused naming the file, the line and the field.
Compiles nothing."""

import json

import numpy as np
import pytest

from engine.config import load_config
from engine.config.data_sections import data_config
from engine.data.pipeline import TrainBatches
from engine.data.prompts import fit_prompts
from engine.data.sources import load_dataset
from engine.errors import UsageError

SPECIAL = ["<s>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RECORDS = [
    {"prompt": "sort: 3 1 2", "answer": "1 2 3"},
    {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort: 2 1"}], "answer": "1 2"},
    {"prompt": "hello", "answer": "hi", "level": 2},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory as import-hf leaves it: a byte-level BPE tokenizer.json and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("model")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["sort: 3 1 2 hello be brief user assistant system"] * 20, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def prompts_data(tmp_path, model_dir, records, held=None, **keys):
    train = write_jsonl(tmp_path / "train.jsonl", records)
    held = write_jsonl(tmp_path / "held.jsonl", held or records[:1])
    cfg = data_config(name="prompts", path=str(train), eval_path=str(held), tokenizer=str(model_dir), **keys)
    return load_dataset(cfg)


def decoded(model_dir, row_tokens, row_mask) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(row_tokens[row_mask].tolist(), False)


def test_prompts_are_rendered_with_the_generation_prompt_and_left_padded(tmp_path, model_dir):
    dataset = prompts_data(tmp_path, model_dir, RECORDS)
    train = dataset.train
    assert train["prompt_tokens"].dtype == np.int32 and train["prompt_mask"].dtype == bool
    assert train["record_index"].tolist() == [0, 1, 2]
    width = train["prompt_tokens"].shape[1]
    for row in range(3):  # the padding on the left, the prompt's tokens ending each row
        mask = train["prompt_mask"][row]
        assert mask[-1] and not mask[: width - mask.sum()].any()
        assert (train["prompt_tokens"][row][~mask] == 0).all()
    texts = [decoded(model_dir, train["prompt_tokens"][r], train["prompt_mask"][r]) for r in range(3)]
    assert texts[0] == "<s><|im_start|>user\nsort: 3 1 2<|im_end|>\n<|im_start|>assistant\n"
    assert texts[1].startswith("<s><|im_start|>system\nbe brief<|im_end|>") and texts[1].endswith("assistant\n")
    records = dataset.records[0]
    assert [r.fields for r in records] == [{"answer": "1 2 3"}, {"answer": "1 2"}, {"answer": "hi", "level": 2}]
    assert [r.conversational for r in records] == [False, True, False]
    assert records[1].prompt == RECORDS[1]["prompt"] and records[2].where.endswith("train.jsonl:3")


def test_the_standard_format_keeps_strings_as_plain_text(tmp_path, model_dir):
    dataset = prompts_data(tmp_path, model_dir, [RECORDS[0], RECORDS[2]], format="standard")
    train = dataset.train
    assert decoded(model_dir, train["prompt_tokens"][0], train["prompt_mask"][0]) == "sort: 3 1 2"
    assert any("standard format" in note for note in dataset.info.notes)
    with pytest.raises(UsageError, match=r"train.jsonl:2: \"prompt\" is a JSON list, not a string"):
        prompts_data(tmp_path, model_dir, RECORDS[:2], format="standard")


def test_fit_pads_to_max_prompt_tokens_and_refuses_a_longer_prompt(tmp_path, model_dir):
    dataset = prompts_data(tmp_path, model_dir, RECORDS)
    lengths = dataset.train["prompt_mask"].sum(axis=1)
    fitted = fit_prompts(dataset, int(lengths.max()) + 3, 5)
    assert fitted.train["prompt_tokens"].shape == (3, int(lengths.max()) + 3)
    assert (fitted.train["prompt_mask"].sum(axis=1) == lengths).all() and fitted.info.seq_len == lengths.max() + 8
    np.testing.assert_array_equal(fitted.train["prompt_tokens"][:, 3:], dataset.train["prompt_tokens"])
    longest = int(np.argmax(lengths))
    with pytest.raises(UsageError) as caught:
        fit_prompts(dataset, int(lengths.max()) - 1, 5)
    message = str(caught.value)
    assert f"train.jsonl:{longest + 1}: the prompt is {lengths.max()} tokens" in message
    assert f"set grpo.max_prompt_tokens={lengths.max()}" in message


def test_batches_carry_the_record_index(tmp_path, model_dir):
    dataset = prompts_data(tmp_path, model_dir, RECORDS * 2)
    batches = TrainBatches(dataset.train, 2, seed=0)
    batch = batches(1)
    rows = batch["record_index"]
    np.testing.assert_array_equal(batch["prompt_tokens"], dataset.train["prompt_tokens"][rows])


@pytest.mark.parametrize(
    "line, named",
    [
        ("not json", "train.jsonl:2: "),
        ('["a"]', "train.jsonl:2: a JSON list, not an object"),
        ('{"answer": "x"}', 'train.jsonl:2: no "prompt" field'),
        ('{"prompt": 3}', 'train.jsonl:2: "prompt" is a JSON int'),
        ('{"prompt": "  "}', 'train.jsonl:2: "prompt" is empty'),
        ('{"prompt": [{"role": "user"}]}', "train.jsonl:2: "),
        ('{"prompt": "a", "completions": "b"}', 'train.jsonl:2: a field named "completions"'),
    ],
)
def test_a_bad_line_is_named(tmp_path, model_dir, line, named):
    with pytest.raises(UsageError, match=None) as caught:
        prompts_data(tmp_path, model_dir, [RECORDS[0], line])
    assert named in str(caught.value)


def test_config_takes_the_prompts_section(tmp_path):
    keys = ["data.name=prompts", "data.path=p.jsonl", "train.objective=grpo"]
    cfg = load_config("configs/chat_sft.yaml", [*keys, "grpo.rewards=[engine.lm.rewards:exact_match]"])
    assert cfg.data.name == "prompts" and cfg.grpo.rewards == ["engine.lm.rewards:exact_match"]
    with pytest.raises(UsageError) as caught:
        load_config("configs/chat_sft.yaml", ["data.name=prompts", "data.path=p.jsonl"])
    assert "data.name=prompts" in str(caught.value) and "set train.objective=grpo" in str(caught.value)


def test_the_post_training_examples_prompts_are_its_conversations(tmp_path):
    """engine/data/chat_example.py's prompts files (configs/chat_grpo.yaml's data) hold each
    conversation's question and answer, and load as data.name=prompts with the example's template."""
    from engine.data import chat_example

    chat_example.write(tmp_path, seed=0, train=20, held_out=4)
    for prompts_file, chats_file in chat_example.PROMPTS.items():
        records = [json.loads(line) for line in (tmp_path / prompts_file).read_text().splitlines()]
        chats = [json.loads(line)["messages"] for line in (tmp_path / chats_file).read_text().splitlines()]
        assert records == [{"prompt": user["content"], "answer": reply["content"]} for user, reply in chats]
    cfg = data_config(
        name="prompts",
        path=str(tmp_path / "prompts_train.jsonl"),
        eval_path=str(tmp_path / "prompts_eval.jsonl"),
        tokenizer=str(tmp_path),
    )
    dataset = load_dataset(cfg)
    from tokenizers import Tokenizer

    text = f"<|im_start|>user\n{records[0]['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    ids = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert dataset.eval["prompt_tokens"][0][dataset.eval["prompt_mask"][0]].tolist() == ids
    assert dataset.records[1][0].fields == {"answer": records[0]["answer"]}
