"""The network between real nodes (vllm_stack_dev.cluster.node): one segment for the node IPs, routes for
the Pod CIDRs, made only inside the nodes' own network namespaces.

Each node's namespace has a bridge (node.NODE_BRIDGE) carrying its node IP in 10.88.0.0/24 and a Pod CIDR
10.244.<index>.0/24 whose Pods hang off it by CNI `ptp` (a veth and a /32 route each). NodeNetwork.join
links a node to the first node joined (the hub) with a veth pair that the hub's namespace creates with its
other end already in the new node's namespace (`ip link add ... peer ... netns <PID>`, run under nsenter
in the hub's network namespace alone): both ends become ports of their node's bridge, so every node IP is
on one link-layer segment; a star through the hub's bridge, so no loop however many nodes join. Each node
then routes every other node's Pod CIDR via that node's IP. Nothing is added to the host's own network
namespace, and no node namespace gets a default route: nothing leaves them. A veth pair ends with either
namespace, so a stopped node's link goes with it; leave() removes the other nodes' routes to its Pods.

Pods reach Pods of another node by Pod IP without address translation (the CNI's `ipMasq` is off, and
kube-proxy masquerades only sources outside the cluster CIDR), and a Service's ClusterIP through the
client node's kube-proxy, which translates to the endpoint's Pod IP and back. One CoreDNS serves all
nodes (on the first node; kube-dns's endpoint is its node IP, which every node's kube-proxy leads to over
the link). Each node keeps its own registry mirror on its loopback, read-only over the same storage: the
mirror address is the same on every node, no image pull crosses the link or waits for another node, and
read-only servers over one storage cannot conflict (about 40 MB of memory per node).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.node import API_PORT_IN_NODE, NODE_BRIDGE, NodeError, RealNode

LINK_TIMEOUT = 30.0
HUB_PORT_PREFIX = "to-"  # the hub's end of a node's link: `to-<last octet of the node's IP>`
UPLINK = "uplink"  # the other end, in the joining node's namespace


def _in_network_namespace(node: RealNode, command: list[str]) -> list[str]:
    """``command`` in the node's network namespace only: PIDs stay the host's (`ip ... netns <PID>`)."""
    return ["nsenter", f"--target={node.init_pid}", "--net", "--", *command]


def _ip(node: RealNode, *args: str) -> None:
    """`ip ARGS` in the node's network namespace; a failure raises NodeError with what ip said."""
    command = _in_network_namespace(node, ["ip", *args])
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NodeError(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()}")


class NodeNetwork:
    """The links and routes between the real nodes it is given; join() each node after its start()."""

    def __init__(self) -> None:
        self.nodes: list[RealNode] = []

    def join(self, node: RealNode) -> None:
        """Link ``node`` to the hub (none for the first node), route the Pod CIDRs both ways, and wait
        until each side opens a TCP connection to the other's node IP (the API relay's port). The node is
        a member from the first step, so that leave() undoes a join that failed half-way."""
        others = list(self.nodes)
        self.nodes.append(node)
        if others:
            hub = others[0]
            port = HUB_PORT_PREFIX + node.ip.rpartition(".")[2]
            _ip(hub, "link", "add", port, "type", "veth", "peer", "name", UPLINK, "netns", str(node.init_pid))
            _ip(hub, "link", "set", port, "master", NODE_BRIDGE, "up")
            _ip(node, "link", "set", UPLINK, "master", NODE_BRIDGE, "up")
        for other in others:
            _ip(other, "route", "replace", node.pod_cidr, "via", node.ip)
            _ip(node, "route", "replace", other.pod_cidr, "via", other.ip)
        for other in others:
            _wait_connects(other, node)
            _wait_connects(node, other)

    def leave(self, node: RealNode) -> None:
        """Remove the other nodes' routes to ``node``'s Pods and, when it is not the hub, its link (the hub's
        namespace ending takes every link with it: the hub leaves last)."""
        if node not in self.nodes:
            return
        hub = self.nodes[0]
        self.nodes.remove(node)
        for other in self.nodes:
            subprocess.run(_in_network_namespace(other, ["ip", "route", "del", node.pod_cidr]),
                           capture_output=True, timeout=30)  # fmt: skip
        if node is not hub and hub.init_pid:
            port = HUB_PORT_PREFIX + node.ip.rpartition(".")[2]
            subprocess.run(_in_network_namespace(hub, ["ip", "link", "del", port]), capture_output=True,
                           timeout=30)  # fmt: skip


def _wait_connects(source: RealNode, target: RealNode, timeout: float = LINK_TIMEOUT) -> None:
    """Until a TCP connection from ``source``'s namespace to ``target``'s node IP opens (its API relay
    listens on every address of its namespace)."""
    probe = _in_network_namespace(source, ["bash", "-c", f"exec 3<>/dev/tcp/{target.ip}/{API_PORT_IN_NODE}"])
    deadline = time.monotonic() + timeout
    while subprocess.run(probe, capture_output=True, timeout=timeout).returncode != 0:
        if time.monotonic() > deadline:
            raise NodeError(
                f"{source.name} ({source.ip}) could not connect to {target.name} ({target.ip}:"
                f"{API_PORT_IN_NODE}) over their link within {timeout:.0f} s"
            )
        time.sleep(0.2)


@contextlib.contextmanager
def linked_node(
    cluster: Cluster,
    network: NodeNetwork,
    workdir: Path,
    index: int,
    say: Callable[[str], None] = lambda _: None,
) -> Iterator[RealNode]:
    """`node-<index>` started, joined to ``network``, with kube-proxy. The network's first node runs the one
    CoreDNS (start_dns); a later node's Pods reach it through their own kube-proxy (kube-dns's endpoint is
    the first node's IP) over the link, so this waits for those rules. On leaving, also on error: the link
    and routes removed, then the node stopped."""
    with contextlib.ExitStack() as running:
        node = running.enter_context(RealNode(cluster, workdir, f"node-{index}", index))
        node.start(say=say)
        running.callback(network.leave, node)
        network.join(node)
        node.start_kube_proxy()
        if network.nodes[0] is node:
            node.start_dns()
        else:
            node.wait_proxied("kube-system/kube-dns:dns", network.nodes[0].ip)
        yield node


@contextlib.contextmanager
def running_real_nodes(
    cluster: Cluster, folder: Path, count: int, say: Callable[[str], None] = lambda _: None
) -> Iterator[list[RealNode]]:
    """``count`` real nodes `node-<i>` (workdirs `folder/node-<i>`), one after another, linked by one
    NodeNetwork (linked_node); all stopped on leaving, the last started first, also on error."""
    network = NodeNetwork()
    with contextlib.ExitStack() as running:
        nodes = [running.enter_context(linked_node(cluster, network, folder / f"node-{index}", index, say))
                 for index in range(count)]  # fmt: skip
        yield nodes
