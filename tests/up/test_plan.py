"""`vllm-stack up`'s plan, for every values file the chart accepts (its examples, the tutorials and every
production-stack file that renders): what the chart renders is what runs, with only the substitutions
this machine needs (the tiny model for the weights, loopback ports for cluster DNS, one CPU engine per
replica), and a values file the chart refuses is refused with the chart's own words.

No process is started here (tests/tutorials/ and tests/stacks/ run stacks)."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from vllm_stack_dev.up.plan import (
    COMPONENT,
    CPU_PD_CONNECTOR,
    PlanError,
    Planner,
    StackPlan,
    memory_fit,
)
from vllm_stack_dev.up.render import RenderError, render

from tests.helm.chart import ROOT, values_files
from tests.helm.test_production_stack_files import PS_DIR, rendering
from tests.shared_data import require

pytestmark = pytest.mark.helm

MODEL_DIR = Path("/models/tiny")
PLENTY = 64  # engines the planner may start: the replica counts themselves


def _planner(objects: list[dict], tmp_path: Path, max_engines: int = PLENTY) -> Planner:
    ports = itertools.count(20000)
    return Planner(
        objects,
        workdir=tmp_path / "pods",
        model_dir=MODEL_DIR,
        router_port=18080,
        free_port=lambda: next(ports),
        cores=[0, 1],
        max_engines=max_engines,
        key_factory=lambda: "sk-generated",
    )


def _plan(
    values: list[Path], tmp_path: Path, sets: tuple[str, ...] = (), **kw
) -> tuple[StackPlan, list[dict]]:
    objects = render(values, sets)
    return _planner(objects, tmp_path, **kw).plan(), objects


def _engine_workloads(objects: list[dict]) -> list[dict]:
    return [
        o
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        and o["spec"]["template"]["metadata"].get("labels", {}).get(COMPONENT) == "serving-engine"
    ]


def _service_names(objects: list[dict]) -> set[str]:
    return {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}


def _everything_said(plan: StackPlan) -> list[str]:
    texts = []
    for process in plan.processes:
        texts += process.argv
        texts += process.env.values()
        texts += process.files.values()
    return texts


def _cases() -> list[pytest.param]:
    cases = [pytest.param(path, id=str(path.relative_to(ROOT))) for path in values_files()]
    # production-stack's files are in ../shared: each case fails without them (require), never leaves
    return cases + [pytest.param(PS_DIR / name, id=f"production-stack/{name}") for name in rendering()]


@pytest.mark.parametrize("values", _cases())
def test_what_the_chart_renders_is_what_runs(values: Path, tmp_path: Path) -> None:
    require(values)
    try:
        plan, objects = _plan([values], tmp_path)
    except PlanError as error:  # a values file without an engine (router-only examples)
        assert "deploy no engine" in str(error)
        assert not [w for w in _engine_workloads(objects_of(values)) if w["spec"].get("replicas", 1)]
        return
    workloads = _engine_workloads(objects)
    want = sum(int(w["spec"].get("replicas", 1)) for w in workloads)
    assert len(plan.engines) == want, "one engine process per rendered replica"
    for engine in plan.engines:
        argv = engine.argv
        assert argv[argv.index("--model") + 1] == str(MODEL_DIR)
        assert "--load-format" in argv and argv[argv.index("--load-format") + 1] == "dummy"
        for flag in ("--host", "--port", "--tensor-parallel-size"):
            assert flag not in argv, f"{engine.name}: {flag} is the cluster's, not this machine's"
        if "--kv-transfer-config" in argv:  # only the CPU's PD connector, only on a PD engine
            assert engine.role in ("prefill", "decode"), engine.name
            assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == CPU_PD_CONNECTOR
        workload = next(w for w in workloads if engine.name.startswith(w["metadata"]["name"] + "-"))
        rendered = workload["spec"]["template"]["spec"]["containers"][0]
        assert engine.model and engine.model in rendered.get("command", []) + rendered.get("args", []), (
            f"{engine.name} serves {engine.model!r}, the name the chart rendered"
        )
    assert sorted(plan.models) == sorted({e.model for e in plan.engines})
    ports = [p.port for p in plan.processes if p.port]
    assert len(ports) == len(set(ports)), "every process has its own port"
    router = plan.router
    if router is not None:
        argv = router.argv
        if argv[argv.index("--service-discovery") + 1] == "external-only":  # external providers only
            assert not plan.engines and "--static-backends" not in argv
        else:
            assert argv[argv.index("--service-discovery") + 1] == "static"
            backends = argv[argv.index("--static-backends") + 1].split(",")
            assert sorted(backends) == sorted(e.url for e in plan.engines)
        assert argv[argv.index("--port") + 1] == "18080"
    services = _service_names(objects)
    for text in _everything_said(plan):
        for service in services:
            assert not re.search(rf"\b{re.escape(service)}(\.[\w.-]+)?:\d+", text), (
                f"cluster DNS {service} left in {text!r}"
            )
        assert ".svc.cluster.local" not in text


def objects_of(values: Path) -> list[dict]:
    return render([values])


def test_every_substitution_is_said_with_its_reason(tmp_path: Path) -> None:
    plan, _ = _plan([ROOT / "helm/examples/seed-keda.yaml"], tmp_path, max_engines=1)
    lines = [s.line() for s in plan.substitutions]
    assert any(
        "weights meta-llama/Llama-3.1-8B-Instruct -> tiny Llama, dummy weights, served as meta-llama/Llama-3.1-8B-Instruct"
        in line
        for line in lines
    )
    assert any("cluster DNS: vllm-stack-llama3-engine-service:80 -> 127.0.0.1:" in line for line in lines), (
        lines
    )
    assert any("--service-discovery k8s -> static" in line for line in lines), lines
    assert all(s.why for s in plan.substitutions)
    assert any(
        item.startswith("ScaledObject/vllm-stack-llama3-scaledobject: no KEDA here") for item in plan.not_run
    )


def test_memory_caps_the_replicas_and_says_so(tmp_path: Path) -> None:
    plan, _ = _plan([ROOT / "helm/examples/local-default.yaml"], tmp_path, max_engines=1)
    assert len(plan.engines) == 1
    assert any("replicas 2" in s.line() and "--max-engines" in s.why for s in plan.substitutions)
    assert memory_fit(2.0) == 1 and memory_fit(13.0) == 4


def test_a_model_at_zero_replicas_runs_no_engine_and_its_router_still_knows_it(tmp_path: Path) -> None:
    plan, _ = _plan(
        [ROOT / "tutorials/values-04-request-priority.yaml"],
        tmp_path,
        ("servingEngineSpec.modelSpec[1].replicaCount=0",),
    )
    assert plan.models == ["chat"]
    assert any(s.rendered == "replicas 0" and s.local == "no engine" for s in plan.substitutions)
    (config,) = [t for p, t in plan.router.files.items() if p.name == "config.yaml"]
    assert "summaries" in [m["name"] for m in yaml.safe_load(config)["models"]]


def test_more_models_than_fit_is_refused_not_shrunk(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="fits 1 tiny CPU engines"):
        _plan([ROOT / "helm/examples/multi-model.yaml"], tmp_path, max_engines=1)


def test_the_engines_api_key_reaches_engines_and_router(tmp_path: Path) -> None:
    values = tmp_path / "v.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "servingEngineSpec": {
                    "vllmApiKey": "engine-secret",
                    "modelSpec": [
                        {
                            "name": "m",
                            "modelURL": "org/m",
                            "replicaCount": 1,
                            "requestCPU": 1,
                            "requestMemory": "1Gi",
                        }
                    ],
                }
            }
        )
    )
    plan, _ = _plan([values], tmp_path)
    assert plan.engines[0].env["VLLM_API_KEY"] == "engine-secret"
    assert "engine-secret" in plan.router.env.values()


def test_a_secret_the_chart_does_not_render_gets_a_generated_key_that_is_printed(tmp_path: Path) -> None:
    plan, _ = _plan([ROOT / "helm/examples/multi-model.yaml"], tmp_path)
    said = [s for s in plan.substitutions if "sk-generated" in s.local]
    assert said, [s.line() for s in plan.substitutions]
    assert "sk-generated" in "\n".join(plan.router.files.values()) + json.dumps(plan.router.env)
    generated = [value for keys in plan.generated_secrets.values() for value in keys.values()]
    assert generated and set(generated) == {"sk-generated"}, "stack.json's secrets: what scripts read"


def test_cache_server_and_controller_run_on_loopback(tmp_path: Path) -> None:
    plan, _ = _plan([ROOT / "helm/examples/cache-server.yaml"], tmp_path)
    (server,) = plan.of("cache-server")
    assert server.argv[-2:] == ["127.0.0.1", str(server.port)]
    plan, _ = _plan([ROOT / "helm/examples/kvaware.yaml"], tmp_path)
    (controller,) = plan.of("lmcache-controller")
    router = plan.router.argv
    assert router[router.index("--lmcache-controller-url") + 1] == f"http://127.0.0.1:{controller.port}"
    assert controller.argv[:2] == ["lmcache_controller", "--host"] and "127.0.0.1" in controller.argv
    for engine in plan.engines:  # LMCache's connector needs CUDA: dropped with its settings, and said so
        assert not [k for k in engine.env if k.startswith("LMCACHE_")]
    assert any("LMCacheConnectorV1 -> none" in s.line() for s in plan.substitutions)


def test_disaggregated_roles_become_static_roles(tmp_path: Path) -> None:
    plan, _ = _plan([ROOT / "helm/examples/pd-roles.yaml"], tmp_path)
    router = plan.router.argv
    roles = router[router.index("--static-roles") + 1].split(",")
    assert roles == [e.role for e in plan.engines] and sorted(set(roles)) == ["decode", "prefill"]


def test_lmcache_pd_becomes_nixl_on_cpu_and_the_router_follows(tmp_path: Path) -> None:
    """LMCache's PD connector cannot load here, NixlConnector can: the two legs and the hand-over run."""
    plan, _ = _plan([ROOT / "tutorials/values-05-disaggregated-prefill.yaml"], tmp_path)
    assert sorted({e.role for e in plan.engines}) == ["decode", "prefill"]
    side_channels = set()
    for engine in plan.engines:
        argv = engine.argv
        assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == CPU_PD_CONNECTOR
        assert not [k for k in engine.env if k.startswith("LMCACHE_")]
        assert (
            engine.env["UCX_TLS"] == "tcp,self" and engine.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        )
        side_channels.add(engine.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    assert len(side_channels) == len(plan.engines), "each engine its own side channel"
    router = plan.router.argv
    assert router[router.index("--disagg-protocol") + 1] == "vllm"
    assert not {"--disagg-notify-port", "--disagg-receiver-init-port"} & set(router)
    lines = [s.line() for s in plan.substitutions]
    assert any("LMCacheConnectorV1 -> NixlConnector" in line for line in lines), lines
    assert any("--disagg-protocol lmcache -> vllm" in line for line in lines), lines
    notify = [s for s in plan.substitutions if s.rendered == "vllm-stack-router-service:7500"]
    assert notify and notify[0].local != "127.0.0.1:18080", "only the router's http port is its local port"


def test_the_routers_adapter_registry_gets_tiny_loras(tmp_path: Path) -> None:
    """A Hub repository or a cluster path in ``lora_adapters`` -> a tiny random LoRA the router loads."""
    plan, _ = _plan([ROOT / "tutorials/values-03-lora-adapters.yaml"], tmp_path)
    router = plan.router
    (config_text,) = [t for p, t in router.files.items() if p.name == "config.yaml"]
    registry = {a["name"]: a for a in yaml.safe_load(config_text)["lora_adapters"]}
    assert set(registry) == {"support", "sql", "legal"}
    assert [Path(registry[n]["source"]) for n in ("support", "sql", "legal")] == router.adapters
    for folder in router.adapters:
        assert folder.is_relative_to(tmp_path / "pods")
    assert registry["support"]["tier"] == "hot" and registry["legal"]["tier"] == "cold"
    said = [s.line() for s in plan.substitutions if s.subject == router.name]
    assert any("hf:nvidia/llama-3.1-nemoguard-8b-topic-control" in line for line in said), said
    assert any("/data/adapters/sql" in line for line in said), said


def _up(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_stack_dev.cli", "up", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_values_the_chart_refuses_are_refused_with_its_words(tmp_path: Path) -> None:
    result = _up(
        "-f", str(ROOT / "helm/examples/local-default.yaml"), "--set", "routerSpec.routingLogic=session"
    )
    assert result.returncode == 1
    assert "routerSpec.sessionKey is required with routingLogic: session" in result.stderr
    with pytest.raises(RenderError, match="sessionKey is required"):
        render([ROOT / "helm/examples/local-default.yaml"], ["routerSpec.routingLogic=session"])


def test_dry_run_prints_the_substitutions_and_command_lines(tmp_path: Path) -> None:
    result = _up(
        "-f",
        str(ROOT / "helm/examples/local-default.yaml"),
        "--dry-run",
        "--log-dir",
        str(tmp_path),
        "--max-engines",
        "2",  # not what this host's free memory happens to fit while other tests run
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Substituted (what this machine cannot have):" in out
    assert "meta-llama/Llama-3.2-1B-Instruct" in out  # the rendered model, and what replaced it
    assert (
        out.count("$ [vllm-stack-tiny-llama-deployment-vllm-") == 2
        and "$ [vllm-stack-deployment-router-0]" in out
    )


def test_a_chat_template_from_the_image_becomes_the_models_own(tmp_path: Path) -> None:
    values = require(PS_DIR / "tutorials__values-13-tool-enabled.yaml")
    plan, _ = _plan([values], tmp_path)
    (engine,) = plan.engines
    assert "--chat-template" not in engine.argv and "--tool-call-parser" in engine.argv
    assert any(s.rendered.startswith("--chat-template /templates/") for s in plan.substitutions)


def test_the_batch_api_runs_on_a_local_folder_with_sqlite(tmp_path: Path) -> None:
    """routerSpec.batch: the claim mounted at the batch dir becomes a folder of the stack's work directory,
    which the router's --batch-dir names; the database Secret (the user's, in the cluster) is unset here,
    so the one local router keeps its batches in SQLite there. Several replicas run as one router."""
    values = tmp_path / "v.yaml"
    model = {"name": "m", "modelURL": "org/m", "replicaCount": 1, "requestCPU": 1, "requestMemory": "1Gi"}
    batch = {
        "enabled": True,
        "database": {"secretName": "batch-db"},
        "storage": {"accessMode": "ReadWriteMany"},
        "concurrency": 2,
    }
    values.write_text(
        yaml.safe_dump(
            {"servingEngineSpec": {"modelSpec": [model]}, "routerSpec": {"replicaCount": 2, "batch": batch}}
        )
    )
    plan, _ = _plan([values], tmp_path)
    router = plan.router
    argv = router.argv
    batch_dir = Path(argv[argv.index("--batch-dir") + 1])
    assert "--batch-api" in argv and argv[argv.index("--batch-concurrency") + 1] == "2"
    assert batch_dir == tmp_path / "pods" / router.name / "batch" and batch_dir in router.folders
    assert "VLLM_STACK_BATCH_DATABASE_URL" not in router.env
    lines = [s.line() for s in plan.substitutions if s.subject == router.name]
    assert any(
        "--batch-dir /var/lib/vllm-stack/batch (PersistentVolumeClaim vllm-stack-router-batch)" in line
        for line in lines
    ), lines
    database = "VLLM_STACK_BATCH_DATABASE_URL from Secret batch-db -> unset"
    assert any(database in line and "SQLite" in line for line in lines), lines
    assert len(plan.of("router")) == 1


def test_a_batch_database_secret_the_values_render_reaches_the_router(tmp_path: Path) -> None:
    """A database Secret rendered with the release (extraObjects) is read like any rendered Secret."""
    values = tmp_path / "v.yaml"
    model = {"name": "m", "modelURL": "org/m", "replicaCount": 1, "requestCPU": 1, "requestMemory": "1Gi"}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "batch-db"},
        "stringData": {"dsn": "postgresql://u:p@127.0.0.1:5432/batches"},
    }
    values.write_text(
        yaml.safe_dump(
            {
                "servingEngineSpec": {"modelSpec": [model]},
                "routerSpec": {
                    "batch": {"enabled": True, "database": {"secretName": "batch-db", "secretKey": "dsn"}}
                },
                "extraObjects": [secret],
            }
        )
    )
    plan, _ = _plan([values], tmp_path)
    assert plan.router.env["VLLM_STACK_BATCH_DATABASE_URL"] == "postgresql://u:p@127.0.0.1:5432/batches"
    assert "--batch-api" in plan.router.argv


def test_cluster_pods_share_a_claims_folder_and_read_a_secret_learned_later(tmp_path: Path) -> None:
    """For the cluster's Pods (vllm_stack_dev.cluster.pod_processes, a ``claims_dir``): both router replicas'
    --batch-dir is the one folder of their claim, and the database URL comes from a Secret told to the
    planner once the API server holds it (the user's, never rendered)."""
    values = tmp_path / "v.yaml"
    model = {"name": "m", "modelURL": "org/m", "replicaCount": 1, "requestCPU": 1, "requestMemory": "1Gi"}
    batch = {
        "enabled": True,
        "database": {"secretName": "batch-db"},
        "storage": {"accessMode": "ReadWriteMany"},
    }
    values.write_text(
        yaml.safe_dump(
            {"servingEngineSpec": {"modelSpec": [model]}, "routerSpec": {"replicaCount": 2, "batch": batch}}
        )
    )
    objects = render([values])
    (deployment,) = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["spec"]["template"]["metadata"]["labels"][COMPONENT] == "router"
    ]
    template = deployment["spec"]["template"]
    planner = Planner(
        objects, workdir=tmp_path / "pods", model_dir=MODEL_DIR, router_port=18080,
        free_port=iter(range(20000, 21000)).__next__, cores=[0], max_engines=PLENTY,
        claims_dir=tmp_path / "claims",
    )  # fmt: skip

    def pod(name: str) -> dict:
        return {
            "metadata": {"name": name, "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }

    first = planner.plan_pod_router(pod("router-a"), "10.0.0.1")
    assert "VLLM_STACK_BATCH_DATABASE_URL" not in first.env  # not rendered, not learned yet
    dsn = "postgresql://u:p@127.0.0.1:5432/batches"
    planner.learn([{"kind": "Secret", "metadata": {"name": "batch-db"}, "stringData": {"url": dsn}}])
    second = planner.plan_pod_router(pod("router-b"), "10.0.0.2")
    assert second.env["VLLM_STACK_BATCH_DATABASE_URL"] == dsn
    shared = tmp_path / "claims" / "vllm-stack-router-batch"
    for process in (first, second):
        assert process.argv[process.argv.index("--batch-dir") + 1] == str(shared)
        assert shared in process.folders
    # Its other mounts stay the Pod's own.
    assert first.argv[first.argv.index("--config") + 1].startswith(str(tmp_path / "pods" / "router-a"))


def test_an_sglang_engine_is_refused_with_the_reason(tmp_path) -> None:
    """`vllm-stack up` runs vLLM engines; an SGLang model (engineKind: sglang) is refused by name, not
    planned as a vLLM engine with SGLang's flags."""
    with pytest.raises(
        PlanError, match="an SGLang engine .engineKind: sglang. does not run under `vllm-stack up`"
    ):
        _plan([ROOT / "tests/helm/data/sglang-beside-vllm.yaml"], tmp_path)


def test_tutorial_19s_sleep_mode_runs_on_a_cpu_engine_with_its_dev_endpoints(tmp_path: Path) -> None:
    """production-stack's sleep-mode file: the CPU build refuses --enable-sleep-mode at start, so it is
    dropped and said; VLLM_SERVER_DEV_MODE=1 stays, so the engine serves /sleep, /wake_up, /is_sleeping."""
    plan, _ = _plan([require(PS_DIR / "tutorials__values-19-sleep-mode-aware.yaml")], tmp_path)
    (engine,) = plan.engines
    assert "--enable-sleep-mode" not in engine.argv
    assert engine.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert any(
        "--enable-sleep-mode -> dropped" in s.line() and "CPU build" in s.line() for s in plan.substitutions
    )
