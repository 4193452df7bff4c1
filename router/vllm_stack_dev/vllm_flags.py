"""Which vLLM release first parses each engine flag the chart can render: helm/files/vllm-flags.yaml.

Derived from vLLM's own sources, release by release, by reading (never running) the argument parser of
`vllm serve`: the `make_arg_parser` that the serve command imports, the `add_cli_args` methods it reaches
(EngineArgs, AsyncEngineArgs, FrontendArgs...), and the config dataclasses whose fields become flags
through `get_kwargs` (a bool field there gives `--X` and `--no-X`). The engine environment variables come
from `vllm/envs.py` (its `environment_variables` table). Reading the code, instead of importing each
release (0.6 does not import with today's torch and triton), lets one Python read every release;
`--check-installed` compares the reading with the real parser of an installed vLLM (0.32.0 in
.venv-engine: the same 405 options).

Not run in CI (CI has no vLLM sources). By hand, with either source of releases:

    .venv/bin/python -m vllm_stack_dev.vllm_flags --mirror PATH/TO/vllm.git      # tags vX.Y.Z, git show
    .venv/bin/python -m vllm_stack_dev.vllm_flags --wheels DIR [--download]      # DIR/<version>/vllm/...

`--download` fills DIR with the Python files of every vLLM release from 0.6.0 on, fetched from PyPI with
`pip download --no-deps` (the wheels are built from the release tags; each wheel is deleted once its
`vllm/**/*.py` is unpacked). The table keeps the flags, variables and notes it already lists
(`--add=--x,VLLM_Y` names more) and gets each one's first release and, where the newest lacks it, its last.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import functools
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from packaging.version import Version

from vllm_stack_dev.paths import engine_python, repo_root

TABLE = repo_root() / "helm" / "files" / "vllm-flags.yaml"
FIRST = Version("0.6.0")
SERVE_FILES = ("vllm/entrypoints/cli/serve.py", "vllm/scripts.py")  # 0.8 on, before 0.8
ENVS = "vllm/envs.py"


# --- the sources of one release ------------------------------------------------------------------------


class Tree:
    """The files of one vLLM release."""

    def read(self, path: str) -> str | None:
        raise NotImplementedError

    def py_files(self) -> list[str]:
        raise NotImplementedError


@dataclass
class DirTree(Tree):
    """A folder holding `vllm/` as unpacked from the release's wheel."""

    root: Path

    def read(self, path: str) -> str | None:
        p = self.root / path
        return p.read_text(errors="replace") if p.is_file() else None

    @functools.cache  # noqa: B019 - one tree per release, kept for the whole run
    def py_files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in (self.root / "vllm").rglob("*.py"))

    def __hash__(self) -> int:
        return hash(self.root)


