"""A chat template rendered the way transformers' `apply_chat_template` renders it (torch-free).

    render = compile_template(source, special_tokens)       # HFDirError when the template does not compile
    text = render(messages, add_generation_prompt=False)    # ChatRenderError when the template raises

The environment is transformers' (transformers/utils/chat_template_utils.py, `_compile_jinja_template`):
Jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension, a
`tojson` filter that does not escape HTML, and the globals `raise_exception`, `strftime_now`, `dict` and a
`namespace` that refuses underscore attributes. `{% generation %}` blocks render their body (the span finder,
trainer/data/chat/spans.py, does not need them). The template sees `messages`, `add_generation_prompt` and
the tokenizer's special tokens (`bos_token`, `eos_token`, ...), as transformers passes them. Jinja2 is
imported here, when a chat source is opened; without it the error says `pip install jinja2`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from trainer.init.hf_dir import HFDirError


class ChatRenderError(ValueError):
    """The template raised on a conversation (raise_exception, an undefined value, a sandbox refusal)."""


Render = Callable[..., str]


def _environment() -> Any:
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - depends on the environment
        raise HFDirError("data.source chat renders a Jinja chat template and needs the `jinja2` package; "
                         "pip install jinja2") from None

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant tracker): the body, as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature trick: `namespace(self=...)` works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a template namespace cannot hold {name!r}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = Namespace
    return env


def compile_template(source: str, special_tokens: dict[str, str], where: str = "chat template") -> Render:
    """The template compiled once; render(messages, add_generation_prompt) -> the text."""
    import jinja2

    try:
        template = _environment().from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise HFDirError(f"{where} does not compile ({type(exc).__name__}: {str(exc)[:200]}); fix the template") from None

    def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        try:
            return template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **special_tokens)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatRenderError(f"the chat template fails ({type(exc).__name__}: {str(exc)[:200]})") from None

    return render
