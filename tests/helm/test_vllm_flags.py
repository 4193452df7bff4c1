"""helm/files/vllm-flags.yaml, the first vLLM release that parses each engine flag the chart can render
(derived from vLLM's parsers by router/vllm_stack_dev/vllm_flags.py): every flag an engine container gets, from
this chart or production-stack's, is in it, and every production-stack file's engines get only flags their
pinned vLLM parses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from tests.helm.chart import CHART, file_id, render, run_helm, values_file, values_files
from tests.shared_data import PS_CHART, PS_VALUES, require

pytestmark = pytest.mark.helm

TABLE_PATH = CHART / "files" / "vllm-flags.yaml"
TABLE = yaml.safe_load(TABLE_PATH.read_text())
OUTCOMES = yaml.safe_load((Path(__file__).parent / "data" / "production_stack_outcomes.yaml").read_text())
PS_RENDERING = sorted(name for name, outcome in OUTCOMES.items() if outcome == "renders")


def newest() -> Version:
    return Version(TABLE["releases"]["newest"])


def vllm_version(image: str) -> Version | None:
    """The vLLM an engine image runs, where its tag says so: vllm/vllm-openai:vX.Y.Z (any registry). Other
    images (lmcache/vllm-openai tags are LMCache versions; latest, nightlies, rocm/vllm) are unknown: None."""
    m = re.search(r"(?:^|/)vllm/vllm-openai:v?(\d+\.\d+\.\d+)(?:\.post\d+|\.\d+)?$", image)
    return Version(m.group(1)) if m else None


def parses(flag: str, version: Version | None) -> bool:
    """Whether that vLLM (None: an unknown one, counted as the newest the table read) parses the flag."""
    entry = TABLE["flags"].get(flag)
    if entry is None:
        return False
    v = version or newest()
    return Version(entry["since"]) <= v and ("until" not in entry or v <= Version(entry["until"]))


def flags_in(tokens: list) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if isinstance(t, str) and t.startswith("--")]


def engine_containers(objs: list[dict]) -> list[dict]:
    """The vLLM containers (named vllm, in this chart and in production-stack's) of every Deployment."""
    return [
        c
        for o in objs
        if o.get("kind") == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
        if c["name"] == "vllm"
    ]


def engine_flags(objs: list[dict]) -> set[str]:
    """Flags of every engine container, and of engine start scripts (production-stack's RayCluster engines
    run `vllm serve` from a ConfigMap script)."""
    out = {f for c in engine_containers(objs) for f in flags_in([*c.get("command", []), *c.get("args", [])])}
    for o in objs:
        if o.get("kind") == "ConfigMap":
            for text in (o.get("data") or {}).values():
                if '"vllm"' in text and '"serve"' in text:
                    out.update(re.findall(r'"(--[a-z][a-z0-9_-]*)"', text))
    return out


# --- the table -------------------------------------------------------------------------------------------


def test_the_table_names_its_source_and_is_well_formed():
    header = TABLE_PATH.read_text().split("\nflags:", 1)[0]
    assert "github.com/vllm-project/vllm" in header and "router/vllm_stack_dev/vllm_flags.py" in header
    assert "vllm/engine/arg_utils.py" in header and "release" in header
    assert list(TABLE["flags"]) == sorted(TABLE["flags"]) and list(TABLE["env"]) == sorted(TABLE["env"])
    three = re.compile(r"\d+\.\d+\.\d+")
    assert three.fullmatch(TABLE["releases"]["oldest"]) and three.fullmatch(TABLE["releases"]["newest"])
    for name, entry in [*TABLE["flags"].items(), *TABLE["env"].items()]:
        assert set(entry) <= {"since", "until", "note"}, name
        assert all(
            isinstance(entry[k], str) and three.fullmatch(entry[k]) for k in ("since", "until") if k in entry
        )
        assert (
            Version(TABLE["releases"]["oldest"])
            <= Version(entry["since"])
            <= Version(entry.get("until", TABLE["releases"]["newest"]))
            <= newest()
        ), name
    assert all(f.startswith("--") for f in TABLE["flags"])
    assert all(e.startswith(("VLLM_", "PROMETHEUS_")) for e in TABLE["env"])


def test_the_table_covers_the_chart_default_engine_image():
    """The default image's vLLM is not newer than the newest release the table was derived from."""
    (c,) = engine_containers(
        render(sets=['json:servingEngineSpec.modelSpec=[{"name": "m", "modelURL": "org/m"}]'])
    )
    assert vllm_version(c["image"]) is not None and vllm_version(c["image"]) <= newest(), c["image"]


def test_image_tags_name_their_vllm_only_for_vllm_images():
    assert vllm_version("vllm/vllm-openai:v0.8.5") == Version("0.8.5")
    assert vllm_version("docker.io/vllm/vllm-openai:v0.10.1.1") == Version("0.10.1")
    assert vllm_version("vllm/vllm-openai:v0.8.5.post1") == Version("0.8.5")
    for unknown in ("vllm/vllm-openai:latest", "lmcache/vllm-openai:v0.3.9post2", "rocm/vllm:instinct_main"):
        assert vllm_version(unknown) is None
    assert not parses("--kv-events-config", Version("0.8.5")) and parses("--kv-events-config", None)
    assert parses("--gpu_memory_utilization", Version("0.6.0")) and not parses("--no-such-flag", None)


# --- (a) every flag the chart can render is in the table ---------------------------------------------------


def schema_values() -> list[dict]:
    """Two models that set every vllmConfig key of the chart's schema (booleans true in one, false in the
    other) and the model keys that add flags, with prefix-aware routing (KV events, prompt token details)
    and LMCache (the KV connector): what the chart can render beyond its example files."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    model = schema["properties"]["servingEngineSpec"]["properties"]["modelSpec"]["items"]["properties"]
    strings = {"convert": "auto", "quantization": "fp8", "kvCacheDtype": "auto", "servedModelName": "m"}
    out = []
    for polarity in (True, False):
        vc: dict = {}
        for key, prop in model["vllmConfig"]["properties"].items():
            if key == "extraArgs" or "does not implement" in prop.get("description", ""):
                continue
            kind = prop.get("type")
            if kind == "boolean":
                vc[key] = polarity
            elif kind == "integer":
                vc[key] = max(1, prop.get("minimum", 1))
            elif kind == "string":
                vc[key] = prop["enum"][0] if "enum" in prop else strings.get(key, "x")
            elif kind == "array":
                vc[key] = [{"name": "a", "path": "/adapters/a"}]
            else:
                vc[key] = 0.5
        out.append(
            {
                "routerSpec": {"routingLogic": "prefixaware"},
                "servingEngineSpec": {
                    "modelSpec": [
                        {
                            "name": "m",
                            "modelURL": "org/m",
                            "vllmConfig": vc,
                            "enableTool": True,
                            "toolCallParser": "hermes",
                            "chatTemplate": "/templates/chat.jinja",
                            "modelRevision": "main",
                            "schedulingPolicy": "priority",
                            "lmcacheConfig": {"enabled": True, "cpuOffloadingBufferSize": "1"},
                            "limitMemory": "16Gi",
                        }
                    ]
                },
            }
        )
    return out


def rendered_sources() -> list:
    return [
        *(pytest.param(p, id=file_id(p)) for p in values_files()),
        *(pytest.param(PS_VALUES / n, id=f"production-stack/{n}") for n in PS_RENDERING),
        *(
            pytest.param(v, id=f"schema-keys-{'on' if i == 0 else 'off'}")
            for i, v in enumerate(schema_values())
        ),
    ]


@pytest.mark.parametrize("source", rendered_sources())
def test_every_flag_the_chart_renders_is_in_the_table(source, tmp_path):
    if isinstance(source, dict):
        source = values_file(tmp_path, source)
    else:
        require(source)  # production-stack's files are in ../shared
    flags = engine_flags(render([source]))  # none for files without an enabled model
    missing = sorted(flags - set(TABLE["flags"]))
    assert not missing, (
        f"flags the chart renders that helm/files/vllm-flags.yaml lacks: {missing}; add them with "
        "`python -m vllm_stack_dev.vllm_flags --wheels DIR --add=--flag,...` (module docstring)"
    )


def template_flags() -> set[str]:
    """Every engine flag the engine template can write, read from its text rather than from a rendering:
    its quoted `"--flag"` words and the flags of its `range $key, $flag := dict ...` maps (written as
    `--<flag>`, and `--no-<flag>` where the map's values are switches, printf "--%s%s")."""
    text = (CHART / "templates" / "_engine.tpl").read_text()
    text = re.sub(r"{{-?\s*/\*.*?\*/\s*-?}}", "", text, flags=re.S)  # comments name other components' flags
    out = set(re.findall(r'"(--[a-z][a-z0-9-]*)"', text))
    for line in text.splitlines():
        m = re.search(r"range \$key, \$flag := dict ((?:\"[^\"]+\" ?)+)", line)
        if m:
            names = re.findall(r'"([^"]+)"', m.group(1))[1::2]
            switches = 'ternary "" "no-"' in text.split(line, 1)[1].split("{{- end -}}", 1)[0]
            out |= {f"--{n}" for n in names} | ({f"--no-{n}" for n in names} if switches else set())
    return out


def test_every_flag_the_engine_template_can_write_is_in_the_table():
    """Also the flags no values file here happens to render: the template's own text against the table."""
    flags = template_flags()
    assert {
        "--kv-events-config",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--revision",
    } <= flags
    missing = sorted(flags - set(TABLE["flags"]))
    assert not missing, (
        f"flags helm/templates/_engine.tpl can write that helm/files/vllm-flags.yaml lacks: {missing}"
    )


def test_the_schema_keys_reach_the_engine(tmp_path):
    """Guard for the test above: the synthetic models really render the mapped flags."""
    on, off = (
        engine_flags(render([values_file(tmp_path, v, f"{i}.yaml")])) for i, v in enumerate(schema_values())
    )
    assert {"--enable-prefix-caching", "--enforce-eager", "--kv-events-config", "--kv-transfer-config"} <= on
    assert {
        "--no-enable-prefix-caching",
        "--no-trust-remote-code",
        "--scheduling-policy",
        "--revision",
    } <= off


@pytest.mark.parametrize("name", sorted(OUTCOMES))
def test_production_stack_chart_flags_are_in_the_table(name):
    """What production-stack's own chart renders for its files (so the differential tests compare flags the
    table knows), RayCluster engine scripts included."""
    require(PS_CHART)
    proc = run_helm("helm4", "template", "ps", ".", "-f", str(require(PS_VALUES / name)), chart=PS_CHART)
    assert proc.returncode == 0, proc.stderr
    objs = [d for d in yaml.safe_load_all(proc.stdout) if isinstance(d, dict)]
    missing = sorted(engine_flags(objs) - set(TABLE["flags"]))
    assert not missing, f"production-stack's chart renders flags the table lacks: {missing}"


# --- (b) production-stack files: only flags the pinned vLLM parses ---------------------------------------


def unparsable(name: str) -> list[str]:
    """`image: flag` for every flag an engine of the file gets (its extraArgs and what this chart renders)
    that the vLLM of the image the file names cannot parse."""
    values = yaml.safe_load((PS_VALUES / name).read_text())
    extra: dict[str, list[str]] = {}
    for m in (values.get("servingEngineSpec") or {}).get("modelSpec") or []:
        extra.setdefault(m.get("modelURL"), []).extend(
            flags_in((m.get("vllmConfig") or {}).get("extraArgs") or [])
        )
    out = []
    for c in engine_containers(render([PS_VALUES / name])):
        version = vllm_version(c["image"])
        flags = {*flags_in(c.get("args", [])), *extra.get(c["args"][0], [])}
        out += [f"{c['image']}: {f}" for f in sorted(flags) if not parses(f, version)]
    return out


@pytest.mark.parametrize("name", PS_RENDERING)
def test_production_stack_engines_get_only_flags_their_vllm_parses(name):
    """Since the chart gates flags by the engine's vLLM release (issue 31), none: the V100 files'
    vllm/vllm-openai:v0.8.5 no longer gets prefixaware routing's --kv-events-config (it came with 0.9.0)."""
    require(PS_VALUES / name)
    assert unparsable(name) == []