@dataclass
class GitTree(Tree):
    """A release tag of a vLLM git mirror (bare or not), read with git show."""

    git_dir: Path
    tag: str

    def read(self, path: str) -> str | None:
        proc = subprocess.run(
            ["git", "--git-dir", str(self.git_dir), "show", f"{self.tag}:{path}"],
            capture_output=True,
            text=True,
            errors="replace",
        )
        return proc.stdout if proc.returncode == 0 else None

    @functools.cache  # noqa: B019
    def py_files(self) -> list[str]:
        out = subprocess.run(
            ["git", "--git-dir", str(self.git_dir), "ls-tree", "-r", "--name-only", self.tag, "vllm/"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [p for p in out.splitlines() if p.endswith(".py")]

    def __hash__(self) -> int:
        return hash((self.git_dir, self.tag))


def mirror_releases(git_dir: Path) -> dict[Version, Tree]:
    tags = subprocess.run(
        ["git", "--git-dir", str(git_dir), "tag"], capture_output=True, text=True, check=True
    ).stdout.split()
    out = {}
    for tag in tags:
        if re.fullmatch(r"v\d+\.\d+\.\d+(\.\d+)?(\.post\d+)?", tag) and Version(tag) >= FIRST:
            out[Version(tag)] = GitTree(git_dir, tag)
    return dict(sorted(out.items()))


def wheel_releases(folder: Path) -> dict[Version, Tree]:
    out = {}
    for d in folder.iterdir():
        if (d / "vllm").is_dir() and Version(d.name) >= FIRST:
            out[Version(d.name)] = DirTree(d)
    return dict(sorted(out.items()))


def pypi_versions(python: str) -> list[str]:
    text = subprocess.run(
        [python, "-m", "pip", "index", "versions", "vllm"], capture_output=True, text=True, check=True
    ).stdout
    listed = text.split("Available versions:", 1)[1].splitlines()[0]
    versions = [v.strip() for v in listed.split(",") if v.strip()]
    return sorted((v for v in versions if Version(v) >= FIRST and not Version(v).is_prerelease), key=Version)


def download(folder: Path, python: str = sys.executable) -> None:
    """Unpack `vllm/**/*.py` of every release from 0.6.0 into folder/<version>/ (one wheel at a time)."""
    for v in pypi_versions(python):
        target = folder / v
        if (target / "vllm").is_dir():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [
                    python,
                    "-m",
                    "pip",
                    "download",
                    f"vllm=={v}",
                    "--no-deps",
                    "--only-binary=:all:",
                    "-q",
                    "-d",
                    tmp,
                ],
                check=True,
            )
            (wheel,) = Path(tmp).glob("*.whl")
            with zipfile.ZipFile(wheel) as z:
                z.extractall(target, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
        print(f"{v}: unpacked", file=sys.stderr)


# --- one release's parser, read statically ---------------------------------------------------------------


@dataclass
class ClassDef:
    node: ast.ClassDef
    module: Module


@dataclass
class Module:
    """A parsed file and what its names are imported from."""

    path: str
    tree: ast.Module
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name)

    @classmethod
    def parse(cls, path: str, text: str) -> Module:
        tree = ast.parse(text)
        mod = cls(path, tree)
        package = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        if not path.endswith("__init__.py"):
            package = package.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for alias in node.names:
                    mod.imports[alias.asname or alias.name] = (base, alias.name)
        return mod

    def classes(self) -> dict[str, ast.ClassDef]:
        return {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}

    def function(self, name: str) -> ast.FunctionDef | None:
        return next((n for n in self.tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_bool_action(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute | ast.Name) and ast.unparse(node).endswith("BooleanOptionalAction")


class Release:
    """The option strings `vllm serve` of one release accepts, read from its sources."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self._modules: dict[str, Module | None] = {}
        self.options: set[str] = set()
        self.notes: list[str] = []
        self.files: set[str] = set()  # the files whose parser code was read

    # -- files and names --

    def module(self, dotted: str) -> Module | None:
        if dotted not in self._modules:
            self._modules[dotted] = None
            base = dotted.replace(".", "/")
            for path in (f"{base}.py", f"{base}/__init__.py"):
                text = self.tree.read(path)
                if text is not None:
                    self._modules[dotted] = Module.parse(path, text)
                    break
        return self._modules[dotted]

    def file_module(self, path: str) -> Module | None:
        return self.module(path.removesuffix(".py").removesuffix("/__init__").replace("/", "."))

    def find_class(self, name: str, where: Module, depth: int = 0) -> ClassDef | None:
        """A class as `where` sees the name: defined there, or imported (re-exports followed)."""
        if name in where.classes():
            return ClassDef(where.classes()[name], where)
        if name in where.imports and depth < 8:
            source, real = where.imports[name]
            mod = self.module(source)
            if mod is not None:
                return self.find_class(real, mod, depth + 1)
        return self._class_anywhere(name)

    @functools.cache  # noqa: B019 - per Release
    def _class_anywhere(self, name: str) -> ClassDef | None:
        pattern = re.compile(rf"^class {re.escape(name)}\b", re.M)
        found = []
        for path in self.tree.py_files():
            text = self.tree.read(path) or ""
            if pattern.search(text):
                mod = self.file_module(path)
                if mod is not None and name in mod.classes():
                    found.append(ClassDef(mod.classes()[name], mod))
        if len(found) != 1:
            return None
        return found[0]

    def bases(self, cls: ClassDef) -> list[ClassDef]:
        out = []
        for b in cls.node.bases:
            name = ast.unparse(b).split("[")[0].split(".")[-1]
            found = self.find_class(name, cls.module)
            if found is not None:
                out.append(found)
        return out

    def fields(self, cls: ClassDef) -> dict[str, str]:
        """Dataclass fields (inherited first) and their annotations, as dataclasses.fields would list them."""
        out: dict[str, str] = {}
        for base in reversed(self.bases(cls)):
            out.update(self.fields(base))
        for stmt in cls.node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                ann = ast.unparse(stmt.annotation)
                if not re.match(r"(typing\.)?(ClassVar|InitVar)\b", ann):
                    out[stmt.target.id] = ann
        return out

    def method(self, cls: ClassDef, name: str) -> tuple[ast.FunctionDef, ClassDef] | None:
        for stmt in cls.node.body:
            if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
                return stmt, cls
        for base in self.bases(cls):
            found = self.method(base, name)
            if found:
                return found
        return None

    # -- get_kwargs --

    @functools.cached_property
    def get_kwargs_source(self) -> str:
        """The source of arg_utils' get_kwargs (and _compute_kwargs), wherever it is defined in the file."""
        mod = self.module("vllm.engine.arg_utils")
        if mod is None:
            return ""
        return "\n".join(
            ast.unparse(n)
            for n in ast.walk(mod.tree)
            if isinstance(n, ast.FunctionDef) and n.name in ("get_kwargs", "_compute_kwargs")
        )

    def bool_field(self, annotation: str) -> bool:
        """Whether get_kwargs makes this field a BooleanOptionalAction (--X and --no-X)."""
        src = self.get_kwargs_source
        if "BooleanOptionalAction" not in src or not re.search(r"\bbool\b", annotation):
            return False
        names = set(re.findall(r"\b(bool|str|None|Optional|Union)\b", annotation))
        optional_valued = "type_hints == {bool, str, type(None)}" in src
        if optional_valued and {"bool", "str"} <= names and ("None" in names or "Optional" in names):
            others = set(re.findall(r"\b[A-Za-z_][\w.]*\b", annotation)) - {
                "bool",
                "str",
                "None",
                "Optional",
                "Union",
            }
            if not others:
                return False  # bare flag -> True, value -> str: no --no-X
        return True

    # -- walking the parser --

    def analyse(self) -> Release:
        serve = next((p for p in SERVE_FILES if self.tree.read(p) is not None), None)
        if serve is None:
            raise SystemExit(f"{self.tree}: no serve command ({', '.join(SERVE_FILES)})")
        serve_mod = self.file_module(serve)
        self.files.add(serve)
        assert serve_mod is not None
        # the serve subparser's own arguments (model_tag, --config in the early releases)
        for node in ast.walk(serve_mod.tree):
            if isinstance(node, ast.Call) and self._add_argument_on(node, "serve"):
                self._record(node, {}, None)
        source, real = serve_mod.imports.get("make_arg_parser", ("", ""))
        mod = self.module(source) if source else None
        func = mod.function(real) if mod else None
        if func is None:
            raise SystemExit(f"{serve}: make_arg_parser not found")
        self._walk_function(func, mod, None, {})
        return self

    @staticmethod
    def _add_argument_on(call: ast.Call, receiver_word: str | None) -> bool:
        f = call.func
        if not (isinstance(f, ast.Attribute) and f.attr == "add_argument"):
            return False
        return receiver_word is None or receiver_word in ast.unparse(f.value)

    def _walk_function(self, func: ast.FunctionDef, mod: Module, cls: ClassDef | None, seen: dict) -> None:
        key = (mod.path, func.name, cls.node.name if cls else None)
        if key in seen:
            return
        seen[key] = True
        self.files.add(mod.path)
        kwargs_of = self._kwargs_vars(func, mod, cls)
        overrides = self._action_overrides(func, cls, mod)
        loops = {}
        for node in ast.walk(func):
            if isinstance(node, ast.For) and isinstance(node.iter, ast.Call):
                it = ast.unparse(node.iter.func)
                if it.endswith(".items") and it.removesuffix(".items") in kwargs_of:
                    for inner in ast.walk(node):
                        if isinstance(inner, ast.Call):
                            loops[id(inner)] = it.removesuffix(".items")
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            if self._add_argument_on(node, None):
                var = loops.get(id(node))
                if var is not None and any(isinstance(a, ast.JoinedStr) for a in node.args):
                    target, deleted = kwargs_of[var]
                    if target is None:
                        self.notes.append(f"{mod.path}: a loop over {var} of an unknown class")
                        continue
                    for name, ann in self.fields(target).items():
                        if name in deleted:
                            continue
                        flag = "--" + name.replace("_", "-")
                        self.options.add(flag)
                        action = overrides.get(name)
                        if (action is None and self.bool_field(ann)) or action == "bool":
                            self.options.add("--no-" + flag[2:])
                else:
                    self._record(node, kwargs_of, overrides)
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "add_cli_args":
                self._follow_add_cli_args(node, mod, cls, seen)

    def _follow_add_cli_args(self, call: ast.Call, mod: Module, cls: ClassDef | None, seen: dict) -> None:
        owner = call.func.value  # type: ignore[attr-defined]
        text = ast.unparse(owner)
        if text.startswith("super(") and cls is not None:
            for base in self.bases(cls):
                found = self.method(base, "add_cli_args")
                if found:
                    fn, where = found
                    self._walk_function(fn, where.module, cls, seen)
            return
        if text == "cls" and cls is not None:
            target = cls
        else:
            target = self.find_class(text.split(".")[-1], mod)
        if target is None:
            self.notes.append(f"{mod.path}: {text}.add_cli_args not found")
            return
        found = self.method(target, "add_cli_args")
        if found:
            fn, where = found
            self._walk_function(fn, where.module, target, seen)

    def _kwargs_vars(
        self, func: ast.FunctionDef, mod: Module, cls: ClassDef | None
    ) -> dict[str, tuple[ClassDef | None, set[str]]]:
        """`X = get_kwargs(Cls)` in func: X -> (the class, fields deleted with `del X["f"]` / X.pop("f"))."""
        out: dict[str, tuple[ClassDef | None, set[str]]] = {}
        for node in ast.walk(func):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func).endswith("get_kwargs")
                and node.value.args
            ):
                arg = ast.unparse(node.value.args[0])
                target = cls if arg == "cls" else self.find_class(arg.split(".")[-1], mod)
                out[node.targets[0].id] = (target, set())
        for node in ast.walk(func):
            if isinstance(node, ast.Delete):
                for t in node.targets:
                    if isinstance(t, ast.Subscript) and ast.unparse(t.value) in out and _str(t.slice):
                        out[ast.unparse(t.value)][1].add(_str(t.slice))
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "pop"
                and ast.unparse(node.func.value) in out
                and node.args
                and _str(node.args[0])
            ):
                out[ast.unparse(node.func.value)][1].add(_str(node.args[0]))
        return out

    def _action_overrides(self, func: ast.FunctionDef, cls: ClassDef | None, mod: Module) -> dict[str, str]:
        """`X["field"]["action"] = ...` in func (and in the class's _customize_cli_kwargs): bool or other."""
        bodies: list[ast.AST] = [func]
        if cls is not None:
            found = self.method(cls, "_customize_cli_kwargs")
            if found:
                bodies.append(found[0])
        out = {}
        for body in bodies:
            for node in ast.walk(body):
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    t = node.targets[0]
                    if (
                        isinstance(t, ast.Subscript)
                        and _str(t.slice) == "action"
                        and isinstance(t.value, ast.Subscript)
                        and _str(t.value.slice)
                    ):
                        out[_str(t.value.slice)] = "bool" if _is_bool_action(node.value) else "other"
        return out

    def _record(self, call: ast.Call, kwargs_of: dict, overrides: dict | None) -> None:
        flags = [s for s in (_str(a) for a in call.args) if s and s.startswith("--")]
        if not flags:
            if any(isinstance(a, ast.JoinedStr) for a in call.args):
                self.notes.append(f"computed flag name not read: {ast.unparse(call)[:120]}")
            return
        self.options.update(flags)
        boolean = False
        for kw in call.keywords:
            if kw.arg == "action":
                boolean = _is_bool_action(kw.value)
            elif kw.arg is None:
                # **X["f"], or **{**X["f"], "default": None} (a literal "action" there wins)
                splats = [kw.value]
                if isinstance(kw.value, ast.Dict):
                    splats = [v for k, v in zip(kw.value.keys, kw.value.values, strict=True) if k is None]
                for splat in splats:
                    if isinstance(splat, ast.Subscript):
                        boolean = self._splat_is_bool(splat, kwargs_of, overrides or {})
                if isinstance(kw.value, ast.Dict):
                    for k, v in zip(kw.value.keys, kw.value.values, strict=True):
                        if k is not None and _str(k) == "action":
                            boolean = _is_bool_action(v)
        if boolean:
            self.options.update("--no-" + f[2:] for f in flags)

    def _splat_is_bool(self, splat: ast.Subscript, kwargs_of: dict, overrides: dict[str, str]) -> bool:
        """Whether **X["f"] (X = get_kwargs(Cls)) carries BooleanOptionalAction."""
        var, name = ast.unparse(splat.value), _str(splat.slice)
        if var not in kwargs_of or not name:
            return False
        if name in overrides:
            return overrides[name] == "bool"
        target = kwargs_of[var][0]
        ann = self.fields(target).get(name) if target is not None else None
        return ann is not None and self.bool_field(ann)

    @functools.cached_property
    def underscores_to_dashes(self) -> bool:
        """Whether FlexibleArgumentParser turns `--a_b` into `--a-b` (then both spellings parse)."""
        cls = self._class_anywhere("FlexibleArgumentParser")
        src = ast.unparse(cls.node) if cls else ""
        return "replace('_', '-')" in src

    # -- environment variables --

    def reads_env(self, name: str) -> bool:
        """Whether any of the release's files names the variable as a string (os.environ, os.getenv...)."""
        quoted = (f'"{name}"', f"'{name}'")
        return any(q in (self.tree.read(p) or "") for p in self.tree.py_files() for q in quoted)

    def env(self) -> dict[str, str]:
        """vllm/envs.py's environment_variables: name -> the source of its default."""
        text = self.tree.read(ENVS)
        if text is None:
            return {}
        out = {}
        for node in ast.walk(ast.parse(text)):
            target = None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            elif isinstance(node, ast.AnnAssign):
                target = node.target
            if (
                isinstance(target, ast.Name)
                and target.id == "environment_variables"
                and isinstance(node.value, ast.Dict)
            ):
                for k, v in zip(node.value.keys, node.value.values, strict=True):
                    if k is not None and _str(k):
                        out[_str(k)] = " ".join(ast.unparse(v).split())
        return out


