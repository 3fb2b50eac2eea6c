"""Chat templates: a model's Jinja template for turning messages into a prompt, read from a
workdir (or the Hugging Face directory it is imported from) and rendered in a sandbox that
bounds each render's time, memory, loop iterations and output.

A template is code that came with a downloaded model: rendering it must neither hang, nor
exhaust memory, nor end in a traceback. Each fault (bad Jinja, a bound reached, an exception
inside the template) becomes one UsageError naming the template's file."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from engine.errors import UsageError
from engine.lm.chat_files import CONFIG_FILE, JINJA_FILE, ChatTemplate, read_chat_template, short
from engine.lm.render_backstops import MEMORY_BYTES, Alarm, backstops
from engine.lm.template_clock import strftime_now

# Bounds on one render (one conversation). Real chat templates stay far below each of them: a
# conversation is a few messages, a loop over them, a few kilobytes of text.
MAX_OUTPUT_CHARS = 1 << 20  # the rendered prompt, and any one string, list or join the template builds
MAX_INT_BITS = 1 << 16  # an integer that `*` or `**` makes: 65,536 bits (about 19,700 digits)
MAX_ITERATIONS = 1_000_000  # loop iterations of all the render's {% for %} loops together (nested ones share it)
RENDER_SECONDS = 5.0  # wall clock, checked at every loop iteration, call and output chunk
# Bounds on the renders of one record of training data (engine/data/conversations.py renders a
# record whole and its prefixes, to find the spans the loss covers: two prefixes per assistant
# message). Each render's loop iterations are bounded by what it renders (a real template loops
# over the messages a few times, and over a message's parts or lines): 1,000, and 100 a message,
# and 1 a character of the messages' content; and all of a record's renders together:
RENDER_BASE_ITERATIONS, RENDER_MESSAGE_ITERATIONS = 1_000, 100
RECORD_ITERATIONS = 4_000_000  # loop iterations
RECORD_OUTPUT_CHARS = 1 << 28  # characters written (256 Mi)
RECORD_SECONDS = 10.0  # wall clock
# Bounds on the files a template is read from, checked by their size before a byte is read
# (engine/lm/tokenizer.py: MAX_TEMPLATE_BYTES, 1 MiB, and MAX_CONFIG_BYTES, 16 MiB, for tokenizer_config.json)

# what import-hf renders once to check a template it keeps (sample --chat's shape of conversation)
SAMPLE_CONVERSATION = [{"role": "user", "content": "Hello!"}]


class _Exceeded(Exception):
    """A render reached one of its bounds (the message says which)."""


class _Forbidden(TemplateSyntaxError):
    """{% include %}, {% import %}, {% from %} or {% extends %}: there are no other templates to read."""


class _Refused(TemplateError):
    """The template's own raise_exception(): it refuses the messages it was given."""


def _refuse(message: str) -> None:
    raise _Refused(message)


_RECORD = "for one record (all the renders that find its trained spans together)"
CLOCK_EVERY = 64  # output chunks between two looks at the clock (loops and calls look at every step)


class _RecordBudget:
    """What all the renders of one record may still spend together: loop iterations, output and time."""

    def __init__(self) -> None:
        self.iterations = RECORD_ITERATIONS
        self.chars = RECORD_OUTPUT_CHARS
        self.deadline = time.monotonic() + RECORD_SECONDS


