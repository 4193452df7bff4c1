"""The `cluster` tier: a real control plane (etcd, kube-apiserver, controller manager, scheduler) built
from Go modules by `make install`, with kwok in place of kubelets, started once for this package's tests.

Every test module here is marked `cluster` (in `make test` and CI, not in `make test-fast`).

The control plane lives as long as this package's tests, not the whole session: left running, its five
processes (0.4-0.7 GB used beside the cases, sampled every 15 s), the kwok nodes' heartbeats and the
namespace deletions the cases leave behind would share the two cores with the engine tier after it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_stack_dev.cluster.control_plane import Cluster, ClusterOptions, running_cluster
from vllm_stack_dev.gotools import control_plane_binaries

from tests import shared_data


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    missing = [name for name, path in control_plane_binaries().items() if not path.is_file()]
    if missing:
        pytest.fail(
            f"control-plane binaries missing ({', '.join(missing)}): run `make install`", pytrace=False
        )
    options = ClusterOptions(
        workdir=tmp_path_factory.mktemp("cluster"), crds_dir=shared_data.require(shared_data.CRDS)
    )
    with running_cluster(options) as cluster:
        yield cluster


@pytest.fixture(scope="package")
def scaling_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A second control plane for the tests that change the control plane itself (its API server is
    restarted, a Role edited under a running router) or need it fast: the HPA controller syncs every
    second, and the API server keeps no watch cache, so that a watch from a compacted resourceVersion
    meets etcd's compaction (410 Gone) as an API server without a cache answers it."""
    options = ClusterOptions(
        workdir=tmp_path_factory.mktemp("scaling-cluster"),
        crds_dir=shared_data.require(shared_data.CRDS),
        nodes=1,
        hpa_sync_period="1s",
        watch_cache=False,
    )
    with running_cluster(options) as cluster:
        yield cluster
