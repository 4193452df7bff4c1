"""Kubeconfig files for the test cluster: one per client identity, certificate or token.

Helm, kubectl and the control-plane components all read the same format. The admin's file is the one
`vllm-stack cluster up` prints; a ServiceAccount's (a token from the TokenRequest API) is how the router
runs as the chart's own identity rather than the admin's.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from vllm_stack_dev.cluster.pki import Credential

CLUSTER_NAME = "vllm-stack-test"


def _document(server: str, ca: Path, user: dict[str, str], namespace: str | None) -> dict[str, object]:
    context: dict[str, str] = {"cluster": CLUSTER_NAME, "user": "user"}
    if namespace:
        context["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CLUSTER_NAME, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": CLUSTER_NAME, "context": context}],
        "current-context": CLUSTER_NAME,
    }


def _write(path: Path, document: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    path.chmod(0o600)
    return path


def write_certificate_kubeconfig(path: Path, server: str, ca: Path, client: Credential) -> Path:
    """A kubeconfig that authenticates with a client certificate (admin, control-plane components)."""
    user = {"client-certificate": str(client.cert), "client-key": str(client.key)}
    return _write(path, _document(server, ca, user, None))


def write_token_kubeconfig(
    path: Path, server: str, ca: Path, token: str, namespace: str | None = None
) -> Path:
    """A kubeconfig that authenticates with a bearer token (a ServiceAccount's, from TokenRequest)."""
    return _write(path, _document(server, ca, {"token": token}, namespace))
