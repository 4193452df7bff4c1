"""The `node` tier (opt in: `make test-node`): one real node, a kubelet and containerd with runc and CNI in
namespaces of their own (vllm_stack_dev.cluster.node), joined to a control plane of its own. Every test
module here sets `pytestmark = pytest.mark.node`.

The control plane keeps one kwok node, tainted so that nothing is scheduled there: every Pod of these tests
runs on the real node. The node and the control plane are stopped at the end of the package, also when a
test fails or the session is interrupted (the node's processes also die with this process).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_stack_dev.cluster.control_plane import Cluster, ClusterOptions, running_cluster
from vllm_stack_dev.cluster.node import RealNode
from vllm_stack_dev.cluster.node_network import NodeNetwork, linked_node
from vllm_stack_dev.gotools import control_plane_binaries, node_binaries

KWOK_TAINT = "vllm-stack.dev/kwok=true:NoSchedule"


@pytest.fixture(scope="package")
def node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, RealNode]]:
    wanted = {**control_plane_binaries(), **node_binaries()}
    missing = [name for name, path in wanted.items() if not path.is_file()]
    if missing:
        pytest.fail(f"binaries missing ({', '.join(missing)}): run `make install`", pytrace=False)
    options = ClusterOptions(workdir=tmp_path_factory.mktemp("node-cluster"), nodes=1, crds_dir=None)
    with running_cluster(options) as cluster:
        cluster.kubectl("taint", "node", "kwok-node-0", KWOK_TAINT)
        node = RealNode(cluster, tmp_path_factory.mktemp("node-0"))
        with node:
            node.start()
            node.start_kube_proxy()
            node.start_dns()
            yield cluster, node


@pytest.fixture(scope="module")
def two_node_cluster(
    node_cluster: tuple[Cluster, RealNode], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, list[RealNode]]]:
    """node_cluster's control plane and node-0 (its CoreDNS is the one both nodes use), and node-1 for the
    module that asks: 10.88.0.3, Pods in 10.244.1.0/24, linked to node-0 by a NodeNetwork, kube-proxy of
    its own. At the module's end the Pods bound to node-1 are deleted, its link and route removed and it is
    stopped (also when a test fails), so the package's later modules find node_cluster as it was."""
    cluster, first = node_cluster
    network = NodeNetwork()
    network.join(first)
    with linked_node(cluster, network, tmp_path_factory.mktemp("node-1"), index=1) as second:
        try:
            yield cluster, [first, second]
        finally:
            cluster.kubectl("delete", "pods", "--all-namespaces", "--field-selector",
                            f"spec.nodeName={second.name}", "--force", "--grace-period=0", check=False)  # fmt: skip
