"""Text <-> token ids for the server, and the chat template.

Two tokenizers share one small interface (``encode``, ``decode``, ``token_text``,
``apply_chat_template``, ``eos_token_id``, ``vocab_size``):

- ``ByteTokenizer`` (the default, needs no file): ids 0-255 are the UTF-8 bytes,
  ``BYTE_EOS_ID`` = 256 is the end-of-sequence token ``<|endoftext|>``. A model's vocabulary
  is usually larger (the tiny preset has 1024 ids); ids 257 and up have no text of their
  own and decode to the placeholder ``<|id|>``, so nothing a model generates is invisible.
  The EOS token decodes to nothing. Its chat template, ``BYTE_CHAT_TEMPLATE``, writes each
  message as ``<|{role}|>\\n{content}\\n`` (roles system, user, assistant) and ends the
  prompt with ``<|assistant|>\\n`` so that the model writes the assistant's turn.
- ``HFTokenizer``: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library;
  special tokens are left out of decoded text. Its chat template is the one the tokenizer
  ships (``serving.chat_template``); without one, ``apply_chat_template`` raises
  ``ChatTemplateError`` (the server answers chat requests 400 and still serves
  completions).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from serving.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    special_tokens,
)

BYTE_EOS_ID = 256
BYTE_EOS_TEXT = "<|endoftext|>"
BYTE_CHAT_TEMPLATE = """\
{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('unknown chat role ' ~ message['role'] ~ '; expected system, user or assistant') }}
{% endif %}
<|{{ message['role'] }}|>
{{ message['content'] }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""
# Tried in order when a tokenizer.json names no EOS token of its own: common spellings.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "[EOS]", "<eos>")


class Tokenizer(Protocol):
    eos_token_id: int | None
    vocab_size: int
    chat_template: ChatTemplate | None  # None: chat requests cannot be served

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        """``[{"role": ..., "content": ...}, ...]`` -> the prompt text, ending where the
        assistant's turn begins. Raises ``ChatTemplateError``."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (see the module docstring)."""

    eos_token_id = BYTE_EOS_ID

    def __init__(self, vocab_size: int):
        if vocab_size <= BYTE_EOS_ID:
            raise ValueError(
                f"the byte tokenizer needs a vocabulary of more than {BYTE_EOS_ID} ids, "
                f"the model has {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.chat_template = ChatTemplate(BYTE_CHAT_TEMPLATE, {"eos_token": BYTE_EOS_TEXT})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Bytes decoded together (a character may span several tokens); an incomplete or
        invalid UTF-8 sequence decodes to U+FFFD."""
        parts, pending = [], bytearray()
        for token in token_ids:
            if token < 256:
                pending.append(token)
                continue
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if token != BYTE_EOS_ID:
                parts.append(f"<|{token}|>")
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_text(self, token_id: int) -> str:
        if token_id == BYTE_EOS_ID:
            return BYTE_EOS_TEXT
        return self.decode([token_id])

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        return self.chat_template.render(messages)


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: str | Path, eos_token: str | None = None):
        """``path``: a tokenizer.json or the folder holding it. ``eos_token``: the EOS
        token's text; default: ``eos_token`` of a tokenizer_config.json beside it, else the
        first of ``EOS_CANDIDATES`` in the vocabulary, else no EOS token. The chat template:
        ``serving.chat_template.load_chat_template`` of the folder.

        Raises:
          ValueError: no tokenizer.json, an unknown EOS token, or a template that does not
            parse."""
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        self._tokenizer = _Tokenizer.from_file(str(file))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        eos_token = eos_token or special_tokens(config).get("eos_token")
        candidates = [eos_token] if eos_token else EOS_CANDIDATES
        ids = [self._tokenizer.token_to_id(token) for token in candidates]
        if eos_token and ids[0] is None:
            raise ValueError(f"EOS token {eos_token!r} is not in {file}")
        self.eos_token_id = next((i for i in ids if i is not None), None)
        self.chat_template = load_chat_template(file.parent, config)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model's tokenizer has no chat template (no chat_template in its "
                "tokenizer_config.json, no chat_template.jinja): use /v1/completions"
            )
        return self.chat_template.render(messages)


def load_tokenizer(path: str | None, vocab_size: int) -> Tokenizer:
    """The tokenizer at ``path``, or the byte tokenizer when ``path`` is None; checks that
    its ids fit the model's vocabulary."""
    tokenizer = ByteTokenizer(vocab_size) if path is None else HFTokenizer(path)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary {vocab_size}"
        )
    return tokenizer
