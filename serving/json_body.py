"""A request body parsed as JSON, with what Python's ``json`` lets through refused.

``json.loads`` accepts ``NaN`` and ``Infinity``, escapes that make lone surrogates
(``"\\ud800"``, a string no UTF-8 encoder or tokenizer takes), and nesting until the
interpreter's recursion limit. Every such body is answered 400 here, with the path of the
offending value as the error's ``param``, before any of it reaches a model or tokenizer.
"""

from __future__ import annotations

import json

import pydantic

from serving.api import APIError

MAX_JSON_DEPTH = 32  # a request body needs 5 (chat content parts); more is an attack


def parse_body[M: pydantic.BaseModel](raw: bytes, model: type[M]) -> M:
    """The body validated as ``model``; an APIError (400) naming the bad field if not."""
    data = parse_json_object(raw)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as error:
        raise validation_error(error) from None


def validation_error(error: pydantic.ValidationError) -> APIError:
    """The most specific of pydantic's errors, with union branch names left out of its
    location (``stop.0``, not ``stop.list[str].0``)."""
    first = max(error.errors(), key=lambda e: len(e["loc"]))
    loc = [part for part in first["loc"] if not _is_branch_name(part)]
    param = _param(tuple(loc))
    return APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value")


def _is_branch_name(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object.

    Raises:
      APIError: 400 for invalid JSON or UTF-8, a non-object, NaN or infinities, nesting
        deeper than ``MAX_JSON_DEPTH``, or a string that is not valid Unicode.
    """
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise _invalid(
            f"the body is not valid JSON: {error.msg} at character {error.pos}"
        ) from None
    except UnicodeDecodeError:
        raise _invalid("the body is not valid UTF-8") from None
    except RecursionError:
        raise _invalid(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as error:  # NaN / Infinity, or an integer of over 4300 digits
        raise _invalid(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise _invalid("the body must be a JSON object")
    check_values(data)
    return data


def check_values(data: dict | list) -> None:
    """Refuses nesting deeper than ``MAX_JSON_DEPTH`` and strings (keys included) that are
    not valid Unicode; iterative, so no depth exhausts the interpreter's stack."""
    pending: list[tuple[object, tuple, int]] = [(data, (), 1)]
    while pending:
        value, path, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise _invalid(f"the body nests deeper than {MAX_JSON_DEPTH} levels", path[:1])
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, path)
            if isinstance(item, str):
                _check_text(item, (*path, key))
            elif isinstance(item, dict | list):
                pending.append((item, (*path, key), depth + 1))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = f"U+{ord(text[error.start]):04X}"
        raise _invalid(
            f"{_param(path) or 'a key'}: not valid Unicode (a lone surrogate {bad} at "
            f"character {error.start})",
            path,
        ) from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _param(path: tuple) -> str | None:
    return ".".join(map(str, path)) or None


def _invalid(message: str, path: tuple = ()) -> APIError:
    code = "invalid_json" if not path else "invalid_value"
    return APIError(400, message, param=_param(path), code=code)
