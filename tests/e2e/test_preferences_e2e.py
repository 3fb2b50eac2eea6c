"""data.name=preferences (issue 45, item 2): preference pairs rendered with the model's chat
template as data.name=chat renders a prompt/completion record, one pair an example of
[2, seq_len + 1] rows that share the prompt and mask exactly the responses; overflow and bad data."""

import json
import re

from support import preferences as preferences_helpers
from support.chat_data import LLAMA, write_jsonl
from support.configs import QUIET, ROOT
from support.fuzz_cli import refused_in_one_line, run_in_one_process
from support.preferences import RECORDS

model_dir = preferences_helpers.model_dir  # the fixture


BAD = [  # (the fourth line of train.jsonl, more keys, what the one line says: a regex)
    ('{"prompt": "a", "chosen": "", "rejected": "b"}', [], 'train.jsonl:4: "chosen" is empty'),
    (json.dumps({"prompt": "hi", "chosen": "hello " * 80, "rejected": "x"}), ["data.overflow=error"], ':4: "chosen"'),
]


def test_bad_data_exits_2_with_one_line(tmp_path, model_dir):
    """Each refused in one line before anything is written, through the CLI's main in one process
    (the messages' own cases: tests/unit/test_preferences.py)."""
    cases = []
    for i, (line, keys, _) in enumerate(BAD):
        path = write_jsonl(tmp_path / f"train{i}.jsonl", [*RECORDS, line])
        argv = [
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
            str(tmp_path / f"w{i}"),
        ]
        cases.append({"argv": argv})
    results = run_in_one_process(tmp_path, cases)
    assert len(results) == len(BAD) == 2
    for i, (result, (_, _, message)) in enumerate(zip(results, BAD)):
        refused_in_one_line(result)
        assert re.search(message, result["stderr"].replace(f"train{i}.jsonl", "train.jsonl")), result["stderr"]
        assert not (tmp_path / f"w{i}").exists()