# --- the table ------------------------------------------------------------------------------------------


def spans(present: dict[Version, bool]) -> tuple[Version | None, Version | None, list[Version]]:
    """(first release that has it, last one when the newest lacks it, releases in between that lack it)."""
    have = [v for v, ok in present.items() if ok]
    if not have:
        return None, None, []
    newest = max(present)
    gaps = [v for v, ok in present.items() if not ok and have[0] < v < have[-1]]
    return have[0], (None if have[-1] == newest else have[-1]), gaps


def three(v: Version) -> str:
    """A release as MAJOR.MINOR.PATCH (0.9.0.1 and 0.8.5.post1 are patch releases of their line)."""
    return ".".join(str(p) for p in v.release[:3])


def entry(since: Version, until: Version | None, note: str | None = None) -> dict:
    out: dict[str, str] = {"since": three(since)}
    if until is not None:
        out["until"] = three(until)
    if note:
        out["note"] = note
    return out


def parses(rel: Release, flag: str) -> bool:
    """Whether the release's serve parser knows the flag as spelled (underscores as its parser treats them)."""
    if flag in rel.options:
        return True
    return rel.underscores_to_dashes and "--" + flag[2:].replace("_", "-") in rel.options


def derive(
    releases: dict[Version, Tree], flags: Iterable[str], env: Iterable[str], old: dict
) -> tuple[dict, list[str]]:
    """The table's flags and env sections, and what a reader should check by hand."""
    analysed: dict[Version, Release] = {}
    warnings: list[str] = []
    for v, tree in releases.items():
        analysed[v] = Release(tree).analyse()
        warnings += [f"{v}: {n}" for n in analysed[v].notes]
    table: dict = {
        "flags": {},
        "env": {},
        "files": sorted({f for rel in analysed.values() for f in rel.files}),
    }
    for flag in sorted(set(flags)):
        since, until, gaps = spans({v: parses(rel, flag) for v, rel in analysed.items()})
        if since is None:
            warnings.append(f"{flag}: in no release")
            continue
        if gaps:
            warnings.append(
                f"{flag}: missing in {', '.join(map(str, gaps))} between its first and last release"
            )
        table["flags"][flag] = entry(since, until, (old.get("flags", {}).get(flag) or {}).get("note"))
    envs = {v: rel.env() for v, rel in analysed.items()}
    for name in sorted(set(env)):
        present = {v: name in e for v, e in envs.items()}
        where = "vllm/envs.py"
        if not any(present.values()):  # not one of vLLM's own variables: a library's that vLLM reads or sets
            present = {v: rel.reads_env(name) for v, rel in analysed.items()}
            where = "any file"
        since, until, gaps = spans(present)
        if since is None:
            warnings.append(f"{name}: named by no release ({where})")
            continue
        if gaps:
            warnings.append(f"{name}: missing in {', '.join(map(str, gaps))} ({where})")
        first_of: dict[str, Version] = {}
        for v, e in envs.items():
            if name in e:
                first_of.setdefault(e[name], v)
        if len(first_of) > 1:
            warnings.append(
                f"{name}: default changed: " + "; ".join(f"{v}: {d}" for d, v in first_of.items())
            )
        table["env"][name] = entry(since, until, (old.get("env", {}).get(name) or {}).get("note"))
    return table, warnings


