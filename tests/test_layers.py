"""The layers of lucid_fx (docs/architecture.md): no module imports a module of a higher layer.

Lowest first: numerics (lucid_fx.quantization) <- core (kernels, the op and interval tables, the
node.meta keys, the placement vocabulary) <- rules (rule tables, the lowering context, the
registry) <- passes (lucid_fx.passes, installed from the top-level passes/ folder) <- verbs
(everything else: prepare, convert, calibrate, explain, compare, save/load, cli, demo, ...).
Every import counts, at module level or inside a function.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Module-name prefixes of each layer, lowest first; the longest prefix that matches decides, and a
# lucid_fx module no prefix matches is a verb.
LAYERS = [
    ("numerics", ("lucid_fx.quantization", "lucid_fx._where")),
    ("core", ("lucid_fx.kernels", "lucid_fx.ops", "lucid_fx.aliasing", "lucid_fx.op_tags", "lucid_fx.op_overloads",
              "lucid_fx.node_refs", "lucid_fx.computed_weights", "lucid_fx.interval", "lucid_fx._meta", "lucid_fx._placement",
              "lucid_fx._describe")),
    ("rules", ("lucid_fx.rules", "lucid_fx.registry")),
    ("passes", ("lucid_fx.passes",)),
    ("verbs", ("lucid_fx",)),
]

# The one allowed exception, (importing file, imported module) -> why. The spec (docs/api.md,
# section 1) puts the reference framework's workflow names under lucid_fx.quantization; they are
# verbs, so the package's __getattr__ imports them on first use (a facade), never at import.
ALLOWED = {
    ("lucid_fx/quantization/__init__.py", "lucid_fx.workflow"): "the spec's facade: prepare_fx, prepare_qat_fx, convert_fx",
    ("lucid_fx/quantization/__init__.py", "lucid_fx.dynamic"): "the spec's facade: quantize_dynamic, DynamicQuantizedLinear",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "passes":
        parts = ["lucid_fx"] + parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _source_of(module: str) -> Path:
    parts = module.split(".")
    if parts[:2] == ["lucid_fx", "passes"]:
        parts = parts[1:]
    return ROOT.joinpath(*parts)


def _is_module(module: str) -> bool:
    path = _source_of(module)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def layer_of(module: str):
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def imported_modules(tree: ast.AST):
    """(line, module) for every lucid_fx import; ``from lucid_fx import X`` imports module
    lucid_fx.X when X is a module, lucid_fx itself otherwise."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield node.lineno, full if _is_module(full) else node.module


SOURCES = sorted([*ROOT.joinpath("lucid_fx").rglob("*.py"), *ROOT.joinpath("passes").rglob("*.py")])


def upward_imports():
    found = []
    for path in SOURCES:
        here = layer_of(module_name(path))
        rel = path.relative_to(ROOT).as_posix()
        for line, module in imported_modules(ast.parse(path.read_text(), str(path))):
            there = layer_of(module) if module.startswith("lucid_fx") else None
            if there is not None and there > here and (rel, module) not in ALLOWED:
                found.append(f"{rel}:{line} ({LAYERS[here][0]}) imports {module} ({LAYERS[there][0]})")
    return found


def test_no_import_runs_upward():
    assert upward_imports() == []


def test_the_allowed_exceptions_are_still_needed():
    # An exception nobody needs any more must go, so that the list stays the true one.
    used = set()
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        used |= {(rel, module) for _, module in imported_modules(ast.parse(path.read_text()))}
    assert set(ALLOWED) <= used


@pytest.mark.parametrize("module, layer", [
    ("lucid_fx.quantization.observers", "numerics"), ("lucid_fx.kernels.cpu", "core"), ("lucid_fx._meta", "core"),
    ("lucid_fx.rules.lowering_context", "rules"), ("lucid_fx.registry", "rules"), ("lucid_fx.passes.insert_qdq", "passes"),
    ("lucid_fx.placement", "verbs"), ("lucid_fx.dynamic", "verbs"), ("lucid_fx", "verbs"),
])
def test_layer_of(module, layer):
    assert LAYERS[layer_of(module)][0] == layer


def test_an_upward_import_is_reported_with_file_line_and_both_layers(tmp_path, monkeypatch):
    bad = ROOT / "lucid_fx" / "quantization" / "observers.py"
    tree = ast.parse("import torch\n\ndef f():\n    from lucid_fx.passes import insert_qdq\n")
    monkeypatch.setattr(ast, "parse", lambda text, *a, _real=ast.parse: tree if text == bad.read_text() else _real(text, *a))
    assert upward_imports() == ["lucid_fx/quantization/observers.py:4 (numerics) imports lucid_fx.passes.insert_qdq (passes)"]


def test_every_pass_has_its_test_module():
    # Tests mirror the source tree: passes/verb_noun.py is tested in tests/passes/test_verb_noun.py (passes/_rewrite.py,
    # the rewriting passes' shared tail, is no pass: their tests run it).
    passes = {p.stem for p in ROOT.joinpath("passes").glob("*.py") if not p.stem.startswith("_")}
    missing = sorted(p for p in passes if not ROOT.joinpath("tests", "passes", f"test_{p}.py").exists())
    assert missing == [] and len(passes) >= 12
