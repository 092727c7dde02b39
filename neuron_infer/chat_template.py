"""Chat templates rendered under limits: a template is code from the model's files, so it runs in a sandbox that
bounds what it may do, how long it may run and how much it may build.

    text = render_chat(tokenizer, messages)   # the conversation as text, ending with the assistant's turn header

The environment is jinja2's immutable sandbox (no attribute access to internals, no mutation of lists or dicts)
with the names Hugging Face chat templates use (`raise_exception`, `strftime_now`, the `tojson` filter, the
`generation` tag, loop controls), so a template renders as `tokenizer.apply_chat_template` renders it. On top:

- steps: at most MAX_STEPS template lines and calls per render, and MAX_SECONDS of wall time;
- size: the rendered text, and every string or list the template builds (`*`, `+`, `~`, `%`, filters, string
  methods), holds at most MAX_CHARS items; an integer argument of a call or filter (a width, a count) is at
  most MAX_INT, and `**` yields at most MAX_POWER_BITS bits.

Every refusal and every template error (a syntax error, a sandbox refusal, the template's own `raise_exception`)
is a NeuronInferError naming the file that holds the template.
"""
from __future__ import annotations

import functools
import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from neuron_infer.errors import NeuronInferError

MAX_STEPS = 2_000_000  # template lines executed plus calls made, per render
MAX_SECONDS = 10.0  # wall time per render
MAX_CHARS = 1 << 24  # 16 Mi items: the rendered text and every string or list built on the way
MAX_INT = 1 << 20  # the largest integer argument of a call or filter
MAX_POWER_BITS = 4096
_TEMPLATE_FILE = "<template>"  # the code filename jinja gives a template compiled from a string
_BIG_WIDTH = re.compile(r"\d{7,}")  # a width or precision of a million or more in a format string


class TemplateLimitError(Exception):
    """A render went past one of the limits (turned into a NeuronInferError naming the file)."""


def template_file(tokenizer) -> str:
    """The file a tokenizer's chat template comes from (for messages)."""
    d = Path(getattr(tokenizer, "name_or_path", "") or ".")
    jinja_file = d / "chat_template.jinja"
    return str(jinja_file if jinja_file.is_file() else d / "tokenizer_config.json")


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """The conversation through the tokenizer's chat template, ending with the assistant's turn header."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):  # named templates: the default one
        source = source.get("default")
    where = template_file(tokenizer)
    if not source:
        raise NeuronInferError("this model's tokenizer has no chat template: chat needs one (use --prompt "
                               "without --chat for plain completion)")
    if not isinstance(source, str) or len(source) > MAX_CHARS:
        raise NeuronInferError(f"{where}: the chat template is not a string of at most {MAX_CHARS} characters; "
                               "use a checkpoint with a valid chat template")
    special = {k: v for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()}
    try:
        template = _compiled(source)
        return _render(template, {**special, "messages": messages, "tools": None, "documents": None,
                                  "add_generation_prompt": True})
    except TemplateLimitError as e:
        raise NeuronInferError(f"{where}: the chat template {e}; use a checkpoint whose chat template renders "
                               "within these limits") from None
    except RecursionError:
        raise NeuronInferError(f"{where}: the chat template recurses too deeply; use a checkpoint with a "
                               "working chat template") from None
    except MemoryError:
        raise NeuronInferError(f"{where}: the chat template ran out of memory") from None
    except Exception as e:  # noqa: BLE001 (a template may raise anything: jinja errors, TypeError from its code)
        import jinja2

        if isinstance(e, jinja2.TemplateError) and type(e) is jinja2.TemplateError:  # raise_exception(message)
            raise NeuronInferError(f"{where}: the chat template refused this conversation: {e}") from None
        raise NeuronInferError(f"{where}: the chat template failed ({type(e).__name__}: {e}); use a checkpoint "
                               "with a working chat template") from None


@functools.lru_cache(maxsize=8)
def _compiled(source: str):
    return _environment().from_string(source)


def _render(template, variables: dict[str, Any]) -> str:
    """Render with the step and time budget; the output is streamed and bounded by MAX_CHARS."""
    budget = _Budget()
    previous = sys.gettrace()
    _active.append(budget)
    sys.settrace(budget.trace)
    try:
        parts, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > MAX_CHARS:
                raise TemplateLimitError(f"rendered more than {MAX_CHARS} characters")
            parts.append(chunk)
        return "".join(parts)
    finally:
        sys.settrace(previous)
        _active.remove(budget)


class _Budget:
    """Counts the template's lines (a trace function on its frames only) and calls; raises past the limits."""

    def __init__(self):
        self.steps, self.deadline = 0, time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(f"ran more than {MAX_STEPS} steps (an endless or very long loop)")
        if self.steps % 1024 == 0 and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"ran longer than {MAX_SECONDS:g} s")

    def trace(self, frame, event, _arg):
        if event == "call" and frame.f_code.co_filename == _TEMPLATE_FILE:
            return self._local
        return None

    def _local(self, _frame, event, _arg):
        if event == "line":
            self.step()
        return self._local