HEADER = """\
# Which vLLM release first parses each engine flag the chart can render (and the last one, for removed flags).
# Source: vLLM's argument parsers at each release tag ({files}, and the config dataclasses
# whose fields they turn into flags), github.com/vllm-project/vllm, read from the release wheels on PyPI (built
# from those tags), every release {first} to {last}; derived by router/vllm_stack_dev/vllm_flags.py, {date}.
# releases: the oldest and newest read. since: the first release that has it ({first}: perhaps older, the oldest
# read). until: the last release that has it, where the newest lacks it.
# env: vLLM's variables (vllm/envs.py; others vLLM reads: any file naming them) at the same releases.
# Underscore spellings (production-stack renders --gpu_memory_utilization, --max_loras) parse wherever the dashed
# flag does: FlexibleArgumentParser turns _ into - in flag names in every release read.
"""


def write(table: dict, releases: dict[Version, Tree], path: Path = TABLE) -> None:
    versions = list(releases)
    header = HEADER.format(
        files=", ".join(table["files"]),
        first=three(versions[0]),
        last=three(versions[-1]),
        date=datetime.date.today().isoformat(),
    )
    lines = []
    for line in header.splitlines():  # the file list makes the second line long: wrap it
        while len(line) > 115:
            cut = line.rfind(" ", 0, 115)
            lines.append(line[:cut])
            line = "# " + line[cut + 1 :]
        lines.append(line)
    lines.append(f"releases: {_flow({'oldest': three(versions[0]), 'newest': three(versions[-1])})}")
    lines.append("flags:")
    for name, e in table["flags"].items():
        lines.append(f"  {name}: {_flow(e)}")
    lines.append("env:")
    for name, e in table["env"].items():
        lines.append(f"  {name}: {_flow(e)}")
    path.write_text("\n".join(lines) + "\n")


