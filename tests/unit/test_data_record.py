"""A resumed chat or preferences run proves its data is what it trained on (issue 57, item 2):
the checkpoint's meta keeps the sha256 of the arrays as rendered and tokenized and of their files,
a resume compares them (exit 2 naming the file or the template), and a chat template's
strftime_now() renders the run's recorded start, whatever the clock says at the resume."""

import json
import time

import numpy as np
import pytest
from support.chat_data import write_jsonl, write_model_dir
from support.data_record import CONVERSATIONS, dated_model_dir

from engine.config.data_sections import data_config
from engine.errors import UsageError
from engine.run.data_record import TEMPLATE_TIME, check, load_rendered, record


class Cfg:
    """What load_rendered and record read of a run's config: its workdir."""

    def __init__(self, workdir):
        self.workdir = str(workdir)


def loaded(tmp_path, model, records, name="chat", **keys):
    path = write_jsonl(tmp_path / "train.jsonl", records)
    data = data_config(name=name, path=str(path), tokenizer=str(model), **keys)
    dataset = load_rendered(Cfg(tmp_path), data)
    return data, dataset, record(data, dataset)


@pytest.mark.nocompile
def test_a_resume_refuses_data_that_is_not_what_it_trained_on_naming_the_file(tmp_path):
    (tmp_path / "model").mkdir()
    model = write_model_dir(tmp_path / "model")
    keys = dict(eval_fraction=0.25, seq_len=64)
    _, _, trained = loaded(tmp_path, model, CONVERSATIONS, **keys)
    check({**trained, "step": 2}, loaded(tmp_path, model, CONVERSATIONS, **keys)[2], 2)  # the same data: nothing
    edited = [*CONVERSATIONS[:-1], {"prompt": "hello there", "completion": "hi!"}]
    reordered = CONVERSATIONS[1:] + CONVERSATIONS[:1]
    for records in (edited, reordered):
        with pytest.raises(UsageError, match=rf"data.path={tmp_path / 'train.jsonl'} is not the one it trained on"):
            check(trained, loaded(tmp_path, model, records, **keys)[2], 2)
    config = model / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<|im_start|>", "<|im_start|> "))
    with pytest.raises(UsageError, match=rf"the chat template \({config}\) is not the one it trained on"):
        check(trained, loaded(tmp_path, model, CONVERSATIONS, **keys)[2], 2)
    pairs = [{"prompt": f"hello {i}", "chosen": "hi", "rejected": "the mat"} for i in range(6)]
    held = write_jsonl(tmp_path / "held.jsonl", pairs[:2])
    _, _, trained = loaded(tmp_path, model, pairs, name="preferences", eval_path=str(held), seq_len=64)
    write_jsonl(held, pairs[1:3])
    with pytest.raises(UsageError, match=rf"the eval data as .* data.eval_path={held} is not the one it trained on"):
        check(trained, loaded(tmp_path, model, pairs, name="preferences", eval_path=str(held), seq_len=64)[2], 2)


@pytest.mark.nocompile
def test_a_template_renders_the_runs_recorded_date_and_a_resume_says_when_it_reads_the_clock(tmp_path):
    (tmp_path / "model").mkdir()
    model = dated_model_dir(tmp_path / "model")
    (tmp_path / TEMPLATE_TIME).write_text(json.dumps({"time": "2020-03-04T05:06:07"}))
    _, dataset, recorded = loaded(tmp_path, model, CONVERSATIONS, eval_fraction=0.25, seq_len=64)
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(model / "tokenizer.json")).decode(dataset.train["tokens"][0].tolist())
    assert "Today Date: 04 Mar 2020" in text and dataset.info.template_time == "2020-03-04T05:06:07"
    (tmp_path / TEMPLATE_TIME).unlink()  # (a resume without the record: today's date)
    before = time.strftime("%Y-%m-%dT%H:%M:%S")
    _, dataset, now = loaded(tmp_path, model, CONVERSATIONS, eval_fraction=0.25, seq_len=64)
    assert before <= dataset.info.template_time <= time.strftime("%Y-%m-%dT%H:%M:%S")
    with pytest.raises(UsageError, match=r"reads the date or time \(strftime_now\): it rendered 2020-03-04T05:06:07"):
        check(recorded, now, 2)


@pytest.mark.nocompile
def test_every_process_of_a_job_renders_process_0_s_time(tmp_path, monkeypatch):
    """A fresh multi-process start has no template_time.json yet: each process read its own clock, so
    two processes either side of midnight (or of a minute, for a template that writes one) trained on
    other tokens. Every process now renders process 0's time (broadcast from it)."""
    import jax
    from jax.experimental import multihost_utils

    (tmp_path / "model").mkdir()
    model = dated_model_dir(tmp_path / "model")
    process_0 = np.frombuffer(b"2031-12-31T23:59:59".ljust(32), np.uint8)
    broadcast = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: broadcast.append(x) or process_0)
    _, dataset, _ = loaded(tmp_path, model, CONVERSATIONS, eval_fraction=0.25, seq_len=64)
    assert dataset.info.template_time == "2031-12-31T23:59:59" and len(broadcast) == 1
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(model / "tokenizer.json")).decode(dataset.train["tokens"][0].tolist())
    assert "Today Date: 31 Dec 2031" in text
