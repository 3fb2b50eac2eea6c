"""data.name=preferences (issue 45, item 2): preference pairs rendered with the model's chat
template as data.name=chat renders a prompt/completion record, one pair an example of
[2, seq_len + 1] rows that share the prompt and mask exactly the responses; overflow and bad data."""

import json
import re

import pytest
from support import preferences as preferences_helpers
from support.chat_data import LLAMA, write_jsonl
from support.cli import run_cli
from support.configs import QUIET, ROOT
from support.preferences import RECORDS

model_dir = preferences_helpers.model_dir  # the fixture


@pytest.mark.parametrize(
    "line, keys, message",
    [
        ('{"prompt": "a", "chosen": "", "rejected": "b"}', [], 'train.jsonl:4: "chosen" is empty'),
        (
            json.dumps({"prompt": "hi", "chosen": "hello " * 80, "rejected": "x"}),
            ["data.overflow=error"],
            ':4: "chosen"',
        ),
    ],
)
def test_bad_data_exits_2_with_one_line(tmp_path, model_dir, line, keys, message):
    path = write_jsonl(tmp_path / "train.jsonl", [*RECORDS, line])
    proc = run_cli(
        "--config",
        str(ROOT / "configs" / "mnist_mlp.yaml"),
        "model.name=llama",
        *(f"model.{key}={value}" for key, value in LLAMA.items()),
        "train.objective=dpo",
        "data.name=preferences",
        f"data.path={path}",
        f"data.tokenizer={model_dir}",
        "data.eval_fraction=0.25",
        "data.seq_len=64",
        *QUIET,
        *keys,
        "--workdir",
        str(tmp_path / "w"),
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert not (tmp_path / "w").exists()
