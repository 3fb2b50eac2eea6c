"""A model's chat template is code that came with a download: rendering it is bounded in
loop iterations, output, integer and string sizes, time and memory (engine/lm/chat.py), every
fault of a template or of the files it is read from is one UsageError naming the file, and
`import-hf` refuses a hostile template before it writes anything (issue 42)."""

import mmap
import signal
import threading

import pytest
from support.chat_templates import GOOD, NESTED, _workdir

from engine.errors import UsageError
from engine.lm import chat, render_backstops
from engine.lm.chat import ChatTemplate, chat_prompts, read_chat_template, render_chats


def _render(text: str, **special: str) -> str:
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    return render_chats(ChatTemplate(text, "/models/m/chat_template.jinja", special), [conversation], "fix it")[0]


def _refused(text: str, match: str) -> str:
    """The one-line UsageError a template gives, which names its file."""
    with pytest.raises(UsageError, match=match) as refused:
        _render(text)
    message = str(refused.value)
    assert message.startswith("/models/m/chat_template.jinja: the chat template ") and "\n" not in message
    return message


@pytest.mark.nocompile
def test_a_template_renders_as_transformers_does():
    assert _render(GOOD, bos_token="<s>", eos_token="</s>") == "<s>s:be brief</s>u:hi</s>a:"
    assert _render("{{ 2 ** 10 }} {{ 'ab' * 3 }} {{ [1] * 2 }} {{ 'x' ~ 'y' }} {{ '%03d' % 7 }}") == (
        "1024 ababab [1, 1] xy 007"
    )
    assert _render("{% for i in range(500) %}{% for j in range(500) %}{% endfor %}{% endfor %}{{ 1 }}") == "1"
    # a macro's output (joined by Jinja's environment.concat), as transformers renders it: before, "['a1b']"
    macro = "{% macro f(x) %}a{{ x }}b{% endmacro %}[{{ f(1) }}]{% set s %}c{{ 2 }}{% endset %}{{ s }}"
    assert _render(macro) == "[a1b]c2"


@pytest.mark.nocompile
def test_tojson_loop_controls_and_absent_tools_are_transformers_own():
    """transformers' environment: its tojson (json.dumps, ensure_ascii=False, keys in their order;
    Jinja's own escapes <, >, & and ' and sorts the keys), jinja2.ext.loopcontrols, and tools=None,
    documents=None when none are given (Undefined is "not none")."""
    conversation = [{"role": "user", "content": "don't <b>é</b>", "call": {"b": 1, "a": [2]}}]

    def render(text: str) -> str:
        return render_chats(ChatTemplate(text, "/models/m/chat_template.jinja", {}), [conversation], "fix it")[0]

    assert render("{{ messages[0]['content'] | tojson }}") == '"don\'t <b>é</b>"'
    assert render("{{ messages[0]['call'] | tojson }}|{{ messages[0]['call'] | tojson(indent=1) }}") == (
        '{"b": 1, "a": [2]}|{\n "b": 1,\n "a": [\n  2\n ]\n}'
    )
    assert render("{{ messages[0]['call'] | tojson(ensure_ascii=True, sort_keys=True, separators=(',', ':')) }}") == (
        '{"a":[2],"b":1}'
    )
    loops = "{% for i in range(9) %}{% if i == 1 %}{% continue %}{% endif %}{% if i > 2 %}{% break %}{% endif %}{{ i }}"
    assert render(loops + "{% endfor %}") == "02"
    assert render("{% if tools is not none %}<tools>{% endif %}{{ documents is none }}") == "True"


@pytest.mark.nocompile
def test_a_huge_power_is_refused_not_computed():
    _refused("{{ (messages|length + 9) ** 100000000 }}", r"power of more than 65,536 bits \(11 \*\* 100000000\)")
    _refused("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "product")


@pytest.mark.nocompile
def test_nested_loops_share_one_iteration_budget(monkeypatch):
    # (a million iterations take ~2 s here, some 6 s on a loaded machine: the clock's own limit, tested
    # apart, must not answer first)
    monkeypatch.setattr(chat, "RENDER_SECONDS", 600.0)
    monkeypatch.setattr(chat, "RECORD_SECONDS", 600.0)
    _refused(NESTED, "more than 1,000,000 loop iterations")
    letters = "{% for c in 'abcdefghij' %}" * 7 + "{% endfor %}" * 7  # 10 ** 7 iterations, no range, no output
    _refused(letters, "more than 1,000,000 loop iterations")
    _refused("{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}", "recurses without end")


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "text",
    [
        "{{ 'x' * 10000000000 }}",
        "{% set s = 'x' * 1000000 %}{{ [s] * 100000 }}",  # a list of a million-character string, written out
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{{ '%999999999d' % 1 }}",
    ],
)
def test_a_huge_string_or_list_is_refused_before_it_is_built(text):
    _refused(text, "more than the 1,048,576 allowed")


