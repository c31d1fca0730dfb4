"""The package layers, checked on the import graph: each package imports only the ones below it, so there is no
cycle; `import vlserve` and every `--help` stay free of torch and transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "vlserve"

# Bottom to top. A package may import its own modules and any package of a lower layer, never one above or beside.
LAYERS = [
    {"vlserve.core"},
    {"vlserve.tools", "vlserve.bench"},  # stand-alone tools: only core below them
    {"vlserve.model"},
    {"vlserve.engine"},
    {"vlserve.frontend"},
    {"vlserve.disagg"},
    {"vlserve.server"},
    {"vlserve.cli", "vlserve"},
    {"vlserve.__main__"},
]
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def unit(module: str) -> str:
    """The layer unit of a module: `vlserve.<package>` (or the top-level module itself)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def import_edges() -> list[tuple[str, str, str]]:
    """(importing file, importing unit, imported unit) for every vlserve import, nested ones included."""
    edges = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    names = [".".join(base + ([node.module] if node.module else []))]
                elif node.module:
                    names = [node.module]
            for name in names:
                if name == "vlserve" or name.startswith("vlserve."):
                    edges.append((str(rel), unit(module), unit(name)))
    return edges


def test_every_package_has_a_layer():
    tops = {unit(f"vlserve.{p.name.removesuffix('.py')}") for p in ROOT.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()}
    units = {u for _, u, _ in import_edges()} | tops
    assert units <= set(LEVEL), f"packages without a layer: {sorted(units - set(LEVEL))}"


def test_imports_only_go_down():
    bad = [f"{path}: {src} imports {dst}" for path, src, dst in import_edges()
           if src != dst and dst != "vlserve" and LEVEL[dst] >= LEVEL[src]]
    assert not bad, "imports that go up or sideways:\n" + "\n".join(sorted(set(bad)))


def _modules_loaded(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_import_vlserve_is_light():
    loaded = _modules_loaded("import vlserve; from vlserve import SamplingParams; import vlserve.core.errors")
    assert "torch" not in loaded and "transformers" not in loaded


@pytest.mark.parametrize("command", ["", "serve", "language", "encode", "bootstrap", "demo", "make-tiny-model",
                                     "bench"])
def test_help_imports_no_torch(command):
    code = ("import contextlib, io\nfrom vlserve.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            f"    main({[command, '--help'] if command else ['--help']!r})")
    loaded = _modules_loaded(code)
    assert "torch" not in loaded and "transformers" not in loaded


def test_front_ends_read_model_facts_without_the_engine_config_or_the_loader():
    """A front end (API server, language/decode/prefill roles) resolves the model facts itself and ships them:
    neither the engine's config module nor the weight loader is imported into it."""
    loaded = _modules_loaded("import vlserve.server.api_server, vlserve.server.cli, vlserve.frontend.async_llm\n"
                             "import vlserve.disagg.remote_encoder, vlserve.disagg.prefill_service\n"
                             "import vlserve.disagg.launcher, vlserve.model.facts")
    assert "vlserve.frontend.async_llm" in loaded and "vlserve.model.facts" in loaded
    assert not loaded & {"vlserve.engine.config", "vlserve.model.loader", "vlserve.engine.core"}