class _Budget:
    """What one render may still spend: loop iterations and time, and its record's share (if any)."""

    def __init__(self, record: Optional[_RecordBudget] = None, messages: Any = ()) -> None:
        self.allowed, self.what = MAX_ITERATIONS, "(all loops together)"
        if record is not None:  # a render of a record's: bounded by what it renders too
            sizes = [
                len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str) else 0 for m in messages
            ]
            allowed = RENDER_BASE_ITERATIONS + RENDER_MESSAGE_ITERATIONS * len(sizes) + sum(sizes)
            if allowed < MAX_ITERATIONS:
                self.allowed = allowed
                self.what = (
                    f"to render {len(sizes):,} message(s) of {sum(sizes):,} characters (a render of training data may "
                    f"run {RENDER_BASE_ITERATIONS:,}, {RENDER_MESSAGE_ITERATIONS} a message and 1 a character)"
                )
        self.iterations = self.allowed
        self.deadline = time.monotonic() + RENDER_SECONDS
        self.record = record
        self.written = 0  # characters the render has written so far (_joined)

    def spend(self, iterations: int = 0) -> None:
        self.iterations -= iterations
        if self.iterations < 0:
            raise _Exceeded(f"runs more than {self.allowed:,} loop iterations {self.what}")
        now = time.monotonic()
        if now > self.deadline:
            raise Alarm(f"takes longer than {RENDER_SECONDS:g} s to render")
        record = self.record
        if record is not None:
            record.iterations -= iterations
            if record.iterations < 0:
                raise _Exceeded(f"runs more than {RECORD_ITERATIONS:,} loop iterations {_RECORD}")
            if now > record.deadline:
                raise _Exceeded(f"takes longer than {RECORD_SECONDS:g} s {_RECORD}")

    def wrote(self, chars: int) -> None:
        """A render's output counted against its record's."""
        if self.record is not None:
            self.record.chars -= chars
            if self.record.chars < 0:
                raise _Exceeded(f"writes more than {RECORD_OUTPUT_CHARS:,} characters {_RECORD}")


def _check_size(size: int, what: str) -> None:
    if size > MAX_OUTPUT_CHARS:
        raise _Exceeded(f"builds {what} of size {size:,}, more than the {MAX_OUTPUT_CHARS:,} allowed")


