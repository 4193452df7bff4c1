"""How make install builds Go tools: the wrapper module's go.mod, binary names, version stamps, the stamp."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_stack_dev import gotools
from vllm_stack_dev.gotools import GoTool


def _tool(**fields: object) -> GoTool:
    defaults: dict[str, object] = {
        "name": "demo", "module": "example.com/demo", "version": "v1.37.2",
        "binaries": (("demo", "example.com/demo/cmd/demo"),),
    }  # fmt: skip
    return GoTool(**{**defaults, **fields})  # type: ignore[arg-type]


def test_a_published_replace_is_kept_and_a_local_one_dropped() -> None:
    upstream = {
        "Go": "1.26.0",
        "GoDebug": [{"Key": "x509negativeserial", "Value": "1"}],
        "Require": [{"Path": "example.com/api", "Version": "v3.6.17"}],
        "Replace": [
            {"Old": {"Path": "example.com/api"}, "New": {"Path": "../api"}},
            {"Old": {"Path": "example.com/fork", "Version": "v1.0.0"},
             "New": {"Path": "example.com/fork", "Version": "v1.0.1"}},
        ],
    }  # fmt: skip
    go_mod = gotools._wrapper_go_mod(_tool(), upstream)
    assert "go 1.26.0" in go_mod
    assert "godebug x509negativeserial=1" in go_mod
    assert "require example.com/demo v1.37.2" in go_mod
    assert "\texample.com/fork v1.0.0 => example.com/fork v1.0.1" in go_mod
    assert "../api" not in go_mod and "example.com/api =>" not in go_mod


def test_staging_modules_at_v0_0_0_are_replaced_by_their_published_version() -> None:
    upstream = {
        "Require": [
            {"Path": "k8s.io/api", "Version": "v0.0.0"},
            {"Path": "github.com/other/lib", "Version": "v0.0.0"},
        ],
        "Replace": [{"Old": {"Path": "k8s.io/api"}, "New": {"Path": "./staging/src/k8s.io/api"}}],
    }
    go_mod = gotools._wrapper_go_mod(_tool(staging_version="v0.37.2"), upstream)
    assert "\tk8s.io/api => k8s.io/api v0.37.2" in go_mod
    assert "github.com/other/lib =>" not in go_mod  # not replaced upstream: left to its requirement
    assert "./staging" not in go_mod


@pytest.mark.parametrize(
    ("package", "name"),
    [("k8s.io/kubernetes/cmd/kube-apiserver", "kube-apiserver"), ("go.etcd.io/etcd/server/v3", "server")],
)
def test_binary_names_follow_go_build(package: str, name: str) -> None:
    assert gotools._default_binary_name(package) == name


def test_version_ldflags_are_filled_from_the_version_and_publication_time() -> None:
    flags = [
        gotools._fill(flag, gotools.KUBERNETES, "2026-11-20T10:00:00Z") for flag in gotools.KUBERNETES.ldflags
    ]
    assert "-X k8s.io/component-base/version.gitVersion=v1.37.2" in flags
    assert "-X k8s.io/client-go/pkg/version.gitMinor=37" in flags
    assert "-X k8s.io/component-base/version.buildDate=2026-11-20T10:00:00Z" in flags


def test_a_stamp_of_another_recipe_means_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gotools, "tools_dir", lambda: tmp_path)
    tool = _tool()
    tool.bin_dir.mkdir(parents=True)
    tool.binary("demo").write_text("")
    assert not gotools.is_installed(tool)  # no stamp: an interrupted build
    (tool.folder / gotools.STAMP_NAME).write_text(tool.recipe())
    assert gotools.is_installed(tool)
    (tool.folder / gotools.STAMP_NAME).write_text(_tool(ldflags=("-s",)).recipe())
    assert not gotools.is_installed(tool)
    (tool.folder / gotools.STAMP_NAME).write_text(tool.recipe())
    tool.binary("demo").unlink()
    assert not gotools.is_installed(tool)


def test_a_tool_that_fails_to_build_does_not_stop_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd failing must still leave Kubernetes and kwok built; the error names what failed."""
    monkeypatch.setattr(gotools, "tools_dir", lambda: tmp_path)
    tried: list[str] = []

    def build(tool: GoTool) -> None:
        tried.append(tool.name)
        if tool.name == "broken":
            raise gotools.GoBuildError("go build failed: no such module")

    monkeypatch.setattr(gotools, "build_tool", build)
    with pytest.raises(gotools.GoBuildError) as failure:
        gotools.install_tools([_tool(name="broken"), _tool(name="fine")])
    assert tried == ["broken", "fine"]
    assert "broken v1.37.2: go build failed: no such module" in str(failure.value)
    assert "built: fine v1.37.2" in str(failure.value)


def test_tools_of_one_build_group_missing_together_are_built_by_one_go_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node tier's kubelet and kube-proxy join the control plane's `go build` when both are missing;
    tools without a group (or of another module) are built alone, in the order given."""
    monkeypatch.setattr(gotools, "tools_dir", lambda: tmp_path)
    builds: list[list[str]] = []
    monkeypatch.setattr(gotools, "build_tool", lambda tool: builds.append([tool.name]))
    monkeypatch.setattr(gotools, "build_tools_together", lambda tools: builds.append([t.name for t in tools]))
    gotools.install_tools((gotools.ETCD, gotools.KUBERNETES, gotools.KWOK, *gotools.NODE_TOOLS))
    assert builds == [["etcd"], ["kubernetes", "kubernetes-node"], ["kwok"], ["coredns"]]
    builds.clear()
    gotools.install_tools([_tool(name="a"), _tool(name="b")])  # same module, no group: one build each
    assert builds == [["a"], ["b"]]


def test_the_default_install_builds_the_node_tools_with_the_control_plane() -> None:
    """`make install` builds the node tier's tools (`make test` runs its reduced set): the kubelet and
    kube-proxy come after the control plane's Kubernetes in TEST_TOOLS, so install_tools builds them in its
    `go build` on a cold cache; their stamp stays a tool of its own."""
    names = [tool.name for tool in gotools.TEST_TOOLS]
    assert {tool.name for tool in gotools.NODE_TOOLS} <= set(names)
    assert names.index("kubernetes") < names.index("kubernetes-node")
    assert gotools.KUBERNETES_NODE.recipe() != gotools.KUBERNETES.recipe()
    assert "build_group" not in gotools.KUBERNETES.recipe()  # the default stamp is unchanged
