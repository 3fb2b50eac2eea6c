"""A resumed chat or preferences run proves its data is what it trained on (issue 57, item 2):
the checkpoint's meta keeps the sha256 of the arrays as rendered and tokenized and of their files,
a resume compares them (exit 2 naming the file or the template), and a chat template's
strftime_now() renders the run's recorded start, whatever the clock says at the resume."""

import json

import numpy as np
from support.chat_data import LLAMA, write_jsonl
from support.cli import run_cli
from support.configs import QUIET, ROOT
from support.data_record import CONVERSATIONS, dated_model_dir


def cli_args(tmp_path, model, workdir, *extra):
    path = tmp_path / "train.jsonl"
    if not path.exists():
        write_jsonl(path, CONVERSATIONS)
    return [
        "--config", str(ROOT / "configs" / "mnist_mlp.yaml"), "model.name=llama",
        *(f"model.{key}={value}" for key, value in LLAMA.items()), "data.name=chat", f"data.path={path}",
        "data.eval_fraction=0.25", "data.seq_len=64", f"data.tokenizer={model}", "train.global_batch_size=4",
        "log.every_steps=1", "eval.every_steps=2", "checkpoint.every_steps=2", *QUIET, "--workdir", str(workdir),
        *extra,
    ]  # fmt: skip


def losses(workdir):
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(r["split"], r["step"], r["loss"]) for r in records if "loss" in r]


def test_a_run_resumed_on_another_day_trains_as_the_unbroken_run_and_edited_data_is_refused(tmp_path):
    """The template writes the date; the resume's clock is 26 hours on (another time zone's day):
    the resumed run's losses are the unbroken run's; then data.path's lines reordered: exit 2."""
    (tmp_path / "model").mkdir()
    model = dated_model_dir(tmp_path / "model")
    east, west = {"TZ": "AAA-14"}, {"TZ": "BBB+12"}  # UTC+14 and UTC-12: never the same date
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    proc = run_cli(*cli_args(tmp_path, model, unbroken, "train.steps=4"), env=east)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(*cli_args(tmp_path, model, broken, "train.steps=2"), env=east)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(*cli_args(tmp_path, model, broken, "train.steps=4"), env=west)  # resumed at 2, the next day
    assert proc.returncode == 0, proc.stderr
    assert losses(broken) == losses(unbroken) and len(losses(unbroken)) == 6
    path = tmp_path / "train.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[1:] + lines[:1]))
    proc = run_cli(*cli_args(tmp_path, model, broken, "train.steps=6"), env=east)  # resumed at 4
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"data.path={path} is not the one it trained on" in proc.stderr, proc.stderr
    assert np.isfinite([loss for *_, loss in losses(broken)]).all()
