"""production-stack's tutorial 19 (sleep mode): its values render with NOTES that say how to reach the
router's /sleep, /wake_up and /is_sleeping and whether they are open; without VLLM_SERVER_DEV_MODE=1 the
deviation says the engines serve none of them (docs/sleep.md)."""

from __future__ import annotations

import copy

import pytest

from tests.helm.chart import find
from tests.helm.test_production_stack_files import compat_lines, load, manifest_and_notes

pytestmark = pytest.mark.helm

TUTORIAL_19 = "tutorials__values-19-sleep-mode-aware.yaml"


def _sleep_notes(notes: list[str]) -> list[str]:
    start = next(i for i, line in enumerate(notes) if line.startswith("Sleep mode ("))
    return notes[start : start + 4]


def test_tutorial_19_renders_and_notes_say_the_endpoints_are_open_without_admin_keys():
    objs, notes = manifest_and_notes(load(TUTORIAL_19))
    said = "\n".join(_sleep_notes(notes))
    assert "granite: --enable-sleep-mode" in said and "/sleep?id=ENGINE_ID" in said
    assert "OPEN to anyone" in said and "routerSpec.adminApiKeysSecret" in said
    (text,) = [t for p, t in compat_lines(notes).items() if any("extraArgs" in k for k in p)]
    assert "the router forwards /sleep, /wake_up and /is_sleeping" in text
    # the Role stays list and watch: the router labels no pod
    (role,) = find(objs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


@pytest.mark.parametrize(
    ("key", "said_needed"),
    [
        ("adminApiKeysSecret", "need an admin key"),
        ("apiKeysSecret", "need a client key (routerSpec.apiKeysSecret)"),  # client keys, no admin keys
    ],
)
def test_with_admin_or_client_keys_the_notes_ask_for_one(key: str, said_needed: str):
    values = copy.deepcopy(load(TUTORIAL_19))
    values["routerSpec"] = {key: {"secretName": "keys", "secretKey": "keys"}}
    _, notes = manifest_and_notes(values)
    said = "\n".join(_sleep_notes(notes))
    assert said_needed in said and "OPEN" not in said


def test_sleep_mode_without_the_dev_endpoints_is_said_to_break():
    values = copy.deepcopy(load(TUTORIAL_19))
    values["servingEngineSpec"]["modelSpec"][0]["env"] = []
    _, notes = manifest_and_notes(values)
    (text,) = [t for p, t in compat_lines(notes).items() if any("extraArgs" in k for k in p)]
    assert "without VLLM_SERVER_DEV_MODE=1" in text and "404 engine_refused" in text
