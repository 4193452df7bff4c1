"""What a release's Pods ask of the cluster beyond the chart: nodes with labels, claims that must exist.

A values file written for a real cluster pins its engines to the nodes it has: a GPU product
(`nvidia.com/gpu.product In [NVIDIA-L4]`), a host (`kubernetes.io/hostname In [gpu-node-01]`), a label of
the operator's own. On the test cluster such a Pod would stay Pending, which says nothing about the chart;
so the test bed first adds a kwok node that carries what the Pod asks for, as the user's cluster would
have it. Only what a Pod *requires* is read (``requiredDuringScheduling...`` terms, ``nodeSelector``);
preferences and anti-affinity never keep a Pod from being scheduled on the default nodes.

Likewise a file may mount a PersistentVolumeClaim it expects to exist (`existingClaim: shared-models`);
the test bed creates such claims in the release's namespace before the install.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: Workload kinds whose ``spec.template`` is a Pod template.
POD_TEMPLATE_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"})
HOSTNAME = "kubernetes.io/hostname"


def pod_specs(documents: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The Pod specs of every workload (and bare Pod) among ``documents``."""
    specs = []
    for doc in documents:
        if not doc:
            continue
        if doc.get("kind") in POD_TEMPLATE_KINDS:
            specs.append(((doc.get("spec") or {}).get("template") or {}).get("spec") or {})
        elif doc.get("kind") == "Pod":
            specs.append(doc.get("spec") or {})
    return specs


def required_labels(spec: Mapping[str, Any]) -> dict[str, str]:
    """Labels a node needs for ``spec`` to be scheduled on it ({} when any node does).

    From ``nodeSelector`` and the first term of the required node affinity (terms are ORed: one that
    holds is enough): ``In`` takes its first value, ``Exists`` any value; ``NotIn``, ``DoesNotExist``,
    ``Gt`` and ``Lt`` are met by a node that lacks the label (Gt/Lt get a number that satisfies them).
    """
    labels = {str(k): str(v) for k, v in (spec.get("nodeSelector") or {}).items()}
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = affinity.get("nodeSelectorTerms") or []
    if terms:
        for expression in terms[0].get("matchExpressions") or []:
            key, operator = expression["key"], expression["operator"]
            values = [str(v) for v in expression.get("values") or []]
            if operator == "In" and values:
                labels[key] = values[0]
            elif operator == "Exists":
                labels.setdefault(key, "true")
            elif operator == "Gt" and values:
                labels[key] = str(int(values[0]) + 1)
            elif operator == "Lt" and values:
                labels[key] = str(int(values[0]) - 1)
    return labels


def node_name(labels: Mapping[str, str]) -> str:
    """The node's name: the host name a Pod pins, else one made from the labels (stable, DNS-safe)."""
    if HOSTNAME in labels:
        return labels[HOSTNAME]
    text = "-".join(f"{k}-{v}" for k, v in sorted(labels.items())).lower()
    safe = "".join(c if c.isalnum() else "-" for c in text).strip("-")
    return f"kwok-{safe}"[:63].rstrip("-")


def nodes_wanted(documents: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """Node name -> labels, one node per distinct requirement among the documents' Pods."""
    wanted: dict[str, dict[str, str]] = {}
    for spec in pod_specs(documents):
        labels = required_labels(spec)
        if labels:
            wanted[node_name(labels)] = labels
    return wanted


def node_ports(documents: Iterable[Mapping[str, Any]]) -> set[int]:
    """The fixed nodePorts the documents' Services claim (cluster-wide: two releases cannot share one)."""
    ports = set()
    for doc in documents:
        if doc and doc.get("kind") == "Service":
            for port in (doc.get("spec") or {}).get("ports") or []:
                if port.get("nodePort"):
                    ports.add(int(port["nodePort"]))
    return ports


def claims_wanted(documents: Iterable[Mapping[str, Any]]) -> set[str]:
    """Names of the claims the Pods mount that the documents do not create themselves."""
    mounted = {
        volume["persistentVolumeClaim"]["claimName"]
        for spec in pod_specs(documents)
        for volume in spec.get("volumes") or ()
        if volume.get("persistentVolumeClaim")
    }
    created = {
        (doc.get("metadata") or {}).get("name")
        for doc in documents
        if doc and doc.get("kind") == "PersistentVolumeClaim"
    }
    return mounted - created