_active: list[_Budget] = []  # the budget of the render in progress (the last one)


def _step() -> None:
    if _active:
        _active[-1].step()


def _check_size(value: Any) -> Any:
    if isinstance(value, str | list | tuple | dict | set | frozenset) and len(value) > MAX_CHARS:
        raise TemplateLimitError(f"built a value of more than {MAX_CHARS} items")
    return value


def _check_args(args: tuple, kwargs: dict) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT:
            raise TemplateLimitError(f"passed the number {a} to a call (at most {MAX_INT})")
        if isinstance(a, float) and abs(a) > MAX_INT:
            raise TemplateLimitError(f"passed the number {a:g} to a call (at most {MAX_INT})")


def _size(x: Any) -> int:
    return len(x) if isinstance(x, str | list | tuple) else 0


def _binop(operator: str, left: Any, right: Any) -> Any:
    """`*`, `**`, `+` and `%` with their result size checked before it is built."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if _size(seq) and isinstance(n, int) and _size(seq) * max(n, 0) > MAX_CHARS:
                raise TemplateLimitError(f"built a value of more than {MAX_CHARS} items")
        return left * right
    if operator == "**":
        if (isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0
                and right * abs(left).bit_length() > MAX_POWER_BITS):
            raise TemplateLimitError(f"computed a power of more than {MAX_POWER_BITS} bits")
        return left**right
    if operator == "+":
        if _size(left) + _size(right) > MAX_CHARS:
            raise TemplateLimitError(f"built a value of more than {MAX_CHARS} items")
        return left + right
    if operator == "%" and isinstance(left, str) and _BIG_WIDTH.search(left):
        raise TemplateLimitError("formats with a width of a million or more")
    return left % right


# Filters whose Python implementation spends seconds per MiB (textwrap, regular expressions over the whole text):
# the time budget is checked between steps, not inside a call, so their input is bounded instead.
SLOW_TEXT_FILTERS = frozenset({"wordwrap", "urlize", "striptags", "wordcount", "title", "indent"})
MAX_SLOW_FILTER_CHARS = 1 << 20


def _bounded_filter(f, name: str = ""):
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # (context,) value: not arguments

    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marker
    def wrapper(*args, **kwargs):
        _step()
        _check_args(args[skip:], kwargs)
        value = args[skip - 1] if len(args) >= skip else None
        if name in SLOW_TEXT_FILTERS and isinstance(value, str) and len(value) > MAX_SLOW_FILTER_CHARS:
            raise TemplateLimitError(f"applied {name} to {len(value)} characters (at most {MAX_SLOW_FILTER_CHARS})")
        width = (args[skip:] or [kwargs.get("width", 4)])[0]
        if name == "indent" and isinstance(value, str) and isinstance(width, int) and (
                len(value) + max(width, 0) * (value.count("\n") + 1) > MAX_CHARS):  # each line gets `width` more
            raise TemplateLimitError(f"built a value of more than {MAX_CHARS} items")
        return _check_size(f(*args, **kwargs))

    return wrapper


def _precheck_method(obj: Any, args: tuple, kwargs: dict) -> None:
    """A string method's result can be far larger than its inputs (`replace('', long)`, `format` widths)."""
    method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner = getattr(method, "__self__", None)
    if not isinstance(owner, str):
        return
    texts = [a for a in (*args, *kwargs.values()) if isinstance(a, str)]
    if getattr(method, "__name__", "") in ("format", "format_map") and _BIG_WIDTH.search(owner):
        raise TemplateLimitError("formats with a width of a million or more")
    if (len(owner) + 1) * (1 + sum(len(t) for t in texts)) > MAX_CHARS:
        raise TemplateLimitError(f"may build a string of more than {MAX_CHARS} characters")


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:  # `a ~ b`: through the size check
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks; renders its body."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = Generator

        def call_binop(self, context, operator, left, right):
            _step()
            return _check_size(_binop(operator, left, right))

        def call(self, context, obj, /, *args, **kwargs):
            _step()
            _check_args(args, kwargs)
            _precheck_method(obj, args, kwargs)
            return _check_size(super().call(context, obj, *args, **kwargs))

        def bounded_concat(self, items) -> str:
            texts = [str(x) for x in items]
            if sum(map(len, texts)) > MAX_CHARS:
                raise TemplateLimitError(f"built a string of more than {MAX_CHARS} characters")
            return "".join(texts)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(f, name) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)  # lorem ipsum of up to 10^6 paragraphs in one call: no chat template uses it
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
