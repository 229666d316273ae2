"""Chat messages -> prompt text through a Jinja chat template, rendered the way Hugging Face
transformers renders a tokenizer's ``chat_template``, so a model gets the prompt format it
was trained on.

The environment matches transformers': jinja2's ``ImmutableSandboxedEnvironment`` (a
template cannot reach Python internals or mutate its inputs) with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that leaves
non-ASCII text as it is, and the globals ``raise_exception(message)`` and
``strftime_now(format)``. A template sees ``messages`` (a list of ``{"role", "content"}``
dicts), ``add_generation_prompt=True`` (the prompt ends where the assistant's turn
begins) and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) by name.

Where a template comes from (``load_chat_template``): ``chat_template.jinja`` in the
tokenizer's folder, else the ``chat_template`` entry of its ``tokenizer_config.json``
(a string, or a list of ``{"name", "template"}`` of which ``default`` is used).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# tokenizer_config.json keys whose tokens a template may name.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The messages cannot become a prompt: no template, or the template refused them."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        """Raises ValueError if ``source`` is not a valid Jinja template."""
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the chat template does not parse: {error}") from None
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt for ``messages``, ending where the assistant's reply begins.

        Raises:
          ChatTemplateError: the template refused the messages (its message says why).
        """
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=True,
                **self.special_tokens,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from None


def load_chat_template(folder: Path, config: Mapping) -> ChatTemplate | None:
    """The template shipped with the tokenizer in ``folder`` whose tokenizer_config.json
    holds ``config`` (see the module docstring), or None if it ships none."""
    jinja_file = folder / "chat_template.jinja"
    source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
    if isinstance(source, list):
        named = {entry.get("name"): entry.get("template") for entry in source}
        source = named.get("default")
    if not source:
        return None
    return ChatTemplate(source, special_tokens(config))


def special_tokens(config: Mapping) -> dict[str, str]:
    """``{"bos_token": "<s>", ...}`` from a tokenizer_config.json (a token is a string or an
    ``{"content": ...}`` object there)."""
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        token = config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            tokens[key] = token
    return tokens