@pytest.mark.nocompile
def test_the_output_is_capped():
    _refused("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "writes more than 1,048,576 characters")


@pytest.mark.nocompile
def test_memory_is_capped():
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    with render_backstops.address_space(render_backstops.MEMORY_BYTES):
        with pytest.raises((MemoryError, OSError)):  # an untouched mapping: without the limit it would succeed
            mmap.mmap(-1, 2 * render_backstops.MEMORY_BYTES)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    _refused("{{ 'x'.ljust(10000000000) }}", "needs more than 1 GiB of memory")  # (10 GB, were there no limit)
    assert resource.getrlimit(resource.RLIMIT_AS) == before


@pytest.mark.nocompile
def test_the_clock_is_checked_in_loops(monkeypatch):
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.05)
    _refused("{% for i in range(900) %}{% for j in range(900) %}{% endfor %}{% endfor %}", r"longer than 0.05 s")


@pytest.mark.nocompile
def test_the_clock_is_checked_at_each_filter_call_also_where_no_alarm_rings(monkeypatch):
    """A filter chain (map calls its filter once an item, no loop, no call the sandbox sees) ran
    where only the main thread's alarm stopped it: in another thread, 100,000 strings of 2 MB (a
    minute) ran whole."""
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.2)
    chain = "{{ range(100000)|map('center', 2000000)|map('length')|sum }}"
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(pytest.raises(UsageError, _render, chain)), daemon=True)
    thread.start()
    thread.join(5)
    assert outcome and "takes longer than 0.2 s to render" in str(outcome[0].value)


@pytest.mark.nocompile
def test_the_alarm_stops_a_render_that_no_check_sees(monkeypatch):
    """With the loop budget and clock checks off, only the SIGALRM backstop can stop the loops."""
    monkeypatch.setattr(chat._Budget, "spend", lambda self, iterations=0: None)
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.05)
    monkeypatch.setattr(render_backstops, "ALARM_SLACK_SECONDS", 0.0)
    handler = signal.getsignal(signal.SIGALRM)
    _refused("{% for i in range(4000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}", "longer than 0.05 s")
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "text, match",
    [
        ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses without end"),
        ("{% include 'other.jinja' %}", r"uses {% include %} \(line 1\), which reads another template"),
        ("{% import 'other.jinja' as other %}", r"uses {% import %}"),
        ("x\n{% from 'other.jinja' import f %}", r"uses {% from ... import %} \(line 2\)"),
        ("{% extends 'base.jinja' %}", r"uses {% extends %}"),
        ("{% for %}", r"is not valid Jinja \(line 1"),
        ("{{ messages.append(1) }}", "SecurityError"),
        ("{{ nothing.there }}", "UndefinedError"),
        ("{{ raise_exception('no system messages') }}", "refused the messages: no system messages"),
        ("{{ lipsum(1000000000) }}", "'lipsum' is undefined"),
    ],
)
def test_a_fault_inside_a_template_is_one_usage_error(text, match):
    _refused(text, match)


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "config, match",
    [
        ("{not json", "tokenizer_config.json is not valid JSON"),
        ([{"chat_template": GOOD}], "tokenizer_config.json holds a JSON array, not an object"),
        ({"chat_template": [GOOD, GOOD]}, r"chat_template holds .*; it must be a string, or a list of"),
        ({"chat_template": [{"name": "default"}]}, r'chat_template holds {"name": "default"}; it must be'),
        ({"chat_template": 7}, "chat_template is a JSON number; it must be a string"),
        ({"chat_template": [{"name": "tool_use", "template": GOOD}]}, "names no \"default\" template .*'tool_use'"),
    ],
)
def test_a_bad_tokenizer_config_is_one_usage_error(tmp_path, config, match):
    work = _workdir(tmp_path, config)
    with pytest.raises(UsageError, match=match) as refused:
        chat_prompts(work, ["hi"])
    assert str(work / "tokenizer_config.json") in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.nocompile
def test_a_template_file_that_is_not_utf8_is_one_usage_error(tmp_path):
    work = _workdir(tmp_path, jinja=b"{{ bos_token }}\xff\xfe")
    with pytest.raises(UsageError, match="chat_template.jinja cannot be read as UTF-8 text"):
        chat_prompts(work, ["hi"])


@pytest.mark.nocompile
def test_the_default_named_template_and_the_jinja_file_are_read(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": GOOD}]
    work = _workdir(tmp_path, {"chat_template": named, "bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    assert chat_prompts(work, ["hi", "yo"]) == ["<s>u:hi</s>a:", "<s>u:yo</s>a:"]
    _workdir(tmp_path, jinja=b"J{{ messages[0]['content'] }}{{ bos_token }}")  # transformers 5: preferred
    template = read_chat_template(work)
    assert template is not None and template.source == str(work / "chat_template.jinja")
    assert chat_prompts(work, ["hi"], system="be brief") == ["Jbe brief<s>"]
    with pytest.raises(UsageError, match="has no chat template"):
        chat_prompts(_workdir(tmp_path / "none", {"eos_token": "</s>"}), ["hi"])
