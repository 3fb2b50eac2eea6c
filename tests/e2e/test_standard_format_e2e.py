"""TRL's standard format (issue 53, item 4): prompt/completion and preference records whose fields
are strings are plain text, concatenated with no chat template, the completion ended by the
tokenizer's end-of-text token and the tokenizer's BOS added as a base model expects; the loss
covers the completion only. A model without a chat template trains on them; message lists need
a template (the conversational format)."""

import json

import numpy as np
from support import standard_format as standard_format_helpers
from support.chat_data import LLAMA, write_jsonl
from support.cli import run_cli
from support.configs import QUIET, ROOT
from support.standard_format import RECORDS

base_dir = standard_format_helpers.base_dir  # the fixture


def test_a_base_model_without_a_template_fine_tunes_on_string_records(tmp_path, base_dir):
    """Before: "has no chat template", exit 2. Three steps of a tiny Llama on prompt/completion strings."""
    path = write_jsonl(tmp_path / "train.jsonl", RECORDS * 4)
    proc = run_cli(
        "--config",
        str(ROOT / "configs" / "mnist_mlp.yaml"),
        "model.name=llama",
        *(f"model.{key}={value}" for key, value in LLAMA.items()),
        "data.name=chat",
        f"data.path={path}",
        f"data.tokenizer={base_dir}",
        "data.eval_fraction=0.25",
        "data.seq_len=16",
        "train.global_batch_size=4",
        "train.steps=3",
        *QUIET,
        "--workdir",
        str(tmp_path / "work"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "TRL's standard format" in proc.stdout and "data: chat train: 9 conversations" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["split"] for r in records if "loss" in r] == ["train", "eval"] and all(np.isfinite(losses))
