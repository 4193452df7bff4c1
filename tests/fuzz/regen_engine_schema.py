"""Regenerate ``tests/fuzz/engine_openapi.json``: the pinned engine's own OpenAPI schema, cut down to
the paths the router proxies (``ENDPOINTS.proxied``) and the components those paths reference.

The fuzz tests read the committed file, so the stub-engine pass needs no engine. Rerun this when the
pinned vLLM version changes (the file records the version it came from):

    PYTHONPATH=router .venv/bin/python tests/fuzz/regen_engine_schema.py            # starts a tiny engine
    PYTHONPATH=router .venv/bin/python tests/fuzz/regen_engine_schema.py --url http://127.0.0.1:8000

Without ``--url`` it builds the tiny test-bed model and starts, one after the other, a chat engine and
an embedding engine (``--runner pooling --convert embed``; the pooling endpoints only appear on such an
engine), about a minute and one core each, fetches each ``/openapi.json`` and stops the engine. The
schemas are merged. The audio endpoints need a speech model, which the test bed has none of; they are
listed in the file as not described.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from vllm_stack.endpoint_table import ENDPOINTS

OUT = Path(__file__).with_name("engine_openapi.json")


def _refs(node: Any) -> set[str]:
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                found.add(ref.rsplit("/", 1)[1])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def filter_schema(full: dict[str, Any], paths: frozenset[str] = ENDPOINTS.proxied) -> dict[str, Any]:
    """Only ``paths`` (POST operations, the ones the router forwards) and the schemas they reach."""
    kept_paths = {}
    for path, item in full.get("paths", {}).items():
        if path in paths and "post" in item:
            kept_paths[path] = {"post": item["post"]}
    all_schemas = full.get("components", {}).get("schemas", {})
    wanted: set[str] = set()
    todo = _refs(kept_paths)
    while todo:
        name = todo.pop()
        if name in wanted or name not in all_schemas:
            continue
        wanted.add(name)
        todo |= _refs(all_schemas[name])
    return {
        "openapi": full.get("openapi", "3.1.0"),
        "info": full.get("info", {}),
        "paths": dict(sorted(kept_paths.items())),
        "components": {"schemas": {k: all_schemas[k] for k in sorted(wanted)}},
    }


def fetch(url: str) -> tuple[dict[str, Any], str]:
    """The engine's schema and its version (``GET /version``)."""
    base = url.rstrip("/")
    with urllib.request.urlopen(base + "/openapi.json", timeout=30) as response:
        schema = json.load(response)
    with urllib.request.urlopen(base + "/version", timeout=30) as response:
        version = json.load(response).get("version", "unknown")
    return schema, version


def fetch_from_own_engines() -> list[tuple[dict[str, Any], str]]:
    from vllm_stack_dev.paths import cache_dir
    from vllm_stack_dev.testbed.engines import EngineSpec, launch, wait_ready
    from vllm_stack_dev.testbed.models import build_model

    model = build_model("tiny", cache_dir() / "models" / "tiny")
    specs = [
        EngineSpec(model, "tiny-llama", kv_events=False),
        EngineSpec(
            model, "tiny-embed", runner="pooling", convert="embed", enable_lora=False, kv_events=False
        ),
    ]
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-stack-schema-"))
    found = []
    for i, spec in enumerate(specs):  # one at a time: each takes a core for a minute
        engine = launch(spec, name=f"schema-{i}", cpu=None, log_dir=log_dir)
        try:
            wait_ready([engine], 420)
            found.append(fetch(engine.url))
        finally:
            engine.stop()
    return found


def merge(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """Paths and component schemas of several engines' schemas (the first one wins on a clash)."""
    merged: dict[str, Any] = {"openapi": schemas[0].get("openapi"), "info": schemas[0].get("info", {}),
                              "paths": {}, "components": {"schemas": {}}}  # fmt: skip
    for schema in schemas:
        for path, item in schema.get("paths", {}).items():
            merged["paths"].setdefault(path, item)
        for name, comp in schema.get("components", {}).get("schemas", {}).items():
            merged["components"]["schemas"].setdefault(name, comp)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", action="append", help="a running engine's base URL; repeatable (default: start two engines)"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    found = [fetch(url) for url in args.url] if args.url else fetch_from_own_engines()
    schema = filter_schema(merge([s for s, _ in found]))
    missing = sorted(ENDPOINTS.proxied - schema["paths"].keys())
    schema["x-vllm-stack"] = {
        "source": "GET /openapi.json of the pinned engine, filtered by tests/fuzz/regen_engine_schema.py",
        "engine_versions": sorted({v for _, v in found}),
        "proxied_paths_not_in_engine_schema": missing,
    }
    args.out.write_text(json.dumps(schema, indent=1, sort_keys=False) + "\n")
    print(f"wrote {args.out}: {len(schema['paths'])} paths, {len(schema['components']['schemas'])} schemas")
    if missing:
        print("proxied paths this engine does not describe:", ", ".join(missing))


if __name__ == "__main__":
    main()
