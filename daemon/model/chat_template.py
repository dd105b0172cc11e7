"""Chat templates, rendered as transformers renders them; tether's own (the byte tokenizer's);
and the tool-call format a template teaches."""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """No chat template, or the template failed on these messages."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks
    (transformers' return_assistant_tokens_mask); for serving it renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # Sandboxed: a checkpoint's template is untrusted code. The same extensions as transformers'
    # apply_chat_template, so every template it renders renders here.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def render_chat_template(source: str, messages: list[dict[str, Any]],
                         add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
                         **special: str | None) -> str:
    # tools and documents are defined (as None) exactly as transformers and vLLM define them
    # when a request has none: templates test `tools is not none` as often as `is defined`.
    try:
        return _compile(source).render(messages=messages, tools=tools, documents=None,
                                       add_generation_prompt=add_generation_prompt, **special)
    except Exception as e:  # template code can fail in any way: None is not iterable, ...
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


# ---- tool calls: the format a template has the model write them in


def tool_call_format(template: str | None) -> str | None:
    """The tool-call format (ipc.records.ToolCallFormat's value) a chat template teaches; None
    when it names none of those."""
    if template is None:
        return None
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters": dictionary of argument name' in template:  # Llama 3.1, 3.2, 3.3
        return "llama3_json"
    return None


# Special tokens a format writes as part of its calls: the parser reads them as text.
TOOL_CALL_TOKENS = {"mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")}

# ChatML; with tools, Qwen 2.5's way of offering them and of writing calls (Hermes' format).
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{{ '\n\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for call in m['tool_calls'] or [] %}{% if m['content'] or not loop.first %}{{ '\n' }}"
    "{% endif %}<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
