"""The import graph, lazy imports (inside functions) included: each package imports only the ones below it, and no
module imports itself back through others; `import vlserve` and the `--help` of every command the CLI registers
stay free of torch and transformers."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "vlserve"

# Bottom to top. A package may import its own modules and any package of a lower layer, never one above or beside.
LAYERS = [
    {"vlserve.core"},
    {"vlserve.bench"},  # stand-alone benchmark clients: only core below them
    {"vlserve.media"},  # fetching and decoding pictures, video and sound; content hashes
    {"vlserve.model"},
    {"vlserve.tools"},  # checkpoint makers: the families name their tiny-checkpoint builders (model registry)
    {"vlserve.lora"},  # LoRA adapters on the model's linears: read, checked, put in slots
    {"vlserve.engine"},
    {"vlserve.frontend"},
    {"vlserve.disagg"},
    {"vlserve.server"},
    {"vlserve.router"},  # the OpenAI front of several replicas: the server's parsing, the registry, the index
    {"vlserve.dynamo"},  # a backend of NVIDIA Dynamo: the server's engine set-up behind Dynamo's frontend
    {"vlserve.cli", "vlserve"},
    {"vlserve.__main__"},
]
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `importer` (a module) names `imported` (the most specific vlserve module the
    statement reaches: `from vlserve.a import b` is `vlserve.a.b` when that is a module, else `vlserve.a`)."""

    importer: str
    imported: str
    path: str
    line: int
    text: str

    def where(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def unit(module: str) -> str:
    """The layer unit of a module: `vlserve.<package>` (or the top-level module itself)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


@cache
def modules() -> dict[str, Path]:
    """Every vlserve module by dotted name (a package by its own name: `vlserve.engine` is its __init__)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        found[".".join(rel.parts).removesuffix(".__init__")] = path
    return found


def _known_module(name: str) -> str:
    """The longest prefix of a dotted name that is a vlserve module (a namespace package falls to its parent)."""
    while name not in modules() and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imported_names(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement reaches, relative imports resolved against `package`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    # `from pkg import sub` reaches the submodule when there is one, else a name defined in pkg itself.
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules() else base for a in node.names]


@cache
def imports() -> tuple[Import, ...]:
    """Every import of a vlserve module by a vlserve module, wherever the statement sits (function bodies and
    TYPE_CHECKING blocks included: a lazy import is still a dependency)."""
    edges = []
    for module, path in modules().items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        source = path.read_text()
        rel = str(path.relative_to(ROOT.parent))
        for node in ast.walk(ast.parse(source)):
            for name in _imported_names(node, package):
                if name == "vlserve" or name.startswith("vlserve."):
                    text = ast.get_source_segment(source, node).split("\n")[0]
                    edges.append(Import(module, _known_module(name), rel, node.lineno, text))
    return tuple(edges)


def import_edges() -> list[tuple[str, str, str]]:
    """(importing file, importing unit, imported unit) for every vlserve import."""
    return [(e.path, unit(e.importer), unit(e.imported)) for e in imports()]


def test_every_package_has_a_layer():
    tops = {unit(f"vlserve.{p.name.removesuffix('.py')}") for p in ROOT.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()}
    units = {u for _, u, _ in import_edges()} | tops
    assert units <= set(LEVEL), f"packages without a layer: {sorted(units - set(LEVEL))}"


def test_imports_only_go_down():
    bad = [f"{path}: {src} imports {dst}" for path, src, dst in import_edges()
           if src != dst and dst != "vlserve" and LEVEL[dst] >= LEVEL[src]]
    assert not bad, "imports that go up or sideways:\n" + "\n".join(sorted(set(bad)))


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components with more than one module (iterative: the graph may be deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def module_graph(edges) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for e in edges:
        if e.imported != e.importer:
            graph.setdefault(e.importer, set()).add(e.imported)
            graph.setdefault(e.imported, set())
    return graph


def describe_cycle(component: set[str], edges) -> str:
    """One shortest cycle through the component's first module, each step with the import line that makes it."""
    by_pair = {}
    for e in edges:
        by_pair.setdefault((e.importer, e.imported), e)
    start = min(component)
    came_from = {start: None}
    frontier = [start]
    while frontier:  # breadth first inside the component, until an edge leads back to the start
        nxt = []
        for node in frontier:
            for dst in sorted(m for (a, m) in by_pair if a == node and m in component):
                if dst == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    path = path[::-1] + [start]
                    steps = [by_pair[a, b].where() for a, b in zip(path, path[1:])]
                    return " -> ".join(path) + "\n    " + "\n    ".join(steps)
                if dst not in came_from:
                    came_from[dst] = node
                    nxt.append(dst)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_no_module_imports_itself_back():
    edges = imports()
    cycles = [describe_cycle(c, edges) for c in strongly_connected(module_graph(edges))]
    assert not cycles, "module import cycles (move the shared helper below both, or the import):\n" + \
        "\n".join(cycles)


def test_the_cycle_check_finds_a_lazy_cycle():
    """The checker itself: a two-module cycle made of one top-level and one function-level import is found and
    described with both lines."""
    edges = [Import("vlserve.a", "vlserve.b", "vlserve/a.py", 3, "from vlserve.b import f"),
             Import("vlserve.b", "vlserve.a", "vlserve/b.py", 9, "from vlserve.a import g"),
             Import("vlserve.b", "vlserve.core", "vlserve/b.py", 2, "import vlserve.core")]
    components = strongly_connected(module_graph(edges))
    assert components == [{"vlserve.a", "vlserve.b"}]
    assert describe_cycle(components[0], edges) == ("vlserve.a -> vlserve.b -> vlserve.a\n"
                                                    "    vlserve/a.py:3: from vlserve.b import f\n"
                                                    "    vlserve/b.py:9: from vlserve.a import g")


def test_lazy_and_relative_imports_are_in_the_graph():
    edges = {(e.importer, e.imported) for e in imports()}
    assert ("vlserve.server.cli", "vlserve.server.api_server") in edges  # inside run_serve
    assert ("vlserve.cli", "vlserve.server.cli") in edges  # `from vlserve.server import cli as server_cli`


def _run_python(code: str) -> tuple[int, set[str], str]:
    """In a fresh interpreter: (the status `code` prints on its last line, the modules loaded by the end, stderr)."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().split("\n")
    return int(lines[-2]), set(lines[-1].split()), out.stderr


def test_import_vlserve_is_light():
    _, loaded, _ = _run_python("import vlserve; from vlserve import SamplingParams; import vlserve.core.errors\n"
                               "print(0)")
    assert "torch" not in loaded and "transformers" not in loaded


def registered_commands() -> list[list[str]]:
    """Every command path the CLI registers (`serve`, `bench serve`, ...), read from its argparse tree."""
    from vlserve.cli import build_parser

    found = []

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found.append(prefix + [name])
                    walk(sub, prefix + [name])

    walk(build_parser(), [])
    return found


def test_the_command_list_comes_from_the_registry():
    commands = {" ".join(c) for c in registered_commands()}
    assert {"serve", "language", "decode", "encode", "prefill", "bootstrap", "demo", "bench serve"} <= commands


@pytest.mark.parametrize("command", [[]] + registered_commands(), ids=lambda c: " ".join(c) or "vlserve")
def test_help_exits_0_and_imports_no_torch(command):
    code = ("import contextlib, io\nfrom vlserve.cli import main\nout = io.StringIO()\n"
            "try:\n    with contextlib.redirect_stdout(out):\n"
            f"        status = main({[*command, '--help']!r})\n"
            "except SystemExit as e:\n    status = e.code or 0\n"
            "assert 'usage: vlserve' in out.getvalue(), out.getvalue()\nprint(status)")
    status, loaded, stderr = _run_python(code)
    assert status == 0, stderr
    assert "torch" not in loaded and "transformers" not in loaded, sorted(m for m in loaded if "torch" in m)


def test_front_ends_read_model_facts_without_the_engine_config_or_the_loader():
    """A front end (API server, language/decode/prefill roles) resolves the model facts itself and ships them:
    neither the engine's config module nor the weight loader is imported into it."""
    _, loaded, _ = _run_python("import vlserve.server.api_server, vlserve.server.cli, vlserve.frontend.async_llm\n"
                             "import vlserve.disagg.remote_encoder, vlserve.disagg.prefill_service\n"
                             "import vlserve.disagg.launcher, vlserve.model.facts\nprint(0)")
    assert "vlserve.frontend.async_llm" in loaded and "vlserve.model.facts" in loaded
    assert not loaded & {"vlserve.engine.config", "vlserve.model.loader", "vlserve.engine.core"}


def family_packages() -> set[str]:
    """vlserve/model/families/<name>/: one folder per model family."""
    return {m for m, path in modules().items()
            if m.startswith("vlserve.model.families.") and path.name == "__init__.py"}


def test_a_familys_modules_are_imported_by_itself_and_the_registry_only():
    """The engine, scheduler, caches, front end and disaggregation name no family: they reach one through the
    registry (vlserve.model.families), so a new family is a folder, not an engine change."""
    families = family_packages()
    assert {"vlserve.model.families.qwen", "vlserve.model.families.llava"} <= families
    bad = []
    for e in imports():
        reached = next((f for f in families if e.imported == f or e.imported.startswith(f + ".")), None)
        if reached is None or e.importer == "vlserve.model.families":
            continue
        if not (e.importer == reached or e.importer.startswith(reached + ".")):
            bad.append(e.where())
    assert not bad, "modules outside a family that import it:\n" + "\n".join(bad)


def test_every_family_reference_resolves():
    from vlserve.model.families import FAMILIES
    from vlserve.model.families.processor import MultiModalProcessor

    for family in FAMILIES:
        assert issubclass(family.load(family.processor), MultiModalProcessor), family.name
        for ref in (family.model, family.weight_names, family.check_item):
            assert callable(family.load(ref)), (family.name, ref)
