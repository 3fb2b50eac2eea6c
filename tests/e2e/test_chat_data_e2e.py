"""data.name=chat (issue 45, item 1): conversations rendered with the model's chat template as
transformers renders them, tokenized with its tokenizer, packed, and a loss mask that covers
exactly the rendered spans data.loss_on names; overflow and bad data."""

import json
import re

import numpy as np
from support import chat_data as chat_data_helpers
from support.chat_data import LLAMA, RECORDS, write_jsonl
from support.cli import run_cli
from support.configs import QUIET, ROOT
from support.fuzz_cli import refused_in_one_line, run_in_one_process

model_dir = chat_data_helpers.model_dir  # the fixture


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


BAD = [  # (the fourth line of train.jsonl, more keys, what the one line says: a regex)
    ('{"messages": [{"role": "tool", "content": "x"}]}', [], "train.jsonl:4: .*unknown role: tool"),
    (json.dumps({"prompt": "hello " * 80, "completion": "hi"}), ["data.overflow=error"], "train.jsonl:4: the con"),
    (
        json.dumps(RECORDS[1]),
        ["data.tokenizer=nowhere/tokenizer.json"],
        "data.tokenizer=nowhere/tokenizer.json is neither a file nor a dir",
    ),
]


def test_bad_data_exits_2_with_one_line(tmp_path, model_dir):
    """Each refused in one line before anything is written, through the CLI's main in one process
    (the messages' own cases: tests/unit/test_chat_data.py)."""
    cases = []
    for i, (line, keys, _) in enumerate(BAD):
        (tmp_path / str(i)).mkdir()
        args = _cli_data(tmp_path / str(i), model_dir, [*RECORDS[:3], line], f"data.tokenizer={model_dir}", *keys)
        cases.append({"argv": [*args, "--workdir", str(tmp_path / str(i) / "w")]})
    results = run_in_one_process(tmp_path, cases)
    assert len(results) == len(BAD) == 3
    for i, (result, (_, _, message)) in enumerate(zip(results, BAD)):
        refused_in_one_line(result)
        assert re.search(message, result["stderr"]), result["stderr"]
        assert not (tmp_path / str(i) / "w").exists()
