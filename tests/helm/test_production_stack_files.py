"""production-stack's own values files (../shared/production-stack-values/, read in place): each renders
what it meant, or is refused with the chart's own reason, exactly as tests/helm/data/production_stack_outcomes.yaml
records; no production-stack key is dropped silently; engines get limits that hold what they pin; the router
is always this project's, with flags it knows."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    container,
    engine_name,
    env_of,
    find,
    flag,
    helm_path,
    one,
    router_name,
    values_file,
)
from tests.shared_data import PS_VALUES, require
from vllm_stack.router_cli import build_parser

pytestmark = pytest.mark.helm

PS_DIR = PS_VALUES
OUTCOMES = yaml.safe_load((Path(__file__).parent / "data" / "production_stack_outcomes.yaml").read_text())
HELMS = ["helm3", "helm4"]
NOTES_HEADER = (
    "Deviations: what this chart did differently from what the values ask (strict: true refuses each):"
)


def ps_files() -> list[Path]:
    return sorted(require(PS_DIR).glob("*.yaml"))


def rendering() -> list[str]:
    return [name for name, outcome in OUTCOMES.items() if outcome == "renders"]


def _helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm_path(helm)), *args], capture_output=True, text=True, timeout=120, cwd=CHART
    )


@functools.cache
def _install_dry_run(values_text: str) -> tuple[int, str, str]:
    """Helm 4 `install --dry-run=client`: the manifest and NOTES.txt (`helm template` prints no NOTES)."""
    proc = subprocess.run(
        [str(helm_path("helm4")), "install", RELEASE, ".", "--dry-run=client", "-n", NAMESPACE, "-f", "-"],
        input=values_text,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=CHART,
    )
    # The header's "LAST DEPLOYED: <time>" would make every two renders differ: drop it.
    out = "\n".join(line for line in proc.stdout.splitlines() if not line.startswith("LAST DEPLOYED:"))
    return proc.returncode, out, proc.stderr


def dry_run(values: dict) -> tuple[int, str, str]:
    return _install_dry_run(json.dumps(values, sort_keys=True))  # JSON is YAML, and much faster to write


def manifest_and_notes(values: dict) -> tuple[list[dict], list[str]]:
    rc, out, err = dry_run(values)
    assert rc == 0, err
    manifest, _, notes = out.partition("\nNOTES:\n")
    manifest = manifest.split("\nMANIFEST:\n", 1)[-1]
    objs = [d for d in yaml.safe_load_all(manifest.replace("\nHOOKS:\n", "\n---\n")) if isinstance(d, dict)]
    return objs, notes.splitlines()


def compat_lines(notes: list[str]) -> dict[tuple[str, ...], str]:
    """NOTES lines `  <path>[, <path>...]: <what was done>` below the production-stack header."""
    if NOTES_HEADER not in notes:
        return {}
    out = {}
    for line in notes[notes.index(NOTES_HEADER) + 1 :]:
        if not line.startswith("  "):
            break
        paths, _, text = line.strip().partition(": ")
        out[tuple(p.strip() for p in paths.split(", "))] = text
    return out


def names(lines: dict[tuple[str, ...], str], path: str) -> bool:
    """A NOTES line names `path` itself or one of the blocks above it."""
    return any(path == p or path.startswith(p + ".") or path.startswith(p + "[") for ps in lines for p in ps)


def load(name: str) -> dict:
    return yaml.safe_load(require(PS_DIR / name).read_text())


# --- the outcome table ------------------------------------------------------------------------------------


def test_the_table_lists_every_file():
    assert sorted(OUTCOMES) == [f.name for f in ps_files()]


@pytest.mark.parametrize("helm", HELMS)
def test_every_file_has_its_recorded_outcome(helm):
    """Each file renders or is refused with its recorded reason, never with a bare schema error."""
    wrong = {}
    for path in ps_files():
        proc = _helm(helm, "template", RELEASE, ".", "-n", NAMESPACE, "-f", str(path))
        want = OUTCOMES[path.name]
        if want == "renders":
            if proc.returncode != 0:
                wrong[path.name] = proc.stderr.strip()
        elif proc.returncode == 0:
            wrong[path.name] = "rendered, but the table says refused"
        elif want["refused"] not in proc.stderr or "schema" in proc.stderr:
            wrong[path.name] = proc.stderr.strip()
    assert not wrong, wrong


def test_refusals_are_only_features_not_shipped_or_not_built_yet():
    reasons = {o["refused"] for o in OUTCOMES.values() if o != "renders"}
    # Disaggregated prefill and kvaware left this list when they were implemented (tests/helm/test_disagg_values.py,
    # tests/helm/test_kvaware_values.py).
    features = ("raySpec", "LoRA operator")
    assert all(sum(f in r for f in features) == 1 for r in reasons), reasons
    assert all("; instead, " in r for r in reasons), reasons  # and what to use instead


def test_the_readme_shows_the_table():
    readme = " ".join((CHART / "README.md").read_text().split())
    n = len(rendering())
    assert f"{n} of the {len(OUTCOMES)} files render" in readme
    for name, outcome in OUTCOMES.items():
        assert f"`{name}`" in readme, name
        if outcome != "renders":
            assert f"| `{name}` | refused: {outcome['refused']} |" in readme, name  # the chart's message


def test_a_typo_in_a_production_stack_file_still_names_the_key(tmp_path):
    values = load("tutorials__values-18-prefix-aware.yaml")
    values["servingEngineSpec"]["modelSpec"][0]["replicaCont"] = 2
    for helm in HELMS:
        proc = _helm(helm, "template", RELEASE, ".", "-f", str(values_file(tmp_path, values)))
        assert proc.returncode != 0 and "replicaCont" in proc.stderr and "schema" in proc.stderr


# --- no silent drops ----------------------------------------------------------------------------------------


def leaves(value, steps: tuple = ()):
    """(steps, value) of each leaf; modelSpec entries are walked into, other lists are leaves."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from leaves(v, (*steps, k))
    elif isinstance(value, list) and value and steps and steps[-1] == "modelSpec":
        for i, v in enumerate(value):
            yield from leaves(v, (*steps, i))
    else:
        yield steps, value