def _size(value: Any) -> int:
    """A string's length; a list's or tuple's, counting the characters of the strings in it (its
    text when written out, or joined)."""
    if isinstance(value, str):
        return len(value)
    return sum(len(item) if isinstance(item, str) else 1 for item in value)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuses, before Python computes it, an operation whose result would be huge."""
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and ints and abs(left) > 1 and right > 0:
        if left.bit_length() * right > MAX_INT_BITS:
            raise _Exceeded(f"computes a power of more than {MAX_INT_BITS:,} bits ({left} ** {right})")
    elif operator == "*" and ints:
        if left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _Exceeded(f"computes a product of more than {MAX_INT_BITS:,} bits")
    elif operator == "*" and isinstance(left, int) != isinstance(right, int):  # a repetition
        sequence, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(sequence, (str, list, tuple)):
            _check_size(_size(sequence) * max(times, 0), f"a {type(sequence).__name__} repetition")
    elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        _check_size(_size(left) + _size(right), f"a {type(left).__name__}")
    elif operator == "%" and isinstance(left, str):  # printf-style formatting: widths make padding
        fields = re.findall(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?", left)
        widths = [int(number) for field in fields for number in field if number]
        if "*" in left:  # widths given as arguments
            widths += [a for a in (right if isinstance(right, tuple) else (right,)) if isinstance(a, int)]
        _check_size(max([0, *widths]), "a formatted field")


class _BoundedLoops(NodeTransformer):
    """Every {% for %} iterates through the environment's budget and every `~` joins through its
    size check; {% include %} and its kind (which read other templates) are refused."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("budgeted"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("joined"), node.nodes, [], None, None)

    def generic_visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if isinstance(node, (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
            tag = type(node).__name__.lower().replace("fromimport", "from ... import")
            raise _Forbidden(f"uses {{% {tag} %}} (line {node.lineno}), which reads another template", node.lineno)
        return super().generic_visit(node, *args, **kwargs)


class _Generation(Extension):
    """transformers' {% generation %}...{% endgeneration %}: the text of an assistant's turn, written
    as it is, its [start, end) place in the output recorded where a render asks (Renderer's
    `generated`): the spans of a record's assistant messages from one render."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_generated", []), [], [], body).set_lineno(lineno)

    def _generated(self, caller: Any) -> str:
        text = caller()
        env = self.environment
        assert isinstance(env, BoundedEnvironment)
        if env.generated is not None:  # (where the block's text goes once written: checked by the caller)
            env.generated.append((env.budget.written, env.budget.written + len(text), str(text)))
        return text


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' tojson: json.dumps as it is (Jinja's own escapes <, >, & and ' and sorts the keys)."""
    if isinstance(indent, (int, str)):
        _check_size(indent if isinstance(indent, int) else len(indent), "a JSON indent")
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    _check_size(len(text), "a JSON text")
    return text


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every loop, call, `~`, and `*`, `**`, `%`, `+` checked
    against the current render's budget."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self) -> None:
        # optimized=False: no constant folding, so nothing of the template runs while compiling
        # transformers' environment otherwise: its extensions, its tojson, its globals
        super().__init__(trim_blocks=True, lstrip_blocks=True, optimized=False, extensions=[_Generation, loopcontrols])
        self.filters["tojson"] = _tojson
        # each filter and test call looks at the clock: map() and select() call theirs once an item, unseen by `call`
        self.filters = {name: self._clocked(function) for name, function in self.filters.items()}
        self.tests = {name: self._clocked(function) for name, function in self.tests.items()}
        self.globals.update(raise_exception=_refuse, strftime_now=strftime_now)
        del self.globals["lipsum"]  # Jinja's placeholder text generator: no template needs it, lipsum(10 ** 9) hangs
        self.budget = _Budget()
        self.record: Optional[_RecordBudget] = None  # the record whose renders share RECORD_* bounds, if any
        self.generated: Optional[list[tuple[int, int, str]]] = None  # {% generation %} blocks written, if asked

    def _parse(self, source: str, name: Optional[str], filename: Optional[str]) -> nodes.Template:
        tree = _BoundedLoops().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return self.binop_table[operator](left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's names)
        __self.budget.spend()
        return super().call(__context, __obj, *args, **kwargs)

    def _clocked(self, function: Any) -> Any:
        @functools.wraps(function)  # (with Jinja's pass_context and its kind)
        def clocked(*args: Any, **kwargs: Any) -> Any:
            self.budget.spend()
            return function(*args, **kwargs)

        return clocked

    def budgeted(self, iterable: Any) -> Iterator[Any]:
        for item in iterable:
            self.budget.spend(1)
            yield item

    def joined(self, *parts: Any) -> str:
        """`a ~ b ~ ...`, its size checked before it is built."""
        return self.concat(str(part) for part in parts)

    def concat(self, parts: Iterable[str]) -> str:
        """Jinja's own join of a buffer (a macro's or a block's output, compiled as environment.concat),
        its size checked before it is built."""
        texts = list(parts)
        _check_size(sum(map(len, texts)), "a string")
        return "".join(texts)


class Renderer:
    """A chat template compiled once, rendering one conversation per call within the bounds; each
    fault is a UsageError naming `where` (if given), the template's file, the fault and `fix`."""

    special_tokens = False  # the tokenizer adds no special tokens to the text: the template writes them

    def __init__(self, template: ChatTemplate, fix: str) -> None:
        self.template, self.fix = template, fix
        self.env = BoundedEnvironment()
        with self._faults(""), _bounded(self.env):  # compiling runs nothing of the template, but is bounded too
            self.compiled = self.env.from_string(template.text)

    def __call__(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        where: str = "",
        allow_refusal: bool = False,
        generated: Optional[list[tuple[int, int, str]]] = None,
    ) -> Optional[str]:
        """`messages` rendered (as transformers' apply_chat_template(..., add_generation_prompt)
        renders them); with `allow_refusal`, None where the template's own raise_exception() refuses
        them. `generated` receives (start, end, text) of each {% generation %} block written."""
        self.env.generated = generated
        try:
            with self._faults(where, allow_refusal), _bounded(self.env, messages):
                chunks = self.compiled.generate(  # (tools and documents: None, as transformers gives them)
                    messages=messages,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **self.template.special,
                )
                return _joined(chunks, self.env.budget)
        finally:
            self.env.generated = None
        return None  # the template refused them, which `allow_refusal` allows

    @contextlib.contextmanager
    def record(self, where: str) -> Iterator[None]:
        """The renders inside share one record's bounds (RECORD_ITERATIONS, RECORD_OUTPUT_CHARS,
        RECORD_SECONDS) besides each render's own, and one set of backstops (alarm, address space)."""
        self.env.record = _RecordBudget()
        try:
            with self._faults(where), backstops(RECORD_SECONDS, f"takes longer than {RECORD_SECONDS:g} s {_RECORD}"):
                yield
        finally:
            self.env.record = None

    @contextlib.contextmanager
    def _faults(self, where: str, allow_refusal: bool = False) -> Iterator[None]:
        try:
            yield
        except UsageError:  # (said already, by a render inside a record, or by the code between renders)
            raise
        except (Exception, Alarm) as e:  # a template is code: whatever it raises is its fault, said in one line
            if allow_refusal and isinstance(e, _Refused):
                return
            raise UsageError(f"{where}{self.template.source}: the chat template {_fault(e)}; {self.fix}") from None


def render_chats(
    template: ChatTemplate, conversations: list[list[dict]], fix: str, allow_refusal: bool = False
) -> list[str]:
    """Each conversation through `template`, ready for the assistant's reply (as transformers'
    apply_chat_template(..., add_generation_prompt=True) renders it), each render within the
    bounds; otherwise UsageError naming the template's file, the fault and `fix`. With
    `allow_refusal`, the template's own raise_exception() gives [] instead."""
    render = Renderer(template, fix)
    rendered = []
    for messages in conversations:
        text = render(messages, allow_refusal=allow_refusal)
        if text is None:
            return []
        rendered.append(text)
    return rendered


def _joined(chunks: Iterator[str], budget: _Budget) -> str:
    """The rendered text, refused once it passes MAX_OUTPUT_CHARS."""
    out: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_OUTPUT_CHARS:
            raise _Exceeded(f"writes more than {MAX_OUTPUT_CHARS:,} characters")
        out.append(chunk)
        budget.written = size
        if len(out) % CLOCK_EVERY == 0:
            budget.spend()
    budget.wrote(size)
    return "".join(out)


def _fault(error: BaseException) -> str:
    """What went wrong, in a few words on one line."""
    if isinstance(error, (_Exceeded, Alarm)):
        return str(error)
    if isinstance(error, _Forbidden):
        return f"{error.message}; a chat template must be one self-contained file"
    if isinstance(error, _Refused):
        return f"refused the messages: {short(error.message)}"
    if isinstance(error, TemplateSyntaxError):
        return f"is not valid Jinja (line {error.lineno}: {short(error.message)})"
    if isinstance(error, RecursionError):
        return "recurses without end (a macro or a recursive loop that keeps calling itself)"
    if isinstance(error, MemoryError):
        return f"needs more than {MEMORY_BYTES / 2**30:g} GiB of memory"
    return f"fails with {type(error).__name__}: {short(error)}"


@contextlib.contextmanager
def _bounded(env: BoundedEnvironment, messages: Any = ()) -> Iterator[None]:
    """A fresh budget for one render (of `messages`), with its backstops (those of its record,
    where it is one of a record's renders: Renderer.record)."""
    env.budget = _Budget(env.record, messages)
    if env.record is not None:
        yield
        return
    with backstops(RENDER_SECONDS, f"takes longer than {RENDER_SECONDS:g} s to render"):
        yield


def chat_prompts(work: Path, texts: list[str], system: str = "") -> list[str]:
    """Each of `texts` as a user's message (after `system`'s, if given) through the workdir's
    chat template, ready for the assistant's reply; UsageError where the model has none, or the
    template fails or reaches a bound."""
    template = read_chat_template(work)
    if template is None:
        raise UsageError(
            f"--chat: {work} has no chat template (no {JINJA_FILE}, nor chat_template in {CONFIG_FILE}); "
            "import the model from a Hugging Face directory that has one, or leave out --chat"
        )
    first = [{"role": "system", "content": system}] if system else []
    conversations = [[*first, {"role": "user", "content": text}] for text in texts]
    return render_chats(template, conversations, f"correct or remove it in {work}, or leave out --chat")


def check_imported_template(hf_dir: Path) -> None:
    """UsageError when the chat template import-hf keeps from `hf_dir` cannot be read, or does not
    render a sample conversation within the bounds. The template's own refusal of the sample
    (raise_exception) passes: which conversations it takes is its own affair."""
    template = read_chat_template(hf_dir)
    if template is not None:
        fix = "correct or remove it in the Hugging Face directory, then import again"
        render_chats(template, [SAMPLE_CONVERSATION], fix, allow_refusal=True)
