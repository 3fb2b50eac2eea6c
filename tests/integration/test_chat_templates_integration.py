"""A model's chat template is code that came with a download: rendering it is bounded in
loop iterations, output, integer and string sizes, time and memory (engine/lm/chat.py), every
fault of a template or of the files it is read from is one UsageError naming the file, and
`import-hf` refuses a hostile template before it writes anything (issue 42)."""

import json

import pytest
from support.chat_templates import GOOD, NESTED, QUICK, _hf_dir

from engine.errors import UsageError
from engine.lm.chat import chat_prompts, check_imported_template


def test_import_refuses_a_hostile_template_and_leaves_the_workdir_as_found(tmp_path):
    from engine.hub.hf import import_hf

    hf = _hf_dir(tmp_path / "hf", {"chat_template": NESTED})
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"tokenizer_config.json \(chat_template\): the chat template runs more"):
        import_hf(str(hf), str(work))
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]  # no tokenizer files, no .lock
    (hf / "tokenizer_config.json").write_text("[]")
    with pytest.raises(UsageError, match="holds a JSON array"):
        import_hf(str(hf), str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('user first') }}"}))
    check_imported_template(hf)  # the template's own refusal of the sample conversation is its affair


def test_a_failed_import_leaves_nothing_and_a_finished_one_keeps_the_jinja_template(tmp_path, monkeypatch):
    from engine.hub import hf as hf_module

    hf = _hf_dir(tmp_path / "hf", {"chat_template": "unused"}, jinja=GOOD)
    work = tmp_path / "work"
    work.mkdir()

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(hf_module, "_save_step_zero", full_disk)
        with pytest.raises(OSError, match="No space left"):
            hf_module.import_hf(str(hf), str(work), overrides=QUICK)
    assert list(work.iterdir()) == []
    hf_module.import_hf(str(hf), str(work), overrides=QUICK)
    assert (work / "chat_template.jinja").read_text() == GOOD and (work / "checkpoints").is_dir()
    assert chat_prompts(work, ["hi"]) == ["u:hi</s>a:"]