def dotted(steps: tuple) -> str:
    """The path as NOTES writes it: servingEngineSpec.modelSpec[0].vllmConfig.v0."""
    out = ""
    for s in steps:
        out += f"[{s}]" if isinstance(s, int) else (f".{s}" if out else s)
    return out


def _parent(values, steps: tuple):
    node = values
    for step in steps[:-1]:
        node = node[step]
    return node, steps[-1]


def without(values: dict, steps: tuple) -> dict:
    out = copy.deepcopy(values)
    node, key = _parent(out, steps)
    del node[key]
    return out


def perturbed(values: dict, steps: tuple) -> dict | None:
    """The same values with this leaf changed, or None when there is no obvious other value."""
    out = copy.deepcopy(values)
    node, key = _parent(out, steps)
    v = node[key]
    if isinstance(v, bool):
        node[key] = not v
    elif isinstance(v, (int, float)):
        node[key] = v + 1
    elif isinstance(v, str) and v:
        head = v.rstrip("KMGTPEkmi")
        node[key] = f"{int(head) + 1}{v[len(head) :]}" if head.isdigit() else v + "x"
    elif isinstance(v, list) and v and isinstance(v[-1], dict) and "value" in v[-1]:
        node[key] = [
            *v[:-1],
            {**v[-1], "value": f"{v[-1]['value']}x"},
        ]  # env: one entry per name, so change one
    elif isinstance(v, list) and v:
        node[key] = v + v[-1:]
    else:
        return None
    return out


#: Blocks production-stack turns on by another key than `enabled`: the key, and a value that turns the
#: block on (its schema: "When otelEndpoint is set, tracing is automatically enabled").
_ON_SWITCHES = {"otel": ("endpoint", "otel-collector:4317")}


