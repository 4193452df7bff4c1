"""production-stack's chart keys, enumerated from its `values.yaml` and `values.schema.json` (at the commit of
../shared/production-stack-chart/), and the differential check of one key: both charts rendered with and
without it, what production-stack's rendering changes compared field by field with ours.

Objects carry the same kind and name in both charts (tests/helm/test_production_stack_names.py), so a
field is compared at the same place after a normalisation that only removes how each chart happens to
write it: lists of named things (containers, env, ports, volumes) become maps by name, a container's
command line becomes its flags (`--flag value`, `--flag_x` read as `--flag-x`) and its positional words,
numbers are text.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.helm.chart import CHART, NAMESPACE, RELEASE, helm_path
from tests.shared_data import PS_CHART, require

ITEM = "[]"  # a list's items in a key path: servingEngineSpec.modelSpec[].name
# Blocks whose content is free-form (a map of labels, a Kubernetes object given as is): one key each.
FREE_FORM = {
    "labels",
    "annotations",
    "podAnnotations",
    "podLabels",
    "matchLabels",
    "additionalLabels",
    "nodeSelector",
    "pvcMatchLabels",
    "pvcLabels",
    "pvcAnnotations",
    "serviceAnnotations",
    "resources",
    "securityContext",
    "containerSecurityContext",
    "podSecurityContext",
    "affinity",
    "strategy",
    "behavior",
    "envFromSecret",
    "emptyDir",
    "fallback",
    "horizontalPodAutoscalerConfig",
    "scalingModifiers",
    "serviceMonitorSelector",
    "prometheusSpec",
    "prometheus",
    "configs",
    "httpGet",
    "exec",
    "tcpSocket",
    "grpc",
}


def _walk_schema(node: dict, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    if not isinstance(node, dict):
        return
    props = node.get("properties") or {}
    items = node.get("items") if isinstance(node.get("items"), dict) else {}
    if path and path[-1] in FREE_FORM:
        yield path
        return
    if props:
        for key, sub in props.items():
            yield from _walk_schema(sub, (*path, key))
    if items.get("properties"):
        yield from _walk_schema(items, (*path, ITEM))
    if not props and not items.get("properties"):
        yield path


def _walk_values(node, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    if path and path[-1] in FREE_FORM:
        yield path
    elif isinstance(node, dict) and node:
        for key, sub in node.items():
            yield from _walk_values(sub, (*path, key))
    elif (
        isinstance(node, list) and node and all(isinstance(x, dict) for x in node) and path[-1] != "triggers"
    ):
        for sub in node:
            yield from _walk_values(sub, (*path, ITEM))
    else:
        yield path


@functools.cache
def ps_defaults() -> dict:
    return yaml.safe_load((require(PS_CHART) / "values.yaml").read_text())


def _template_keys() -> set[tuple[str, ...]]:
    """Keys production-stack's templates read that its values.yaml and schema do not declare
    (servingEngineSpec.env, a model's pvcExistingClaimName, vllmConfig.prometheusMultiprocDir...)."""
    text = "\n".join(p.read_text() for p in sorted((PS_CHART / "templates").glob("*")) if p.is_file())
    text = re.sub(r"{{/\*.*?\*/}}", "", text, flags=re.S)  # comments name keys that do not exist
    top = set(ps_defaults())
    found = {
        tuple(m.group(1).rstrip(".").split(".")) for m in re.finditer(r"\.Values\.([A-Za-z0-9_.-]+)", text)
    }
    found |= {
        ("servingEngineSpec", "modelSpec", ITEM, *m.group(1).rstrip(".").split("."))
        for m in re.finditer(r"\$modelSpec\.([A-Za-z0-9_.]+)", text)
    }
    return {k for k in found if k[0] in top}


@functools.cache
def ps_keys() -> tuple[str, ...]:
    """Every key path of production-stack's chart: its schema's, its values.yaml's and those its templates
    read, the most specific of each (a path that is a prefix of another is a block, not a key), free-form
    blocks as one key. `pvcStorage` is a size and, as `pvcStorage.emptyDir`, a block: both are keys."""
    schema = json.loads((require(PS_CHART) / "values.schema.json").read_text())
    paths = set(_walk_schema(schema, ())) | set(_walk_values(ps_defaults(), ())) | _template_keys()
    paths = {p for p in paths if p and not any(part in FREE_FORM for part in p[:-1])}
    blocks = {p[:i] for p in paths for i in range(1, len(p))} - {
        ("servingEngineSpec", "modelSpec", ITEM, "pvcStorage")
    }
    return tuple(sorted(".".join(p) for p in paths - blocks))


def split(key: str) -> list[str]:
    return key.split(".")


# ---------------------------------------------------------------------------------------- rendering


def _template(chart: Path, values_text: str) -> tuple[int, str, str]:
    proc = subprocess.run(
        [str(helm_path("helm4")), "template", RELEASE, str(chart), "-n", NAMESPACE, "-f", "-"],
        input=values_text,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


@functools.cache
def _ps_render(values_text: str) -> list[dict] | None:
    rc, out, _ = _template(require(PS_CHART), values_text)
    return [d for d in yaml.safe_load_all(out) if d] if rc == 0 else None


def _our_release(values_text: str) -> tuple[int, list[dict], list[str], str]:
    """Ours as `helm install --dry-run=client` (the chart tests' own, cached): (rc, objects, deviation lines, stderr)."""
    from vllm_stack_dev.up.render import deviations_in

    from tests.helm.test_production_stack_files import _install_dry_run, manifest_and_notes

    rc, _, err = _install_dry_run(values_text)
    if rc != 0:
        return rc, [], [], err
    objs, notes = manifest_and_notes(json.loads(values_text))
    return 0, objs, deviations_in("\n".join(notes)), ""


def ps_render(values: dict) -> list[dict] | None:
    return _ps_render(json.dumps(values, sort_keys=True))


def our_release(values: dict) -> tuple[int, list[dict], list[str], str]:
    return _our_release(json.dumps(values, sort_keys=True))


# ------------------------------------------------------------------------------------- normalising


def _flags(argv: list[str]) -> dict[str, str]:
    """A command line as {flag: value}: `--x v`, `--x=v`, a bare `--x` is "", positional words as #0, #1..."""
    out: dict[str, str] = {}
    words = [str(w) for w in argv]
    i, n = 0, 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            name = name.replace("_", "-")
            if eq:
                out[name] = value
            elif i + 1 < len(words) and not words[i + 1].startswith("--"):
                out[name] = words[i + 1]
                i += 1
            else:
                out[name] = ""
        else:
            out[f"#{n}"] = word
            n += 1
        i += 1
    return out


def _pod(spec: dict) -> dict:
    """A pod spec with its containers, ports and volumes keyed by what they are, not by each chart's names."""
    out = {k: normal(v, k) for k, v in spec.items() if k not in ("containers", "initContainers", "volumes")}
    containers = spec.get("containers") or []
    mounts = {m["name"]: m["mountPath"] for c in containers[:1] for m in c.get("volumeMounts") or []}
    out["containers"] = {("main" if i == 0 else c["name"]): _container(c) for i, c in enumerate(containers)}
    if spec.get("initContainers"):
        out["initContainers"] = {c["name"]: _container(c) for c in spec["initContainers"]}
    out["volumes"] = {
        f"mount:{mounts[v['name']]}" if v["name"] in mounts else v["name"]: normal(
            {k: x for k, x in v.items() if k != "name"}
        )
        for v in spec.get("volumes") or []
    }
    return out


@functools.cache
def _router_flag_names() -> dict[str, str]:
    """production-stack's router flags this chart renders under another name (files/router-flags.yaml `as`)."""
    table = yaml.safe_load((CHART / "files" / "router-flags.yaml").read_text())
    return {flag: entry["as"] for flag, entry in table["productionStack"].items() if "as" in entry}


def _container(c: dict) -> dict:
    out = {
        k: normal(v, k) for k, v in c.items() if k not in ("command", "args", "ports", "volumeMounts", "name")
    }
    flags = _flags([*(c.get("command") or []), *(c.get("args") or [])])
    out["argv"] = {_router_flag_names().get(k, k): v for k, v in flags.items()}
    out["ports"] = {
        str(p["containerPort"]): normal({k: v for k, v in p.items() if k != "name"})
        for p in c.get("ports") or []
    }
    out["volumeMounts"] = {
        m["mountPath"]: normal({k: v for k, v in m.items() if k not in ("name", "mountPath")})
        for m in c.get("volumeMounts") or []
    }
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe in out and isinstance(out[probe], dict):
            for kind in ("httpGet", "tcpSocket"):
                if isinstance(out[probe].get(kind), dict):
                    out[probe][kind].pop("port", None)  # each chart's own port name or number
    return out


def normal(value, key: str = ""):
    if key == "triggers" and isinstance(value, dict):  # production-stack renders one trigger as an object
        value = [value]
    if isinstance(value, dict):
        if key == "spec" and "containers" in value:
            return _pod(value)
        out = {k: normal(v, k) for k, v in value.items()}
        if key == "spec" and isinstance(value.get("ports"), list) and "selector" in value:  # a Service
            out["ports"] = {
                str(p.get("name", p["port"])): normal(
                    {k: v for k, v in p.items() if k not in ("name", "targetPort")}
                )
                for p in value["ports"]
            }
        return out
    if isinstance(value, list):
        if value and all(isinstance(v, dict) and "name" in v for v in value) and key not in ("triggers",):
            return {str(v["name"]): normal(v) for v in value}
        if value and all(isinstance(v, dict) for v in value):
            return {f"#{i}": normal(v) for i, v in enumerate(value)}
        return [normal(v) for v in value]
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    if value in ("True", "False"):  # LMCache reads booleans in any case
        return value.lower()
    return value


def leaves(value, path: tuple = ()) -> Iterator[tuple[tuple, object]]:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from leaves(v, (*path, k))
    else:
        yield path, value


def indexed(objs: list[dict]) -> dict[tuple, object]:
    """Every leaf of every object: ((kind, name), *field path) -> value, normalised."""
    out: dict[tuple, object] = {}
    for obj in objs:
        key = (obj["kind"], obj["metadata"]["name"])
        for path, value in leaves(normal(obj)):
            out[(key, *path)] = value
    return out


# ----------------------------------------------------------------------------------- one key's probe


@dataclass
class Probe:
    key: str
    base: dict  # the values without the key
    values: dict  # the same with the key set


def _set(values: dict, parts: list[str], value) -> None:
    node = values
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if part == ITEM:
            continue
        if nxt == ITEM:
            node = node.setdefault(part, [{}])[0]
        else:
            node = node.setdefault(part, {})
    node[parts[-1]] = value


def _get(values: dict, parts: list[str]):
    node = values
    for part in parts:
        if part == ITEM:
            if not isinstance(node, list) or not node:
                return None
            node = node[0]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


@functools.cache
def ps_schema() -> dict:
    return json.loads((require(PS_CHART) / "values.schema.json").read_text())


def schema_node(parts: list[str]) -> dict:
    node = ps_schema()
    for part in parts:
        if part == ITEM:
            node = node.get("items") or {}
        else:
            node = (node.get("properties") or {}).get(part) or {}
    return node


MODEL = {
    "name": "m",
    "repository": "vllm/vllm-openai",
    "tag": "v0.32.0",
    "modelURL": "org/m",
    "replicaCount": 1,
    "requestCPU": 4,
    "requestMemory": "16Gi",
    "requestGPU": 1,
}
# The switch that turns a block on, where it is not `enabled`.
SWITCHES = {
    "loraController": "enableLoraController",
    "routerSpec": "enableRouter",
    "servingEngineSpec": "enableEngine",
}


def base_for(key: str, extra: dict | None = None) -> dict:
    """Minimal values both charts render (one model), with every block above the key turned on, the
    `extra` settings a block needs to render at all (a key prefix -> [(path, value)]), and the lists on the
    key's path taken from production-stack's defaults (an ingress host entry, a route's matches)."""
    parts = split(key)
    values: dict = {"servingEngineSpec": {"modelSpec": [copy.deepcopy(MODEL)]}}
    if parts[0] == "loraAdapters":
        adapter = copy.deepcopy(ps_defaults()["loraAdapters"][0])
        adapter.update(enabled=True, baseModel="m")
        values["loraAdapters"] = [adapter]
    for i, part in enumerate(parts):
        if part == ITEM and _get(values, parts[:i]) is None:
            default = _get(ps_defaults(), parts[:i])
            _set(values, parts[:i], copy.deepcopy(default) if isinstance(default, list) and default else [{}])
    for prefix, settings in (extra or {}).items():
        if key == prefix or key.startswith(prefix + "."):
            for path, value in settings:
                _set(values, split(path), copy.deepcopy(value))
    for i in range(1, len(parts)):
        block = parts[:i]
        if block[-1] == ITEM:
            continue
        default = _get(ps_defaults(), block)
        switch = SWITCHES.get(block[-1], "enabled")
        if isinstance(default, dict) and switch in default and parts[i] != switch:
            _set(values, [*block, switch], True)
    return values


def _perturbed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str) and value:
        head = value.rstrip("KMGTPEkmi")
        return f"{int(head) + 1}{value[len(head) :]}" if head.isdigit() else value + "x"
    if isinstance(value, list) and value:
        return value + value[-1:]
    if isinstance(value, dict) and value:
        return {**value, "probe": "x"}
    return None


def probe_value(key: str, overrides: dict):
    if key in overrides:
        return overrides[key]
    parts = split(key)
    default = _get(ps_defaults(), parts)
    node = schema_node(parts)
    if parts[-1] == "enabled":
        return not default if isinstance(default, bool) else True
    enum = node.get("enum")
    if enum:
        others = [e for e in enum if e != default]
        return others[0] if others else enum[0]
    if default not in (None, "", [], {}):
        changed = _perturbed(default)
        if changed is not None:
            return changed
    kind = node.get("type")
    kind = kind[0] if isinstance(kind, list) else kind
    return {
        "string": "probe",
        "integer": 3,
        "number": 3,
        "boolean": True,
        "array": ["probe"],
        "object": {"probe": "x"},
    }.get(kind, "probe")


def _delete(values: dict, parts: list[str]) -> None:
    node = _get(values, parts[:-1])
    if isinstance(node, dict):
        node.pop(parts[-1], None)


def probe(key: str, overrides: dict, extra: dict | None = None) -> Probe:
    base = base_for(key, extra)
    _delete(base, split(key))
    values = copy.deepcopy(base)
    _set(values, split(key), probe_value(key, overrides))
    return Probe(key, base, values)


@dataclass
class Verdict:
    key: str
    outcome: str  # honoured | noted | refused | ps-refuses | schema-error | different
    detail: str = ""


def names_key(text: str, key: str) -> bool:
    """A message names the key: its leaf, or a block above it (raySpec for raySpec.headNode.requestCPU)."""
    parts = [p for p in split(key) if p != ITEM]
    return any(p in text for p in parts[1:] or parts)


def _noted(lines: list[str], key: str) -> bool:
    flat = key.replace(".[]", "[0]")
    paths = [p.strip() for line in lines for p in line.partition(": ")[0].split(", ")]
    return any(flat == p or flat.startswith(p + ".") or flat.startswith(p + "[") for p in paths)


def plain_for(key: str) -> dict:
    """The values of base_for without the blocks it turned on: what says nothing about the key."""
    values: dict = {"servingEngineSpec": {"modelSpec": [copy.deepcopy(MODEL)]}}
    if split(key)[0] == "loraAdapters":
        values["loraAdapters"] = base_for(key)["loraAdapters"]
    return values


def ps_pair(p: Probe, extra: dict | None = None) -> tuple[list | None, list | None]:
    """production-stack's rendering without and with the probed key (None where its chart refuses).

    A key production-stack requires (requestCPU, repository) cannot be left out of the base: there the
    base keeps a value of its own, so that what the key changes is still seen."""
    theirs_base, theirs = ps_render(p.base), ps_render(p.values)
    if theirs_base is None and theirs is not None:
        base = base_for(p.key, extra)
        if _get(base, split(p.key)) not in (None, _get(p.values, split(p.key))):
            theirs_base = ps_render(base)
    return theirs_base, theirs


def judge(key: str, overrides: dict, equivalent: dict, extra: dict | None = None) -> Verdict:
    p = probe(key, overrides, extra)
    rc, objs, lines, err = our_release(p.values)
    if rc != 0:
        if "schema" in err or "additional properties" in err.lower():
            return Verdict(key, "schema-error", err.strip().splitlines()[-1][:300])
        if names_key(err, key):
            return Verdict(key, "refused", err.strip().splitlines()[-1][:300])
        return Verdict(key, "refused-unnamed", err.strip()[:300])
    said = set(our_release(plain_for(key))[2])
    new = [line for line in lines if line not in said]
    if _noted(new, key):
        return Verdict(key, "noted", next(line for line in new if _noted([line], key))[:300])
    theirs_base, theirs = ps_pair(p, extra)
    if theirs is None or theirs_base is None:
        return Verdict(key, "ps-refuses", "production-stack's chart does not render the probe")
    before, after = indexed(theirs_base), indexed(theirs)
    ours = indexed(objs)
    changed = {  # an empty list or map (production-stack's `volumeMounts:` with nothing under it) says nothing
        path: v for path, v in after.items() if before.get(path, "<absent>") != v and v not in ({}, [])
    }
    # what production-stack's rendering drops for the key (a block switched off) must be gone from ours too
    gone = {path: "<absent>" for path in before if path not in after and path[0] in {k[0] for k in after}}
    missing = {
        path: v
        for path, v in {**changed, **gone}.items()
        if ours.get(path, "<absent>") != v and not any(_matches(path, pattern) for pattern in equivalent)
    }
    if missing:
        return Verdict(
            key,
            "different",
            "; ".join(
                f"{field(k)} = {v!r} (ours {ours.get(k, '<absent>')!r})" for k, v in list(missing.items())[:4]
            ),
        )
    return Verdict(key, "honoured", f"{len(changed) + len(gone)} field(s) compared")


def field(path: tuple) -> str:
    """A changed field as one line: Kind/name/field/..."""
    (kind, name), *rest = path
    return "/".join([kind, name, *map(str, rest)])


def _matches(path: tuple, pattern: str) -> bool:
    return pattern in field(path)
