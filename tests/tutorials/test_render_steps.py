"""Every tutorial's `render` step, run as written (helm template over the tutorial's values file and the
greps it shows), in the fast tier: what it prints is checked by tests/tutorials/render_checks.py, the same
checks the engine-tier tutorial runs apply. No engine, no cluster: only the scratch folder is the test's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tutorials.render_checks import CHECKS, check_render
from tests.tutorials.runner import ROOT, TutorialRun, tutorial_env

pytestmark = pytest.mark.helm

TUTORIALS = sorted(p.name for p in (ROOT / "tutorials").glob("*.md"))


def test_every_tutorial_has_a_render_step_and_its_check():
    with_render = {name for name in TUTORIALS if "step=render" in (ROOT / "tutorials" / name).read_text()}
    assert with_render == set(CHECKS) == set(TUTORIALS)


@pytest.mark.parametrize("name", TUTORIALS)
def test_the_render_step_prints_what_the_tutorial_shows(name: str, tmp_path: Path) -> None:
    tutorial = TutorialRun(
        ROOT / "tutorials" / name,
        replacements={"/tmp/vllm-stack-tutorial": str(tmp_path / "scratch")},
        env=tutorial_env(),
        port=0,
        log_dir=tmp_path,
    )
    assert tutorial.names[0] == "render"
    check_render(name, tutorial.run_step("render"))