def _disabled_block(values: dict, steps: tuple) -> tuple | None:
    """The innermost block above the leaf that production-stack's `enabled: false` (or an empty switch
    of `_ON_SWITCHES`) turns off."""
    for i in range(len(steps) - 1, 0, -1):
        node, key = _parent(values, steps[:i])
        block = node[key]
        if not isinstance(block, dict) or isinstance(key, int):
            continue
        if block.get("enabled") is False or (key in _ON_SWITCHES and not block.get(_ON_SWITCHES[key][0])):
            return steps[:i]
    return None


def _enabled(values: dict, block: tuple) -> dict:
    out = copy.deepcopy(values)
    node, key = _parent(out, block)
    switch, on = _ON_SWITCHES.get(key, ("enabled", True))
    node[key][switch] = on
    return out


def _model_name(values: dict, steps: tuple):
    """The name of the modelSpec entry a leaf is in (None outside one)."""
    if len(steps) > 2 and steps[:2] == ("servingEngineSpec", "modelSpec") and isinstance(steps[2], int):
        return values["servingEngineSpec"]["modelSpec"][steps[2]].get("name")
    return None


def dropped(values: dict, steps: tuple, value) -> str | None:
    """Why the leaf counts as silently dropped, or None when rendering honours it or NOTES names it."""
    if value in ("", None) or (isinstance(value, (dict, list)) and not value):
        return None  # production-stack's empty defaults ("", {}, [], null) ask for nothing
    if steps[-1] == "enabled" and value is False:
        return None  # removing `enabled: false` turns the block on: checked below with its leaves
    if (
        len(steps) > 1
        and steps[-2] in ("labels", "podLabels")
        and steps[-1] == "model"
        and value == _model_name(values, steps)
    ):
        return None  # production-stack's `model` label, the selector's already (tests/helm/test_production_stack_names.py)
    base = dry_run(values)
    if base[0] == 0 and names(compat_lines(base[1].partition("\nNOTES:\n")[2].splitlines()), dotted(steps)):
        return None
    if dry_run(without(values, steps)) != base:
        return None
    other = perturbed(values, steps)
    if other is not None and dry_run(other) != base:
        return None  # the value happens to be the chart's default: honoured
    block = _disabled_block(values, steps)
    if block:
        on = _enabled(values, block)
        rc, _, err = dry_run(on)
        if rc != 0 and str(block[-1]) in err:
            return None  # turning the block on is refused with a reason naming it
        if rc == 0 and dry_run(without(on, steps)) != dry_run(on):
            return None
        if rc == 0 and other is not None and dry_run(perturbed(on, steps)) != dry_run(on):
            return None
    return "dropped"


def helm_values_enabled() -> dict:
    """production-stack's default values.yaml with its one model turned on (its defaults say `enabled:
    false`) and a memory limit that holds what it asks for: 30 GiB of LMCache buffer in each of its 2
    tensor-parallel workers + 20Gi /dev/shm + 4Gi (its own limitMemory, 32Gi, is refused with that sum), and
    2 GPUs for those 2 workers (its one GPU is refused)."""
    values = load("helm__values.yaml")
    m = values["servingEngineSpec"]["modelSpec"][0]
    m["enabled"] = True
    m["limitMemory"] = "84Gi"
    m["requestGPU"] = (
        2  # one per tensor-parallel worker: its 1 is refused (tests/helm/test_inconsistent_values.py)
    )
    return values


def test_renders_compare_equal_when_nothing_changed():
    """Guard for the next test: two renders of the same values are identical (no time stamps)."""
    values = load("tutorials__values-18-prefix-aware.yaml")
    first = dry_run(values)
    _install_dry_run.cache_clear()
    time.sleep(1.1)
    assert dry_run(values) == first


