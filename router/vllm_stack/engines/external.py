"""External OpenAI-compatible providers, in production-stack's ``--external-providers-config`` format.

Each provider becomes one engine of the ``openai`` kind (:mod:`vllm_stack.engines.kinds.openai`) at its
``api_base``, serving the models the file names (ids and aliases), so the router's scheduling, retries,
timeouts, queue, metrics and tracing apply to it as to a local engine. What differs is carried here:
the key (read once, at start, from the environment variable the file names, so it lives in a Secret
and never in the file), the headers sent with every request (the key replaces the client's
``Authorization``), the model an alias stands for, and the TLS context.

The key is never logged and never shown: :class:`ExternalProvider` keeps it out of its ``repr``, and
only :attr:`ExternalProvider.head_lines` and :meth:`ExternalProvider.control_headers` carry it.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

from vllm_stack.config import ConfigError

#: production-stack's provider types; each is an engine kind of the same name.
PROVIDER_TYPES = ("openai",)
#: production-stack's default key variable of an ``openai`` provider with no ``api_key_env_var``.
DEFAULT_KEY_VARIABLE = "OPENAI_API_KEY"
ENGINE_PREFIX = "external:"  # an external engine's name: ENGINE_PREFIX + provider name (a bounded label)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_KEYS = {"name", "type", "api_base", "api_key_env_var", "timeout", "max_retries", "custom_headers", "models"}
_OURS = {"ca_file"}  # keys production-stack's file does not have


@dataclass(frozen=True)
class ExternalProvider:
    """One provider: where it is, its models (alias -> id), and what every request to it carries."""

    name: str
    api_base: str
    models: Mapping[str, str]  # every routable name (ids and aliases) -> the id the provider knows
    owned_by: str
    key: str | None = field(default=None, repr=False)
    custom_headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    ca_file: str | None = None
    timeout: float = 30.0  # accepted from production-stack's file; the router's own timeouts apply
    max_retries: int = 3  # accepted likewise; the router's --retries applies

    @property
    def engine_name(self) -> str:
        return ENGINE_PREFIX + self.name

    @property
    def aliases(self) -> dict[str, str]:
        """Names that are not the provider's own ids: alias -> id (the body's ``model`` is rewritten)."""
        return {name: model for name, model in self.models.items() if name != model}

    def control_headers(self) -> dict[str, str]:
        """Headers of the router's own calls to the provider (its ``/v1/models`` health probe)."""
        headers = dict(self.custom_headers)
        if self.key:
            headers["authorization"] = "Bearer " + self.key
        return headers

    @property
    def head_lines(self) -> bytes:
        """The header lines every proxied request to the provider carries (after the client's own
        ``Authorization`` and ``x-api-key`` were dropped, as they are for every engine)."""
        return b"".join(
            name.encode("latin-1") + b": " + value.encode("latin-1") + b"\r\n"
            for name, value in self.control_headers().items()
        )

    def tls(self, default_ca_file: str | None) -> ssl.SSLContext:
        """Its TLS context: verified against its ``ca_file``, else ``default_ca_file``, else the system's;
        ``ConfigError`` naming the provider and the file when that cannot be read."""
        cafile = self.ca_file or default_ca_file
        try:
            return ssl.create_default_context(cafile=cafile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"external provider {self.name!r}: CA bundle {cafile}: {exc}") from None


