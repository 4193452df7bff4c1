"""Imports run one way: api -> director -> scheduling / relay -> engines -> config (and the small
shared modules below them), the server knows nothing of routing, and development tooling stays out
of the router's runtime import graph. Inside a part, too, no modules import each other in a circle:
where a lower module needs to call back into the one that uses it, it names what it needs as a
protocol of its own (as ``relay.leg.LegRequest`` does). Checked on the source (every import, those
under ``TYPE_CHECKING`` and inside functions included, so not even the type hints make a circle) and on
a running interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "router" / "vllm_stack"

#: Layer of each top-level part of the package: a module may import its own part and lower layers.
#: Parts on one layer are peers and may not import each other (scheduling and relay, engines and server).
LAYERS = {
    "cli": 9,  # the console script: `router` or, lazily, the development commands
    "router_cli": 8,  # flags, process set-up
    "app": 7,  # assembly
    "epp": 6.5,  # the endpoint picker: the API layer's parsing and the director, for a gateway
    "batch": 6.5,  # the Batch API: the API layer's parsing and the director, for lines of files
    "api": 6,
    "director": 5,
    "scheduling": 4,
    "relay": 4,
    "telemetry": 4,
    "tracing": 4,
    "engines": 3,
    "server": 3,
    "extproc": 2,  # Envoy's ext_proc messages as the Inference Extension uses them
    "config": 1,
    "settings": 0.5,  # every setting's declaration, by group (config reads files and flags into them)
    "tenants": 0.4,  # who sent a request, and the declared tenants (read by settings, api, director)
    "metrics": 1,
    "errors": 1,
    "endpoint_table": 0,  # the router's paths and what it does with each: read by every layer above
    "priority": 0,
    "json_depth": 0,
    "request_id": 0,
    "log_format": 0,  # the log lines' formatter (text or JSON), set up by the command line
    "version": 0,
}


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            if node.module == "vllm_stack":
                found += [f"vllm_stack.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def _own_module(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("__")}
    parts = {p for p in parts if (PACKAGE / p).is_dir() or (PACKAGE / f"{p}.py").exists()}
    assert parts - {"py"} <= set(LAYERS), f"parts without a layer: {sorted(parts - set(LAYERS))}"


def test_imports_run_one_way() -> None:
    wrong: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _own_module(path)
        my_part = _part(me)
        if not my_part:
            continue
        for target in _imports(path):
            if target.startswith("vllm_stack_dev"):
                if my_part != "cli":
                    wrong.append(f"{me} imports development tooling {target}")
                continue
            if not target.startswith("vllm_stack."):
                continue
            part = _part(target)
            if part == my_part:
                continue
            if LAYERS[part] >= LAYERS[my_part]:
                wrong.append(
                    f"{me} ({my_part}, layer {LAYERS[my_part]}) imports {target} (layer {LAYERS[part]})"
                )
    assert not wrong, "imports against the direction:\n" + "\n".join(wrong)


def _module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports (a submodule named in
    ``from package import name`` counts as that submodule)."""
    modules = {_own_module(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    named = f"{node.module}.{alias.name}"
                    if named in modules:
                        targets.add(named)
                    elif node.module in modules:
                        targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in modules}
        graph[module] = targets - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.append(member)
                    if member == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_no_circles_inside_a_part() -> None:
    circles = _circles(_module_graph())
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(
        " <-> ".join(circle) for circle in circles
    )


def test_the_circle_check_finds_a_circle() -> None:
    """The check itself: a circle of three and one of two are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"d"}}
    assert _circles(graph) == [["a", "b", "c"], ["e", "f"]]


def test_the_router_runtime_loads_no_development_tooling() -> None:
    code = (
        "import sys, contextlib, io\n"
        "import vllm_stack.app, vllm_stack.router_cli, vllm_stack.cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    vllm_stack.cli.main(['router', '--help'])\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm_stack_dev')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