@pytest.mark.parametrize("name", [*rendering(), "helm__values.yaml (model enabled)"])
def test_no_production_stack_key_is_dropped_silently(name):
    values = helm_values_enabled() if name.endswith("(model enabled)") else load(name)
    items = list(leaves(values))
    if name.endswith("(model enabled)"):  # the rest of the file is the plain file's case
        items = [(steps, v) for steps, v in items if steps[0] == "servingEngineSpec"]
    with ThreadPoolExecutor(2) as pool:
        verdicts = list(pool.map(lambda item: dropped(values, *item), items))
    silent = {dotted(steps): why for (steps, _), why in zip(items, verdicts, strict=True) if why}
    assert not silent, (
        "silently dropped (removing it changes nothing, no NOTES line names it):\n"
        + "\n".join(sorted(silent))
    )


# --- what is rendered ----------------------------------------------------------------------------------------


def rendered(name: str) -> tuple[list[dict], dict[tuple[str, ...], str]]:
    objs, notes = manifest_and_notes(load(name))
    return objs, compat_lines(notes)


def engines(objs: list[dict]) -> list[dict]:
    return [
        o
        for o in find(objs, "Deployment")
        if o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "serving-engine"
    ]


def quantity_gib(q: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024, "G": 1e9 / 2**30, "M": 1e6 / 2**30, "Ti": 1024.0}
    for u, f in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if q.endswith(u):
            return float(q[: -len(u)]) * f
    return float(q) / 2**30


FOOTPRINT_GIB = 4.0  # servingEngineSpec.engineMemoryFootprint's default (README "Engine memory and CPU")


def held_gib(deployment: dict) -> float:
    """What the engine holds from the start: LMCache's pinned buffer + /dev/shm + the engine footprint."""
    c = container(deployment)
    env = env_of(c)
    buffer = 0.0
    if any(name.startswith("LMCACHE_") for name in env):
        buffer = float(env.get("LMCACHE_MAX_LOCAL_CPU_SIZE", {"value": "5"})["value"])  # LMCache's default 5
        args = c["args"]
        workers = int(flag(args, "--tensor-parallel-size") or 1) * int(
            flag(args, "--pipeline-parallel-size") or 1
        )
        buffer *= workers  # every GPU worker runs its own LMCache engine with its own buffer
    vols = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    shm = quantity_gib(vols["dshm"]["emptyDir"]["sizeLimit"])
    return buffer + shm + FOOTPRINT_GIB


@pytest.mark.parametrize("name", rendering())
def test_engine_limits_hold_what_the_engine_pins(name):
    for d in engines(rendered(name)[0]):
        res = container(d)["resources"]
        limit = quantity_gib(res["limits"]["memory"])
        assert limit >= held_gib(d) - 1e-6, (d["metadata"]["name"], res, held_gib(d))
        assert quantity_gib(res["requests"]["memory"]) <= limit


@pytest.mark.parametrize(
    "name, buffer",
    [("tutorials__values-14-vllm-v1.yaml", 20), ("tutorials__values-18-prefix-aware.yaml", 60)],
)
def test_the_two_files_that_were_oom_killed_now_hold_their_buffers(name, buffer):
    objs, lines = rendered(name)
    (d,) = engines(objs)
    assert env_of(container(d))["LMCACHE_MAX_LOCAL_CPU_SIZE"]["value"] == str(buffer)
    res = container(d)["resources"]
    want = f"{buffer + 2 + 4}Gi"  # buffer + 2Gi /dev/shm (single GPU) + 4Gi engine footprint
    assert res["requests"]["memory"] == res["limits"]["memory"] == want
    (line,) = [t for p, t in lines.items() if p == ("servingEngineSpec.modelSpec[0].requestMemory",)]
    assert f"raised to {want}" in line and f"{buffer}Gi LMCache CPU buffer" in line


def _model(**kw) -> dict:
    return {"servingEngineSpec": {"modelSpec": [{"name": "m", "modelURL": "org/m", **kw}]}}


