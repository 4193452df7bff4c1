"""What each tutorial's `render` step (helm template and a grep or two over it) must print, checked against
the chart as it renders now: in the fast tier by tests/tutorials/test_render_steps.py (the render step
alone), and again by each tutorial's full run in the engine tier. One place, so that a change of how the
chart writes a field (production-stack's object names, a value quoted or not) fails before a tutorial run
on engines does."""

from __future__ import annotations

import re
from collections.abc import Callable


def _minimal(out: str) -> None:
    assert "kind: Deployment" in out and "kind: Service" in out, out


def _keda(out: str) -> None:
    assert out.splitlines() == [
        "vllm-stack-llama3-scaledobject replicas 0 to 4",
        "  queue threshold 5",
        "  router-requests threshold 1000000",
    ], out


def _lora(out: str) -> None:
    assert "name: support" in out and "tier: hot" in out, out


def _priority(out: str) -> None:
    assert "engine_priority: true" in out and "criticality: sheddable" in out, out
    assert 'vllm_stack_router_queue_length{model="chat"' in out, out


def _disagg(out: str) -> None:
    assert re.search(r"\d+ +vllm-stack.io/role: prefill", out), out
    assert re.search(r"\d+ +vllm-stack.io/role: decode", out), out
    assert "disaggregated_prefill" in out and "lmcache" in out, out
    for value in ("sender", "receiver", "vllm-stack-router-service"):  # the PD roles, the router's Service
        assert re.search(rf"^ +1 +value: {value}$", out, re.M), (value, out)


def _multiple_models(out: str) -> None:
    assert "vllm-stack-llama3-deployment-vllm serves meta-llama/Llama-3.1-8B-Instruct" in out, out
    assert "vllm-stack-qwen-deployment-vllm serves Qwen/Qwen2.5-1.5B-Instruct" in out, out


def _routing(out: str) -> None:
    assert "session" in out and "x-user-id" in out, out
    assert "routerSpec.sessionKey is required with routingLogic: session" in out, out


def _kv_offload(out: str) -> None:
    for rendered in (
        "LMCacheConnectorV1",
        "value: lm://vllm-stack-cache-server-service:81",  # the cache server's Service, production-stack's name
        'value: "20"',
        "lmcache_server",
    ):
        assert rendered in out, (rendered, out)


def _observability(out: str) -> None:
    lines = out.splitlines()
    assert lines.count("PrometheusRule vllm-stack-prometheus-rules") == 1, out
    assert sum(line.startswith("ServiceMonitor ") for line in lines) == 2, out
    assert sum(line.startswith("ConfigMap ") for line in lines) == 3, out


def _from_production_stack(out: str) -> None:
    """Both charts' Services (with their selectors), claims and Secrets (with their keys) are the same: the
    step's diff passed, and it printed them."""
    lines = out.splitlines()
    assert "PersistentVolumeClaim vllm-llama3-storage-claim []" in lines, out
    assert "Secret vllm-secrets ['hf_token_llama3']" in lines, out
    services = [line.split()[1] for line in lines if line.startswith("Service ")]
    assert services == ["vllm-llama3-engine-service", "vllm-router-service"], out
    assert all("model=llama3" in line for line in lines if line.startswith("Service vllm-llama3")), out


def _batch(out: str) -> None:
    """One router: the flags, the kept claim mounted at the batch dir, Recreate, the NOTES line; two routers on
    SQLite refused with the reason; with PostgreSQL, the URL from the Secret and a ReadWriteMany claim."""
    lines = [line.strip() for line in out.splitlines()]
    i = lines.index("- --batch-api")
    assert lines[i + 1 : i + 3] == ["- --batch-dir", "- /var/lib/vllm-stack/batch"], out
    for rendered in (
        "name: vllm-stack-router-batch",
        "helm.sh/resource-policy: keep",
        'storage: "20Gi"',
        "claimName: vllm-stack-router-batch",
        "replicas: 1",
        "type: Recreate",
        "routerSpec.batch.enabled with routerSpec.replicaCount 2: without a database the router keeps the batches"
        " in SQLite on its volume, which one router owns",
        "- name: VLLM_STACK_BATCH_DATABASE_URL",
        "name: vllm-stack-batch-db",
    ):
        assert rendered in lines, (rendered, out)
    order = [lines.index(line) for line in ("- ReadWriteOnce", "type: Recreate", "- ReadWriteMany")]
    assert order == sorted(order), out  # the one-router claim and strategy, then the replicas' claim
    notes = next(line for line in lines if line.startswith("Batch API"))
    assert "vllm-stack-router-batch (kept on helm uninstall" in notes and "SQLite" in notes, out
    assert "postgresql://" not in out, out  # the URL stays in the Secret


CHECKS: dict[str, Callable[[str], None]] = {
    "01-helm-minimal.md": _minimal,
    "02-autoscaling-keda.md": _keda,
    "03-lora-adapters.md": _lora,
    "04-request-priority.md": _priority,
    "05-disaggregated-prefill.md": _disagg,
    "06-multiple-models.md": _multiple_models,
    "07-routing-strategies.md": _routing,
    "08-kv-offload-cache-server.md": _kv_offload,
    "09-observability.md": _observability,
    "10-from-production-stack.md": _from_production_stack,
    "11-batch-api.md": _batch,
}


def check_render(tutorial: str, output: str) -> None:
    """Fails when the render step of ``tutorial`` (its file name) printed what the tutorial does not show."""
    CHECKS[tutorial](output)
