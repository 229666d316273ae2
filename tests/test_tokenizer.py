"""serving.tokenizer and serving.chat_template: the byte tokenizer, a Hugging Face
tokenizer folder written by the test (tokenizer.json + tokenizer_config.json), and chat
templates rendered as transformers renders them; a server whose tokenizer has no template
refuses chat (400) and still serves completions."""

import contextlib
import json
from pathlib import Path

import pytest
from tiny_server import TINY_SERVER_ARGS, tiny_server_env
from tokenizers import Tokenizer, models, pre_tokenizers

from serving.chat_template import ChatTemplateError
from serving.tokenizer import BYTE_EOS_ID, ByteTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "hello", "world", "user"]
# ChatML with a BOS token, indented block tags (lstrip_blocks / trim_blocks must remove the
# indentation and the newline after each tag) and a rule enforced with raise_exception.
CHATML = """\
{{ bos_token }}
{%- for message in messages %}
    {% if message['role'] == 'system' and not loop.first %}
        {{ raise_exception('the system message must come first') }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello {{ world }} ✓"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "world"},
]
CHATML_PROMPT = (
    "<s><|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nhello {{ world }} ✓<|im_end|>\n"
    "<|im_start|>assistant\nhello<|im_end|>\n"
    "<|im_start|>user\nworld<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def write_tokenizer(folder: Path, config: dict | None = None, jinja: str | None = None) -> Path:
    """A word-level tokenizer.json over ``VOCAB`` (its markers as special tokens), with a
    tokenizer_config.json holding ``config`` and a chat_template.jinja holding ``jinja``."""
    folder.mkdir(parents=True, exist_ok=True)
    hf = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    hf.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


def chatml_config(template=CHATML) -> dict:
    return {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "<|im_end|>",
        "chat_template": template,
    }


def test_byte_tokenizer_round_trip_and_placeholders():
    tok = ByteTokenizer(1024)
    ids = tok.encode("héllo ✓")
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == "héllo ✓"
    assert tok.decode([104, BYTE_EOS_ID, 700, 105]) == "h<|700|>i"
    assert tok.token_text(BYTE_EOS_ID) == "<|endoftext|>"
    with pytest.raises(ValueError, match="vocabulary"):
        ByteTokenizer(200)


def test_hf_tokenizer_from_tokenizer_json(tmp_path):
    tok = load_tokenizer(str(write_tokenizer(tmp_path, {"eos_token": "</s>"})), vocab_size=1024)
    assert tok.eos_token_id == 2
    assert tok.encode("hello world") == [5, 6]
    assert tok.decode([5, 2, 6]) == "hello world"
    with pytest.raises(ValueError, match="tokenizer has"):
        load_tokenizer(str(tmp_path), vocab_size=3)


def test_byte_chat_template():
    tok = ByteTokenizer(1024)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    )
    assert text == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"
    with pytest.raises(ChatTemplateError, match="unknown chat role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_tokenizer_config_template_rendered_exactly(tmp_path):
    tok = load_tokenizer(str(write_tokenizer(tmp_path, chatml_config())), vocab_size=1024)
    assert tok.eos_token_id == VOCAB.index("<|im_end|>")
    # Message text is data, never template code: "{{ world }}" stays as written.
    assert tok.apply_chat_template(MESSAGES) == CHATML_PROMPT
    # The template's markers encode as the special tokens they are.
    ids = tok.encode(CHATML_PROMPT)
    assert ids[0] == VOCAB.index("<s>") and ids.count(VOCAB.index("<|im_start|>")) == 5
    with pytest.raises(ChatTemplateError, match="the system message must come first"):
        tok.apply_chat_template([*MESSAGES, {"role": "system", "content": "late"}])


def test_chat_template_jinja_file_wins_and_tojson_keeps_text(tmp_path):
    jinja = "{% for m in messages %}{{ m | tojson }}{{ eos_token }}{% endfor %}"
    folder = write_tokenizer(tmp_path, chatml_config(), jinja=jinja)
    tok = load_tokenizer(str(folder), vocab_size=1024)
    text = tok.apply_chat_template([{"role": "user", "content": "é <b> & 'q'"}])
    assert text == '{"role": "user", "content": "é <b> & \'q\'"}<|im_end|>'


def test_named_templates_use_default(tmp_path):
    named = [
        {"name": "tool_use", "template": "tools {{ messages | length }}"},
        {"name": "default", "template": "default {{ messages | length }}"},
    ]
    tok = load_tokenizer(str(write_tokenizer(tmp_path, chatml_config(named))), vocab_size=1024)
    assert tok.apply_chat_template(MESSAGES) == "default 4"


def test_template_errors(tmp_path):
    no_template = load_tokenizer(str(write_tokenizer(tmp_path / "a", {})), vocab_size=1024)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template(MESSAGES)
    # The sandbox refuses to mutate the messages it was given.
    mutating = chatml_config("{{ messages.append(1) }}")
    tok = load_tokenizer(str(write_tokenizer(tmp_path / "b", mutating)), vocab_size=1024)
    with pytest.raises(ChatTemplateError, match="unsafe"):
        tok.apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="does not parse"):
        load_tokenizer(str(write_tokenizer(tmp_path / "c", chatml_config("{% for %}"))), 1024)


@contextlib.contextmanager
def running_server(args: list[str], log_path):
    """``python -m serving.server`` with ``args`` on a free port; yields an httpx client."""
    import httpx

    from bench.local_server import LocalServer

    with LocalServer([*TINY_SERVER_ARGS, *args], log_path, env=tiny_server_env(),
                     start_timeout_s=300) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            yield client


@pytest.mark.slow
def test_server_without_template_refuses_chat_and_serves_completions(tmp_path):
    pytest.importorskip("fastapi")
    folder = write_tokenizer(tmp_path, {"eos_token": "</s>"})
    with running_server(["--tokenizer", str(folder)], tmp_path / "server.log") as client:
        chat = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]}
        )
        assert chat.status_code == 400
        error = chat.json()["error"]
        assert error["param"] == "messages" and "no chat template" in error["message"]
        completion = client.post(
            "/v1/completions",
            json={"prompt": "hello world", "max_tokens": 2, "temperature": 0},
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["prompt_tokens"] == 2