def test_a_memory_limit_below_the_buffers_is_refused_with_the_arithmetic():
    values = _model(limitMemory="32Gi", lmcacheConfig={"enabled": True, "cpuOffloadingBufferSize": "30"})
    rc, _, err = dry_run(values)
    assert rc != 0
    assert (
        "limitMemory 32Gi is below what the engine holds: 30Gi LMCache CPU buffer"
        " (lmcacheConfig.cpuOffloadingBufferSize) + 2Gi /dev/shm (shmSize) + 4Gi engine footprint"
        " (servingEngineSpec.engineMemoryFootprint) = 36Gi" in err
    )
    # LMCache pins its default 5 GiB even when no buffer size is given; tensor parallel gets 20Gi /dev/shm.
    rc, _, err = dry_run(_model(limitMemory="10Gi", lmcacheConfig={"enabled": True}))
    assert (
        rc != 0
        and "5Gi LMCache CPU buffer (lmcacheConfig.cpuOffloadingBufferSize, LMCache's default 5)" in err
    )
    rc, _, err = dry_run(_model(limitMemory="16Gi", requestGPU=2, vllmConfig={"tensorParallelSize": 2}))
    assert rc != 0 and "20Gi /dev/shm (shmSize) + 4Gi engine footprint" in err
    rc, _, err = dry_run(_model(resources={"limits": {"memory": "4Gi", "cpu": "4"}}))
    assert rc != 0 and "resources.limits.memory 4Gi is below" in err


def test_every_gpu_worker_pins_its_own_lmcache_buffer():
    objs, lines = rendered("tutorials__gke-example__values-01-offload-kv-cache-local-disk.yaml")
    (d,) = engines(objs)
    res = container(d)["resources"]
    # 128 GiB per worker x 8 tensor-parallel workers + 20Gi /dev/shm (TP > 1) + 4Gi: the file asks for 1024Gi.
    assert res["requests"]["memory"] == res["limits"]["memory"] == "1048Gi"
    line = lines[("servingEngineSpec.modelSpec[0].requestMemory",)]
    assert (
        "1024Gi LMCache CPU buffer (lmcacheConfig.cpuOffloadingBufferSize, 128Gi per GPU worker x 8 workers)"
        in line
    )


def test_a_cpu_limit_below_the_busy_processes_is_refused():
    rc, _, err = dry_run(_model(limitCPU=1))
    assert (
        rc != 0 and "limitCPU 1 is below 2: 2 processes keep a core busy each" in err and "throttles" in err
    )
    rc, _, err = dry_run(_model(limitCPU=3, requestGPU=2, vllmConfig={"tensorParallelSize": 2}))
    assert rc != 0 and "limitCPU 3 is below 4" in err
    objs, notes = manifest_and_notes(_model(requestCPU=1))
    res = container(one(objs, "Deployment", engine_name("m", "Deployment")))["resources"]
    assert res["requests"]["cpu"] == res["limits"]["cpu"] == "2"
    assert "requestCPU 1 raised to 2" in compat_lines(notes)[("servingEngineSpec.modelSpec[0].requestCPU",)]


@pytest.mark.parametrize("name", rendering())
def test_the_router_is_ours_and_knows_every_flag_it_gets(name):
    objs, lines = rendered(name)
    (router,) = [d for d in find(objs, "Deployment") if d["metadata"]["name"] == router_name()] or [None]
    if router is None:
        return
    c = container(router)
    assert c["image"].startswith("ghcr.io/vllm-stack/router:"), c["image"]
    build_parser().parse_args(c["args"])  # exits (SystemExit) on an unknown flag
    repo = (load(name).get("routerSpec") or {}).get("repository")
    if repo and repo.rsplit("/", 1)[-1] != "router":
        assert ("routerSpec.repository", "routerSpec.tag") in lines, lines


