"""Reads only what routing needs from a request body: ``model``, ``user``, ``cache_salt``,
``priority`` and the prompt as raw JSON (its first bytes for hashing affinity, all of it for block keys).

Two interchangeable parsers are kept so the benchmark can compare them: msgspec decodes into a
struct that names only these fields (everything else is skipped, prompts are kept as raw JSON
slices, never decoded), orjson decodes the whole document. Both reject malformed JSON, a body that
is not an object and a non-string ``model`` with a 400 in OpenAI's shape.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import orjson
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from vllm_stack.errors import RouterError
from vllm_stack.json_depth import too_deep, too_deep_message


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
    return RouterError(400, f"Request body: {too_deep_message()}", code="invalid_json")


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
        if too_deep(body):  # the router's own limit, the same for every part that reads JSON
            raise _too_deep()
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
        if too_deep(body):
            raise _too_deep()
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


#: Starlette's form limits (``Request.form()``'s defaults, which vLLM's form endpoints keep): past them the
#: engine refuses the form, so the router does too.
MAX_FORM_PARTS = 1000  # fields, and files, each
MAX_FIELD_BYTES = 1024 * 1024


class _FormFieldReader:
    """python-multipart callbacks that read one text field of a form as Starlette's ``MultiPartParser``
    (vLLM's form parser, through FastAPI) does: a part is a file when its Content-Disposition has a
    ``filename`` parameter, names are decoded with the form's charset, the last part of a name wins.
    File parts' data is neither decoded nor kept."""

    def __init__(self, name: str, charset: str) -> None:
        self.name = name
        self.charset = charset
        self.value: str | None = None
        self.is_file = False  # the last part of that name is a file
        self._fields = self._files = 0
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._disposition = b""
        self._wanted = False  # the current part is a text field of that name
        self._data = bytearray()

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self.on_part_begin,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
        }

    def on_part_begin(self) -> None:
        self._disposition = b""
        self._wanted = False
        self._data = bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_name = bytearray()
        self._header_value = bytearray()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise _bad_form('A multipart part\'s Content-Disposition has no "name".')
        named = _safe_decode(options[b"name"], self.charset) == self.name
        if b"filename" in options:
            self._files += 1
            if named:
                self.is_file, self.value = True, None
        else:
            self._fields += 1
            self._wanted = named
        if self._files > MAX_FORM_PARTS or self._fields > MAX_FORM_PARTS:
            raise _bad_form(f"A multipart body may have at most {MAX_FORM_PARTS} fields and files.")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._wanted:
            self._data += data[start:end]
            if len(self._data) > MAX_FIELD_BYTES:
                raise _bad_form(f"A multipart field is longer than {MAX_FIELD_BYTES} bytes.")

    def on_part_end(self) -> None:
        if self._wanted:
            self.is_file, self.value = False, _safe_decode(self._data, self.charset)


def _safe_decode(data: bytes | bytearray, charset: str) -> str:
    try:
        return data.decode(charset)
    except (UnicodeDecodeError, LookupError):
        return data.decode("latin-1")


def _bad_form(message: str) -> RouterError:
    return RouterError(400, message, code="invalid_multipart")


def multipart_field(body: bytes, content_type: bytes, field: bytes) -> str | None:
    """The value of a small text field of a ``multipart/form-data`` body (e.g. ``model`` of a
    transcription), read exactly as the engine's form parser reads it (see :class:`_FormFieldReader`;
    the same library, python-multipart): None when absent or empty (FastAPI's rule for a form
    field), a 400 when that name's last part is a file or the form is malformed or past the limits.
    """
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise _bad_form("multipart body without a boundary")
    charset = params.get(b"charset", b"utf-8").decode("latin-1")
    try:
        charset = codecs.lookup(charset).name
    except LookupError:
        charset = "latin-1"
    reader = _FormFieldReader(field.decode("latin-1"), charset)
    try:
        parser = MultipartParser(boundary, reader.callbacks())
        parser.write(body)
        parser.finalize()
    except FormParserError:  # malformed, or a boundary past python-multipart's 256 characters
        raise _bad_form("Invalid multipart data.") from None
    if reader.is_file:
        raise RouterError(
            400, f"The form's {field.decode()!r} is a file, not a text field.", param=field.decode()
        )
    return reader.value or None
