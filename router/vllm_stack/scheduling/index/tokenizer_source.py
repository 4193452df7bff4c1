"""Where prefix routing's tokenizers come from: a directory, or a Hugging Face Hub repository.

Locally the model's directory is known (``--tokenizers model=DIR``). Under Kubernetes the engines
usually load a Hub model the router's pod does not have, and a vLLM engine serves no vocabulary
(``/tokenizer_info`` has the template and settings only), so the router fetches the model's tokenizer
files itself: ``--tokenizers model=hf:ORG/NAME[@REVISION]`` downloads ``tokenizer.json``,
``tokenizer_config.json`` and, when the repository has one, ``chat_template.jinja`` (a few MB, not
the weights) from ``$HF_ENDPOINT`` (default ``https://huggingface.co``; a mirror works) with
``$HF_TOKEN`` for gated models (the chart passes the engines' token Secret), into a cache directory
(``$VLLM_STACK_CACHE_DIR/tokenizers``, default ``~/.cache/vllm-stack/tokenizers``).

The download runs in the background, started by the first request that needs it: until it is done
that model is routed in character mode, so a slow or unreachable Hub never delays serving. A failed
download is retried after :data:`RETRY_SECONDS`. A file larger than :data:`MAX_FILE_BYTES` is refused,
so a wrong repository cannot fill the disk or memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import aiohttp

from vllm_stack.config import ConfigError

log = logging.getLogger(__name__)

HUB_SCHEME = "hf:"
REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL_FILES = ("chat_template.jinja",)
MAX_FILE_BYTES = 64 << 20
RETRY_SECONDS = 60.0
DEFAULT_ENDPOINT = "https://huggingface.co"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub(spec: str) -> bool:
    return spec.startswith(HUB_SCHEME)


def parse_hub(spec: str) -> tuple[str, str]:
    """``hf:ORG/NAME[@REVISION]`` -> (repository, revision); ConfigError when malformed."""
    repo, _, revision = spec[len(HUB_SCHEME) :].partition("@")
    if not _REPO.match(repo) or ".." in repo or (revision and not re.match(r"^[\w.-]+$", revision)):
        raise ConfigError(f"tokenizer {spec!r}: expected hf:ORG/NAME or hf:ORG/NAME@REVISION")
    return repo, revision or "main"


def default_cache_dir() -> Path:
    configured = os.environ.get("VLLM_STACK_CACHE_DIR")
    return (Path(configured) if configured else Path.home() / ".cache" / "vllm-stack") / "tokenizers"


class HubTokenizer:
    """One Hub repository's tokenizer, downloaded once in the background; :meth:`ready` is non-blocking."""

    def __init__(self, spec: str, cache_dir: Path | None = None) -> None:
        self.repo, self.revision = parse_hub(spec)
        self.spec = spec
        self.directory = (cache_dir or default_cache_dir()) / self.repo.replace("/", "--") / self.revision
        self.tokenizer: Any = None  # a ChatTokenizer once loaded
        self.error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._retry_at = 0.0

    def ready(self) -> Any:  # noqa: ANN401 - a ChatTokenizer, or None while it is being fetched
        """The tokenizer if loaded; otherwise start (or retry) the download and return None."""
        if self.tokenizer is not None:
            return self.tokenizer
        task = self._task
        if (task is None or task.done()) and time.monotonic() >= self._retry_at:
            self._task = asyncio.get_running_loop().create_task(self._load())
        return None

    async def _load(self) -> None:
        from vllm_stack.scheduling.index.tokens import ChatTokenizer

        try:
            if not all((self.directory / f).is_file() for f in REQUIRED_FILES):
                await self._download()
            self.tokenizer = await asyncio.get_running_loop().run_in_executor(
                None, ChatTokenizer, self.directory
            )
            self.error = None
            log.info("tokenizer of %s loaded from %s", self.repo, self.directory)
        except Exception as exc:  # noqa: BLE001 - the Hub unreachable, a gated repo, a bad file
            self.error = str(exc)
            self._retry_at = time.monotonic() + RETRY_SECONDS
            log.warning("tokenizer of %s not available (character blocks meanwhile): %s", self.repo, exc)

    async def _download(self) -> None:
        endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
        token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.directory.mkdir(parents=True, exist_ok=True)
        timeout = aiohttp.ClientTimeout(total=120, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            for name in (*REQUIRED_FILES, *OPTIONAL_FILES):
                url = f"{endpoint}/{self.repo}/resolve/{self.revision}/{name}"
                async with session.get(url) as resp:
                    if resp.status == 404 and name in OPTIONAL_FILES:
                        continue
                    if resp.status != 200:
                        raise RuntimeError(f"GET {url}: HTTP {resp.status}")
                    data = bytearray()
                    async for chunk in resp.content.iter_chunked(1 << 16):
                        data += chunk
                        if len(data) > MAX_FILE_BYTES:
                            raise RuntimeError(f"{url}: larger than {MAX_FILE_BYTES} bytes")
                partial = self.directory / (name + ".partial")
                partial.write_bytes(data)
                partial.replace(self.directory / name)  # complete files only, even if interrupted

    def describe(self) -> dict[str, Any]:
        if self.tokenizer is not None:
            state = "loaded"
        elif self.error:
            state = "failed"
        else:
            state = "fetching" if self._task is not None else "not requested yet"
        return {"source": self.spec, "state": state, **({"error": self.error} if self.error else {})}