def test_deliberate_differences_are_in_the_notes():
    _, lines = rendered("tutorials__values-03-match-pv.yaml")
    assert (
        "production-stack renders --no-enable-prefix-caching"
        in lines[("servingEngineSpec.modelSpec[0].vllmConfig.enablePrefixCaching",)]
    )
    values = _model(vllmConfig={"maxLoras": 4})
    assert (
        "--enable-lora added"
        in compat_lines(manifest_and_notes(values)[1])[
            ("servingEngineSpec.modelSpec[0].vllmConfig.maxLoras",)
        ]
    )
    _, lines = rendered("tests__values-01-2pods-minimal-example.yaml")
    assert "git-act-router" in lines[("routerSpec.repository", "routerSpec.tag")]
    assert "0.5 rendered as nvidia.com/gpu: 1" in lines[("servingEngineSpec.modelSpec[0].requestGPU",)]
    objs, lines = rendered("tutorials__values-25-v100-single-gpu.yaml")
    # vllm/vllm-openai:v0.8.5 has vLLM's V0 engine: production-stack's v0 is honoured (README "Version gating")
    assert env_of(container(engines(objs)[0]))["VLLM_USE_V1"]["value"] == "0"
    assert ("servingEngineSpec.modelSpec[0].vllmConfig.v0",) not in lines
    _, lines = rendered("tutorials__values-09-lora-helm.yaml")
    assert "runs the V1 engine by default" in lines[("servingEngineSpec.modelSpec[0].vllmConfig.v1",)]


