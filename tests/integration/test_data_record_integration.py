"""A resumed chat or preferences run proves its data is what it trained on (issue 57, item 2):
the checkpoint's meta keeps the sha256 of the arrays as rendered and tokenized and of their files,
a resume compares them (exit 2 naming the file or the template), and a chat template's
strftime_now() renders the run's recorded start, whatever the clock says at the resume."""

import pytest
from support.chat_data import LLAMA, write_jsonl
from support.data_record import CONVERSATIONS, dated_model_dir

from engine.errors import UsageError
from engine.run.data_record import TEMPLATE_TIME


def test_a_vectorised_groups_resume_checks_its_data_and_records_the_template_time(make_config, tmp_path):
    """A sweep's group (vectorize) resumes through its own path: its trials' checkpoints keep the
    data's record and the template's time as a single run's do, and an edited data.path is refused."""
    from engine.run.group import fit_group

    (tmp_path / "model").mkdir()
    model = dated_model_dir(tmp_path / "model")
    path = write_jsonl(tmp_path / "train.jsonl", CONVERSATIONS)
    keys = [
        "model.name=llama", *(f"model.{key}={value}" for key, value in LLAMA.items()), "data.name=chat",
        f"data.path={path}", "data.eval_fraction=0.25", "data.seq_len=64", f"data.tokenizer={model}",
        "train.global_batch_size=4", "eval.every_steps=2", "checkpoint.every_steps=2",
    ]  # fmt: skip
    cfgs = lambda steps: [  # noqa: E731
        make_config("mnist_mlp.yaml", *keys, f"train.steps={steps}", f"seed={i}", workdir=tmp_path / f"t{i}")
        for i in range(2)
    ]
    fit_group(cfgs(2))
    for i in range(2):
        assert (tmp_path / f"t{i}" / TEMPLATE_TIME).is_file()  # (a resume on another day renders this time)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[1:] + lines[:1]))
    with pytest.raises(UsageError, match=rf"data.path={path} is not the one it trained on"):
        fit_group(cfgs(4))
