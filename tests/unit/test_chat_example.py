"""The shipped post-training example (issue 45, item 4): engine/data/chat_example.py writes the
same bytes for the same seed, its conversations load through data.name=chat with the loss on the
rule's answers, its preference pairs reject a wrong answer, its held-out lists need the rule,
and configs/chat_sft.yaml trains on it (then `sample --chat` renders with its template)."""

import json

import numpy as np
import pytest
from support import chat_example as chat_example_helpers
from support.configs import ROOT

from engine.config.data_sections import data_config
from engine.data import chat_example
from engine.data.sources import load_dataset

example = chat_example_helpers.example  # the fixture


def read(directory, name) -> list[dict]:
    return [json.loads(line) for line in (directory / name).read_text().splitlines()]


def contents(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.mark.nocompile
def test_the_same_seed_writes_the_same_bytes(tmp_path, example):
    chat_example.write(tmp_path / "again", seed=0, train=60, held_out=12)
    chat_example.write(tmp_path / "other", seed=1, train=60, held_out=12)
    assert contents(tmp_path / "again") == contents(example)
    assert set(contents(example)) == {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        *chat_example.FILES,
    }
    other = contents(tmp_path / "other")
    assert other["chat_train.jsonl"] != contents(example)["chat_train.jsonl"]


@pytest.mark.nocompile
def test_the_conversations_load_as_chat_data_trained_on_the_answers_alone(example):
    conversations = read(example, "chat_train.jsonl")
    cfg = data_config(
        name="chat",
        path=str(example / "chat_train.jsonl"),
        eval_path=str(example / "chat_eval.jsonl"),
        tokenizer=str(example),
        seq_len=64,
    )
    data = load_dataset(cfg)
    assert f"data: chat train: {len(conversations)} conversations (0 truncated" in data.info.notes[0]
    assert "0 with no token to train on left out" in data.info.notes[0]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(example / "tokenizer.json"))
    assert tokenizer.token_to_id(chat_example.UNKNOWN) not in data.train["tokens"]  # every word is the vocabulary's
    trained = []  # the runs of trained tokens, decoded: each answer and its end-of-turn token
    for tokens, mask in zip(data.train["tokens"].tolist(), data.train["loss_mask"]):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        trained += [tokenizer.decode(tokens[a:b], skip_special_tokens=False) for a, b in zip(edges[::2], edges[1::2])]
    assert trained == [f"{c['messages'][1]['content']} {chat_example.END}" for c in conversations]


@pytest.mark.nocompile
def test_the_answers_follow_the_rule_and_rejected_answers_are_wrong(example):
    def task(question: str) -> tuple[str, list[str]]:
        operation, items = question.split(": ")
        return operation, items.split()

    def rule(operation: str, items: list[str]) -> list[str]:
        return {"reverse": items[::-1], "sort": sorted(items)}[operation]

    for name in ("chat_train.jsonl", "chat_eval.jsonl"):
        for record in read(example, name):
            user, assistant = record["messages"]
            assert (user["role"], assistant["role"]) == ("user", "assistant")
            operation, items = task(user["content"])
            assert assistant["content"].split() == rule(operation, items)
    kinds = set()
    for name in ("preferences_train.jsonl", "preferences_eval.jsonl"):
        for pair in read(example, name):
            operation, items = task(pair["prompt"])
            chosen, rejected = pair["chosen"].split(), pair["rejected"].split()
            assert chosen == rule(operation, items)
            assert rejected != chosen and sorted(rejected) == sorted(chosen)
            swapped = [k for k in range(len(chosen)) if chosen[k] != rejected[k]]
            neighbours = len(swapped) == 2 and swapped[1] == swapped[0] + 1
            assert rejected == items or neighbours, pair
            kinds.add("unchanged" if rejected == items else "swapped")
    assert kinds == {"unchanged", "swapped"}


@pytest.mark.nocompile
def test_no_held_out_list_is_seen_in_training(example):
    def prompts(name):
        return [r["messages"][0]["content"] if "messages" in r else r["prompt"] for r in read(example, name)]

    train = set(prompts("chat_train.jsonl")) | set(prompts("preferences_train.jsonl"))
    held = prompts("chat_eval.jsonl") + prompts("preferences_eval.jsonl")
    assert len(held) == 24 and not train & set(held)
    assert {p.split(":")[0] for p in held} == set(chat_example.OPERATIONS)


@pytest.mark.nocompile
def test_the_shipped_post_training_configs_save_a_tenth_of_the_run_at_a_time():
    """A kill loses at most a tenth of the example's SFT or DPO run (issue 53.6)."""
    import yaml

    for name in ("chat_sft.yaml", "dpo.yaml"):  # (as written: dpo.yaml's finetune.base is made by chat_sft.yaml)
        cfg = yaml.safe_load((ROOT / "configs" / name).read_text())
        every, steps = cfg["checkpoint"]["every_steps"], cfg["train"]["steps"]
        assert 0 < every <= steps / 10, (name, every, steps)
