"""Reads only what routing needs from a request body: ``model``, ``user``, ``cache_salt``,
``priority`` and the prompt as raw JSON (its first bytes for hashing affinity, all of it for block keys).

Two interchangeable parsers are kept so the benchmark can compare them: msgspec decodes into a
struct that names only these fields (everything else is skipped, prompts are kept as raw JSON
slices, never decoded), orjson decodes the whole document. Both reject malformed JSON, a body that
is not an object and a non-string ``model`` with a 400 in OpenAI's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import orjson

from vllm_stack.errors import RouterError


@dataclass(slots=True)
class RoutingFields:
    model: str | None
    user: str | None
    prefix: bytes | None  # first ``prefix_bytes`` of the raw prompt / messages / input JSON
    prompt: bytes | memoryview | None = None  # all of it, as sent (a view into the body: no copy)
    cache_salt: str | None = None
    priority: object = None  # vLLM's ``priority`` field as sent (checked by api.priority)


class BodyParser(Protocol):
    name: str

    def parse(self, body: bytes) -> RoutingFields: ...


class _Fields(msgspec.Struct):
    model: Any = None
    user: Any = None
    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()
    cache_salt: Any = None
    priority: Any = None


def _bad_json(exc: Exception) -> RouterError:
    return RouterError(400, f"Request body is not a valid JSON object: {exc}", code="invalid_json")


def _too_deep() -> RouterError:
    return RouterError(400, "Request body is nested too deeply.", code="invalid_json")


def _check_model(model: Any) -> str | None:
    if model is None or isinstance(model, str):
        return model
    raise RouterError(400, "'model' must be a string", param="model", code="invalid_model")


class MsgspecParser:
    name = "msgspec"

    def __init__(self, prefix_bytes: int = 256) -> None:
        self._decoder = msgspec.json.Decoder(_Fields)
        self._prefix_bytes = prefix_bytes

    def parse(self, body: bytes) -> RoutingFields:
        try:
            f = self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _bad_json(exc) from None
        except RecursionError:  # msgspec's depth limit, in any field (skipped ones too)
            raise _too_deep() from None
        raw = f.messages or f.prompt or f.input
        view = memoryview(raw) if raw else None  # no copy of the prompt
        prefix = bytes(view[: self._prefix_bytes]) if view is not None else None
        user = f.user if isinstance(f.user, str) else None
        salt = f.cache_salt
        if salt is not None and not isinstance(salt, str):
            salt = None
        return RoutingFields(_check_model(f.model), user, prefix, view, salt, f.priority)


class OrjsonParser:
    name = "orjson"

    def __init__(self, prefix_bytes: int = 256) -> None:
        self._prefix_bytes = prefix_bytes

    def parse(self, body: bytes) -> RoutingFields:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _bad_json(exc) from None
        except RecursionError:
            raise _too_deep() from None
        if not isinstance(doc, dict):
            raise _bad_json(ValueError("expected an object"))
        raw = doc.get("messages") or doc.get("prompt") or doc.get("input")
        try:
            prompt = orjson.dumps(raw) if raw else None
        except TypeError:  # orjson.JSONEncodeError: a prompt deeper than orjson writes
            raise _too_deep() from None
        prefix = prompt[: self._prefix_bytes] if prompt is not None else None
        user = doc.get("user")
        salt = doc.get("cache_salt")
        return RoutingFields(
            _check_model(doc.get("model")),
            user if isinstance(user, str) else None,
            prefix,
            prompt,
            salt if isinstance(salt, str) else None,
            doc.get("priority"),
        )


_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENCODER = msgspec.json.Encoder()


def with_top_level(body: bytes, key: str, value: object) -> bytes:
    """``body`` with its top-level ``key`` set to ``value``; every other value re-emitted as the client
    sent it, unparsed (a weighted name's target, the engine's ``priority``)."""
    try:
        doc = _TOP_LEVEL.decode(body)
    except msgspec.DecodeError as exc:
        raise RouterError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    doc[key] = msgspec.Raw(_ENCODER.encode(value))
    return _ENCODER.encode(doc)


def make_parser(name: str, prefix_bytes: int = 256) -> BodyParser:
    return OrjsonParser(prefix_bytes) if name == "orjson" else MsgspecParser(prefix_bytes)


def multipart_field(body: bytes, content_type: bytes, field: bytes) -> str | None:
    """The value of a small text field of a ``multipart/form-data`` body (e.g. ``model`` of a transcription).

    Only the field's own part is looked at; file parts are not decoded or copied.
    """
    boundary = None
    for param in content_type.split(b";")[1:]:
        key, _, value = param.strip().partition(b"=")
        if key.lower() == b"boundary":
            boundary = value.strip(b'"')
    if not boundary:
        raise RouterError(400, "multipart body without a boundary", code="invalid_multipart")
    delimiter = b"--" + boundary
    for part in body.split(delimiter):
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep:
            continue
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-disposition:") and (
                b'name="' + field + b'"' in line
                or b"name=" + field + b";" in line
                or line.endswith(b"name=" + field)
            ):
                try:
                    return value.removesuffix(b"\r\n").decode()
                except UnicodeDecodeError:
                    raise RouterError(400, f"multipart field {field.decode()!r} is not UTF-8") from None
    return None
