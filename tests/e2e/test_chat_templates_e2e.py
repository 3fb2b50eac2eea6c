"""A model's chat template is code that came with a download: rendering it is bounded in
loop iterations, output, integer and string sizes, time and memory (engine/lm/chat.py), every
fault of a template or of the files it is read from is one UsageError naming the file, and
`import-hf` refuses a hostile template before it writes anything (issue 42)."""

from support.chat_templates import QUICK, _hf_dir, _workdir
from support.cli import run_cli


def test_sample_chat_with_a_hostile_template_exits_2_with_one_line(tmp_path):
    work = _workdir(tmp_path, {"chat_template": "{{ (messages|length + 9) ** 100000000 }}"})
    proc = run_cli("sample", "--workdir", str(work), "--prompt", "hi", "--chat", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{work / 'tokenizer_config.json'} (chat_template): the chat template computes a power" in proc.stderr


def test_import_hf_with_a_hostile_template_exits_2_and_writes_nothing(tmp_path):
    hf = _hf_dir(tmp_path / "hf", jinja="{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")
    proc = run_cli("import-hf", str(hf), "--workdir", str(tmp_path / "work"), *QUICK, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "chat_template.jinja: the chat template recurses without end" in proc.stderr
    assert not (tmp_path / "work").exists()