def test_fractional_gpus_render_as_whole_extended_resources():
    objs, _ = rendered("tests__values-01-2pods-minimal-example.yaml")
    (d,) = engines(objs)
    res = container(d)["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    assert "--gpu-memory-utilization" in container(d)["args"]


def test_implemented_production_stack_keys():
    objs, _ = rendered("tests__values-01-2pods-minimal-example.yaml")
    pdb = one(objs, "PodDisruptionBudget", engine_name("opt125m", "PodDisruptionBudget"))
    assert pdb["spec"]["minAvailable"] == 1 and pdb["metadata"]["annotations"] == {"model": "opt125m"}
    assert (
        pdb["spec"]["selector"]
        == one(objs, "Deployment", engine_name("opt125m", "Deployment"))["spec"]["selector"]
    )

    objs, _ = rendered("tests__values-06-session-routing.yaml")
    c = container(one(objs, "Deployment", engine_name("opt125m", "Deployment")))
    assert c["args"][c["args"].index("--chat-template") + 1] == "/templates/chat.jinja2"
    cm = one(objs, "ConfigMap", engine_name("opt125m", "ConfigMap"))
    assert cm["data"]["chat.jinja2"].startswith("{% for message in messages %}")
    env = env_of(c)
    assert env["LMCACHE_LMCACHE_WORKER_PORTS"]["value"] == "8001"  # production-stack's string "8001"
    assert (
        env["LMCACHE_P2P_HOST"]["value"] == "localhost" and env["LMCACHE_P2P_INIT_PORTS"]["value"] == "30081"
    )

    objs, _ = rendered("tutorials__values-13-tool-enabled.yaml")
    args = container(engines(objs)[0])["args"]
    assert "--enable-auto-tool-choice" in args and args[args.index("--tool-call-parser") + 1] == "llama3_json"

    objs, _ = rendered("tutorials__values-06-shared-storage.yaml")
    pod = engines(objs)[0]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == "wait-for-cache-server" and env_of(init)["RELEASE_NAME"]["value"] == RELEASE
    assert env_of(init)["LMCACHE_SERVER_SERVICE_PORT"]["value"] == "81"

    objs, lines = rendered("tutorials__values-03-match-pv.yaml")
    pvc = one(objs, "PersistentVolumeClaim", engine_name("llama3", "PersistentVolumeClaim"))
    assert pvc["spec"]["selector"] == {"matchLabels": {"model": "llama3-pv"}}
    assert ("servingEngineSpec.modelSpec[0].pvcMatchLabels",) in lines

    objs, _ = rendered("tests__values-11-monitoring.yaml")
    assert find(objs, "ConfigMap") and all(
        cm["metadata"]["labels"].get("grafana_dashboard") == "1"
        for cm in find(objs, "ConfigMap")
        if "-grafana-" in cm["metadata"]["name"]
    )

    objs, _ = rendered("tutorials__values-22-gateway-api.yaml")
    http = one(objs, "HTTPRoute", f"{RELEASE}-router-http")["spec"]["rules"][0]
    assert http["filters"][0]["type"] == "RequestRedirect" and "backendRefs" not in http


def test_default_values_file_model_as_given_is_refused_with_the_arithmetic():
    values = helm_values_enabled()
    values["servingEngineSpec"]["modelSpec"][0]["limitMemory"] = "32Gi"
    rc, _, err = dry_run(values)
    assert rc != 0 and "limitMemory 32Gi is below what the engine holds: 60Gi LMCache CPU buffer" in err
    assert "30Gi per GPU worker x 2 workers" in err and "= 84Gi" in err


def test_default_values_file_keys_are_implemented():
    """production-stack's own default values.yaml, its model turned on: podLabels, modelRevision, HAMi
    resources, initContainer, extraObjects, sharedPvcStorage, serviceAnnotations, keda triggers as one object."""
    values = helm_values_enabled()
    values["extraObjects"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "{{ .Release.Name }}-x"}}
    ]
    values["sharedPvcStorage"]["enabled"] = True
    values["servingEngineSpec"]["modelSpec"][0]["podLabels"] = {"team": "a"}
    values["servingEngineSpec"]["modelSpec"][0]["modelRevision"] = "main"
    values["servingEngineSpec"]["modelSpec"][0]["serviceAnnotations"] = {"a": "b"}
    objs, _ = manifest_and_notes(values)
    d = one(objs, "Deployment", engine_name("mistral", "Deployment"))
    c = container(d)
    assert d["spec"]["template"]["metadata"]["labels"]["team"] == "a"
    assert c["args"][c["args"].index("--revision") + 1] == "main"
    res = c["resources"]
    assert res["requests"]["nvidia.com/gpumem"] == "3000" and res["limits"]["nvidia.com/gpucores"] == "10"
    assert (
        res["requests"]["nvidia.com/mig-4g.71gb"] == "2"
    )  # its two tensor-parallel workers (helm_values_enabled)
    assert d["spec"]["template"]["spec"]["initContainers"][0]["image"] == "busybox:latest"
    assert one(objs, "ConfigMap", f"{RELEASE}-x")
    assert env_of(c)["HF_HOME"]["value"] == "/data/shared-pvc-storage"
    assert one(objs, "PersistentVolumeClaim", f"{RELEASE}-shared-pvc-storage-claim")["spec"][
        "accessModes"
    ] == ["ReadWriteMany"]
    assert one(objs, "Service", engine_name("mistral", "Service"))["metadata"]["annotations"] == {"a": "b"}
    so = one(objs, "ScaledObject", engine_name("mistral", "ScaledObject"))
    assert [t["type"] for t in so["spec"]["triggers"]] == ["prometheus"]


def test_notes_curl_carries_the_api_key_when_client_keys_are_on():
    _, notes = manifest_and_notes({"routerSpec": {"apiKeysSecret": {"secretName": "keys", "secretKey": "k"}}})
    text = "\n".join(notes)
    assert 'curl -H "Authorization: Bearer $KEY"' in text and "get secret keys" in text
    _, notes = manifest_and_notes({})
    assert "Authorization" not in "\n".join(notes)


@pytest.mark.parametrize("name", rendering())
def test_every_rendered_object_validates(name):
    """Built-in kinds against the Kubernetes schemas, custom resources against their CRDs and CEL rules
    (tests/helm/test_validate_objects.py's checks), for production-stack's files as well."""
    from tests.helm.test_validate_objects import validate

    for obj in rendered(name)[0]:
        text = json.dumps(obj, sort_keys=True)
        if text in _VALIDATED:  # the router's objects repeat across files
            continue
        try:
            validate(obj)
        except Exception as exc:
            raise AssertionError(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {exc}") from None
        _VALIDATED.add(text)


_VALIDATED: set[str] = set()