def _flow(e: dict) -> str:
    """One entry as a flow mapping with double-quoted strings: {since: "0.9.0", until: "0.10.2"}."""
    return "{" + ", ".join(f"{k}: {_quoted(v)}" for k, v in e.items()) + "}"


def _quoted(value: str) -> str:
    return yaml.safe_dump(value, default_style='"', width=1000).strip()


def installed_options(python: str) -> set[str]:
    """The option strings of an installed vLLM's serve parser, built for real in that environment."""
    code = (
        "import json\n"
        "from vllm.entrypoints.cli.serve import ServeSubcommand\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = FlexibleArgumentParser(); sub = p.add_subparsers()\n"
        "s = ServeSubcommand().subparser_init(sub)\n"
        "print(json.dumps(sorted({o for a in s._actions for o in a.option_strings if o.startswith('--')})))\n"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(yaml.safe_load(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--mirror", type=Path, help="a vLLM git mirror (its tags vX.Y.Z are read)")
    src.add_argument("--wheels", type=Path, help="a folder of <version>/vllm/... unpacked from the wheels")
    ap.add_argument("--download", action="store_true", help="with --wheels: fetch the missing releases")
    ap.add_argument(
        "--add", default="", help="more flags or variables to list, comma-separated: --add=--x,--y,VLLM_Z"
    )
    ap.add_argument("--table", type=Path, default=TABLE)
    ap.add_argument("--options", metavar="VERSION", help="print every option of one release and stop")
    ap.add_argument(
        "--check-installed",
        metavar="PYTHON",
        nargs="?",
        const=str(engine_python()),
        help="compare the reading of that release with the real parser of this vLLM (default: .venv-engine)",
    )
    args = ap.parse_args(argv)
    if args.mirror:
        releases = mirror_releases(args.mirror)
    else:
        if args.download:
            args.wheels.mkdir(parents=True, exist_ok=True)
            download(args.wheels)
        releases = wheel_releases(args.wheels)
    if not releases:
        raise SystemExit("no vLLM releases from 0.6.0 found")
    if args.options:
        rel = Release(releases[Version(args.options)]).analyse()
        print("\n".join(sorted(rel.options)))
        print("\n".join(rel.notes), file=sys.stderr)
        return 0
    if args.check_installed:
        return check_installed(args.check_installed, releases)
    old = yaml.safe_load(args.table.read_text()) if args.table.exists() else {}
    more = [a.strip() for a in args.add.split(",") if a.strip()]
    flags = [*old.get("flags", {}), *(a for a in more if a.startswith("-"))]
    env = [*old.get("env", {}), *(a for a in more if not a.startswith("-"))]
    table, warnings = derive(releases, flags, env, old)
    write(table, releases, args.table)
    for w in warnings:
        print(f"check: {w}", file=sys.stderr)
    print(f"{args.table}: {len(table['flags'])} flags, {len(table['env'])} variables", file=sys.stderr)
    return 0


def check_installed(python: str, releases: dict[Version, Tree]) -> int:
    """The static reading against the real parser of an installed vLLM (same version: the newest here)."""
    version = (
        subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    v = Version(version.split("+")[0])
    if v not in releases:
        raise SystemExit(f"vLLM {version} is not among the releases read")
    real = installed_options(python) - {"--help"}  # argparse adds --help to every parser
    read = Release(releases[v]).analyse().options
    print(f"vLLM {version}: {len(real)} options parsed for real, {len(read)} read from the sources")
    for name, diff in (("only in the real parser", real - read), ("only in the reading", read - real)):
        if diff:
            print(f"{name}: {' '.join(sorted(diff))}")
    return 0 if real == read else 1


if __name__ == "__main__":
    raise SystemExit(main())