def _text(doc: Mapping[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: '{key}' must be a non-empty string")
    return value


def _models(docs: Any, where: str) -> dict[str, str]:  # noqa: ANN401 - YAML
    if not isinstance(docs, list) or not docs:
        raise ConfigError(f"{where}: 'models' must be a non-empty list of {{id, type, aliases}}")
    names: dict[str, str] = {}
    for doc in docs:
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: each model is a mapping with an 'id'")
        model = _text(doc, "id", where)
        aliases = doc.get("aliases") or []
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise ConfigError(f"{where}: model {model!r}: 'aliases' must be a list of names")
        for name in (model, *aliases):
            if names.get(name, model) != model:
                raise ConfigError(f"{where}: {name!r} names two models")
            names[name] = model
    return names


def _provider(doc: Any, index: int, environ: Mapping[str, str]) -> ExternalProvider:  # noqa: ANN401 - YAML
    where = f"external_providers[{index}]"
    if not isinstance(doc, dict):
        raise ConfigError(f"{where} must be a mapping")
    unknown = set(doc) - _KEYS - _OURS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    name = _text(doc, "name", where)
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: name {name!r} must be letters, digits, '.', '_' or '-'")
    where = f"external provider {name!r}"
    kind = _text(doc, "type", where)
    if kind not in PROVIDER_TYPES:
        raise ConfigError(f"{where}: type {kind!r} is not one of {PROVIDER_TYPES}")
    api_base = _text(doc, "api_base", where).rstrip("/")
    parts = urlsplit(api_base)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"{where}: api_base must be an http(s):// URL without query")
    variable = doc.get("api_key_env_var") or DEFAULT_KEY_VARIABLE
    # a Secret written with a trailing newline is the common case: surrounding whitespace is taken away;
    # a control character inside would make every header fail (aiohttp refuses it), so it is refused now,
    # naming the variable, never the key
    key = (environ.get(variable) or "").strip() or None
    if key is not None and any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise ConfigError(f"{where}: the key in {variable} has a control character (a line break?) inside")
    if doc.get("api_key_env_var") and key is None:
        # production-stack refuses to start without the key it was told to read; so does the router
        raise ConfigError(f"{where}: its key variable {variable} is not set")
    headers = doc.get("custom_headers") or {}
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and _HEADER.fullmatch(k) and isinstance(v, str) and "\n" not in v and "\r" not in v
        for k, v in headers.items()
    ):
        raise ConfigError(f"{where}: custom_headers must map header names to one-line values")
    if any(k.lower() in ("authorization", "host", "content-length") for k in headers):
        raise ConfigError(f"{where}: custom_headers may not set authorization, host or content-length")
    timeout, retries = doc.get("timeout", 30.0), doc.get("max_retries", 3)
    if not isinstance(timeout, int | float) or timeout <= 0 or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"{where}: timeout must be > 0 and max_retries >= 0")
    ca_file = doc.get("ca_file")
    if ca_file is not None and (not isinstance(ca_file, str) or not ca_file):
        raise ConfigError(f"{where}: ca_file must be a path")
    return ExternalProvider(
        name,
        api_base,
        _models(doc.get("models"), where),
        owned_by=name,
        key=key,
        custom_headers={k.lower(): v for k, v in headers.items()},
        ca_file=ca_file,
        timeout=float(timeout),
        max_retries=retries,
    )


def parse_providers(doc: Any, environ: Mapping[str, str]) -> tuple[ExternalProvider, ...]:  # noqa: ANN401
    """The providers of a parsed ``--external-providers-config`` document; ``ConfigError`` naming the
    provider and key when one cannot work (a model named by two providers, a key variable unset)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("external_providers", []), list):
        raise ConfigError("the external providers file must be a mapping with an 'external_providers' list")
    providers = tuple(_provider(p, i, environ) for i, p in enumerate(doc.get("external_providers") or []))
    owner: dict[str, str] = {}
    for provider in providers:
        for name in provider.models:
            if name in owner:
                raise ConfigError(
                    f"model {name!r} is named by external providers {owner[name]!r} and {provider.name!r}"
                )
            owner[name] = provider.name
    seen: set[str] = set()
    for provider in providers:
        if provider.name in seen or provider.api_base in seen:
            raise ConfigError(f"external provider {provider.name!r}: its name or api_base is used twice")
        seen |= {provider.name, provider.api_base}
    return providers


def load_providers(path: str, environ: Mapping[str, str]) -> tuple[ExternalProvider, ...]:
    """:func:`parse_providers` of the YAML file at ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"external providers file {path}: {exc}") from None
    return parse_providers(doc if doc is not None else {}, environ)


class ExternalProviders:
    """The providers of one router, looked up by engine URL (control calls) and by model (aliases)."""

    def __init__(self, providers: tuple[ExternalProvider, ...], default_ca_file: str | None = None) -> None:
        self.providers = providers
        self.by_url = {p.api_base: p for p in providers}
        self.tls = {p.api_base: p.tls(default_ca_file) for p in providers if p.api_base.startswith("https:")}
        #: alias -> the provider's id, for every alias (empty: nothing to rewrite on the request path)
        self.aliases: dict[str, str] = {a: m for p in providers for a, m in p.aliases.items()}
        #: every model name an external provider serves (its requests carry the provider's key, not the engines')
        self.models: frozenset[str] = frozenset(name for p in providers for name in p.models)

    def static_models(self) -> dict[str, tuple[str, ...]]:
        """Engine URL -> the names it serves, as ``--static-models`` gives them for local engines."""
        return {p.api_base: tuple(p.models) for p in self.providers}
