"""Text <-> token ids for the server, and the chat template.

Two tokenizers share one small interface (``encode``, ``decode``, ``token_text``,
``eos_token_id``, ``vocab_size``):

- ``ByteTokenizer`` (the default, needs no file): ids 0-255 are the UTF-8 bytes,
  ``BYTE_EOS_ID`` = 256 is the end-of-sequence token ``<|endoftext|>``. A model's vocabulary
  is usually larger (the tiny preset has 1024 ids); ids 257 and up have no text of their
  own and decode to the placeholder ``<|id|>``, so nothing a model generates is invisible.
  The EOS token decodes to nothing.
- ``HFTokenizer``: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library;
  special tokens are left out of decoded text.

Chat template (``apply_chat_template``), the same for both: each message becomes
``<|{role}|>\\n{content}\\n`` (roles system, user, assistant), and the prompt ends with
``<|assistant|>\\n`` so that the model writes the assistant's turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

BYTE_EOS_ID = 256
BYTE_EOS_TEXT = "<|endoftext|>"
CHAT_ROLES = ("system", "user", "assistant")
# Tried in order when a tokenizer.json names no EOS token of its own: common spellings.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "[EOS]", "<eos>")


class Tokenizer(Protocol):
    eos_token_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...


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


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: str | Path, eos_token: str | None = None):
        """``path``: a tokenizer.json or the folder holding it. ``eos_token``: the EOS
        token's text; default: ``eos_token`` of a tokenizer_config.json beside it, else the
        first of ``EOS_CANDIDATES`` in the vocabulary, else no EOS token."""
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        self._tokenizer = _Tokenizer.from_file(str(file))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        eos_token = eos_token or _configured_eos(file.parent)
        candidates = [eos_token] if eos_token else EOS_CANDIDATES
        ids = [self._tokenizer.token_to_id(token) for token in candidates]
        if eos_token and ids[0] is None:
            raise ValueError(f"EOS token {eos_token!r} is not in {file}")
        self.eos_token_id = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def _configured_eos(folder: Path) -> str | None:
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    eos = json.loads(config.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def apply_chat_template(messages: Iterable[tuple[str, str]]) -> str:
    """(role, content) pairs -> the prompt text (see the module docstring)."""
    turns = []
    for role, content in messages:
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown chat role {role!r}; expected one of {CHAT_ROLES}")
        turns.append(f"<|{role}|>\n{content}\n")
    return "".join(turns) + "<|assistant|>\n"


def load_tokenizer(path: str | None, vocab_size: int) -> Tokenizer:
    """The tokenizer at ``path``, or the byte tokenizer when ``path`` is None; checks that
    its ids fit the model's vocabulary."""
    tokenizer = ByteTokenizer(vocab_size) if path is None else HFTokenizer(path)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary {vocab_size}"
        )
    return tokenizer
