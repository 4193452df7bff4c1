"""The CEL rules of a CRD (`x-kubernetes-validations`), evaluated as the API server would on create.

cel-python (PyPI `cel-python`, import `celpy`) compiles every rule of the CRDs in ../shared/crds/; a rule it
cannot compile is an error, never skipped. Before the rules run, schema defaults are applied (the API server
defaults first: HTTPRoute `matches` and `path` come from defaults). Transition rules (those naming `oldSelf`)
only run on update and are not evaluated here.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import celpy
import yaml

from tests.helm.chart import CRDS
from tests.shared_data import require


@dataclass(frozen=True)
class Rule:
    rule: str
    message: str
    program: object


_PROGRAMS: dict[str, object] = {}


def _compile(env: celpy.Environment, rule: dict) -> Rule:
    text = rule["rule"]
    if text not in _PROGRAMS:  # CRD versions repeat their rules; compile each text once
        try:
            _PROGRAMS[text] = env.program(env.compile(text))
        except Exception as exc:  # celpy raises its own CELParseError / CELSyntaxError
            raise AssertionError(f"cel-python cannot compile the CRD rule {text!r}: {exc}") from None
    return Rule(text, rule.get("message", text), _PROGRAMS[text])


def _compile_schema(env: celpy.Environment, node):
    """The schema with every x-kubernetes-validations entry compiled (in place, under `_cel`)."""
    if isinstance(node, dict):
        node["_cel"] = [
            _compile(env, r) for r in node.get("x-kubernetes-validations", []) if "oldSelf" not in r["rule"]
        ]
        for key in ("properties", "patternProperties"):
            for sub in node.get(key, {}).values():
                _compile_schema(env, sub)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                _compile_schema(env, node[key])
    return node


@functools.cache
def crd_rules() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the version's openAPIV3Schema with compiled rules."""
    env = celpy.Environment()
    out = {}
    for path in sorted(require(CRDS).glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
            out[(f"{group}/{version['name']}", kind)] = _compile_schema(env, schema)
    return out


def rule_count() -> int:
    def count(node) -> int:
        if not isinstance(node, dict):
            return 0
        n = len(node.get("_cel", []))
        for key in ("properties", "patternProperties"):
            n += sum(count(s) for s in node.get(key, {}).values())
        for key in ("items", "additionalProperties"):
            n += count(node.get(key))
        return n

    return sum(count(s) for s in crd_rules().values())


def _default(value, schema):
    """API-server defaulting: absent properties with a schema `default` get it, recursively."""
    if isinstance(value, dict) and isinstance(schema, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _default(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in schema.get("properties", {}):
                    value[key] = _default(value[key], extra)
    elif isinstance(value, list) and isinstance(schema, dict) and isinstance(schema.get("items"), dict):
        value = [_default(v, schema["items"]) for v in value]
    return value


def _check(value, schema, path: str, errors: list[str]) -> None:
    if not isinstance(schema, dict):
        return
    for rule in schema.get("_cel", []):
        try:
            ok = rule.program.evaluate({"self": celpy.json_to_cel(value)})
        except Exception as exc:
            errors.append(f"{path}: rule {rule.rule!r} could not be evaluated: {exc}")
            continue
        if isinstance(ok, celpy.CELEvalError) or not bool(ok):
            errors.append(f"{path}: {rule.message} (rule {rule.rule!r})")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if key in props:
                _check(sub, props[key], f"{path}.{key}", errors)
            elif isinstance(extra, dict):
                _check(sub, extra, f"{path}.{key}", errors)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]", errors)


def violations(obj: dict) -> list[str]:
    """The CEL rules `obj` breaks (empty when it passes); KeyError when its kind has no CRD here."""
    schema = crd_rules()[(obj["apiVersion"], obj["kind"])]
    value = _default(copy.deepcopy(obj), schema)
    errors: list[str] = []
    _check(value, schema, obj["kind"], errors)
    return errors
