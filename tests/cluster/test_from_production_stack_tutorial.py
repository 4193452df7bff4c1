"""Tutorial 10 (from production-stack: `helm upgrade` in place, and back) run as written on the test cluster.

Its marked steps run in order with the cluster's kubeconfig and kubectl on PATH, as a reader's shell would
have them after `vllm-stack cluster up` (the cluster is this package's; the tutorial says so); only the
scratch folder is the test's. What each step printed is checked: the two charts' renderings agree on the
Services, claims and Secrets; after the upgrade and after the rollback the same objects (names, UIDs,
bound volumes) are there, with the router Service's client port, and Helm records the three revisions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.releases import Helm

from tests import shared_data
from tests.tutorials.render_checks import check_render
from tests.tutorials.runner import ROOT, TutorialRun, tutorial_env

pytestmark = pytest.mark.cluster

TUTORIAL = ROOT / "tutorials" / "10-from-production-stack.md"
NAMESPACE = "tutorial"  # the tutorial's own


def test_the_tutorial_upgrades_production_stacks_release_in_place_and_back(
    cluster: Cluster, tmp_path: Path
) -> None:
    shared_data.require(shared_data.PS_CHART)
    env = tutorial_env(KUBECONFIG=str(cluster.kubeconfig))
    env["PATH"] = f"{cluster.binaries['kubectl'].parent}:{env['PATH']}"
    run = TutorialRun(
        TUTORIAL,
        replacements={"/tmp/vllm-stack-tutorial": str(tmp_path / "scratch")},
        env=env,
        port=0,
        log_dir=tmp_path,
    )
    assert run.names == ["render", "install", "upgrade", "rollback"]
    try:
        check_render(TUTORIAL.name, run.run_step("render"))
        installed = run.run_step("install").splitlines()  # Helm's NOTES, then what the release holds
        before = installed[next(i for i, line in enumerate(installed) if line.startswith("KIND ")) :]
        assert [line.split()[:2] for line in before[1:]] == [  # sorted by name across kinds
            ["Service", "vllm-llama3-engine-service"],
            ["PersistentVolumeClaim", "vllm-llama3-storage-claim"],
            ["Service", "vllm-router-service"],
            ["KIND", "NAME"],
            ["Secret", "vllm-secrets"],
        ], before
        assert before[2].split()[3].startswith("pvc-"), before  # bound to a provisioned volume

        upgraded = run.run_step("upgrade").splitlines()  # Helm's NOTES (this chart's deviations), then
        assert "Deviations: what this chart did differently" in "\n".join(upgraded)
        assert upgraded[-3:] == [
            "the same Services, claims (same volumes) and Secrets",
            "router-sport 80",
            "  status: deployed\tversion: 2",
        ], upgraded

        back = run.run_step("rollback").splitlines()[-4:]  # after Helm's "Rollback was a success!"
        assert back[0] == "production-stack's release again, the same objects", back
        history = [line.split() for line in back[1:]]
        assert history == [
            ["chart:", "vllm-stack-0.1.12", "revision:", "1", "status:", "superseded"],
            ["chart:", "vllm-stack-0.1.0", "revision:", "2", "status:", "superseded"],
            ["chart:", "vllm-stack-0.1.12", "revision:", "3", "status:", "deployed"],
        ], back
    finally:
        Helm(cluster, 4).run("uninstall", "vllm", "-n", NAMESPACE, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", "--ignore-not-found", check=False)
