"""The package's shape: no import cycles (imports inside functions count), low layers never import high ones, and
no module over the size where it stops being readable.  ARCHITECTURE.md describes the same layers."""

import ast
import os
import re

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "mla_fuser")
ARCHITECTURE = os.path.join(os.path.dirname(__file__), "..", "ARCHITECTURE.md")
MAX_LINES = 700

# lowest first; a module may import its own layer's or lower layers' modules (the first matching prefix decides)
LAYERS = [
    ("envs", "compat", "plans", "fx_ops", "context_flags"),
    ("kernels",),
    ("graph",),
    ("rewrite", "rotary_call"),
    ("cache", "cache_pool", "cache_reorder", "cache_moves"),
    ("attention_interfaces",),
    ("fusers",),
    ("runtime",),
    ("fusion",),
    ("loader",),
    ("presets",),
    ("bench", "bench_serve", "serve"),
    ("cli",),
    ("__init__",),
]


def _modules() -> dict[str, str]:
    """dotted name (relative to the package, ``__init__`` for the package itself) -> path"""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                found[rel] = path
    return found


def _target(name: str, modules) -> str | None:
    """The package module an import of ``name`` (dotted, relative to the package) resolves to."""
    while name:
        if name in modules:
            return name
        if name + ".__init__" in modules:
            return name + ".__init__"
        name = name.rpartition(".")[0]
    return None


def _imports(rel: str, path: str, modules) -> set[str]:
    """Every package module ``rel`` imports, at module level or inside functions."""
    package = rel.split(".")[:-1]  # the package holding this module (an __init__ holds itself)
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name[len("mla_fuser."):] for a in node.names if a.name.startswith("mla_fuser.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("mla_fuser"):
                stem = node.module[len("mla_fuser"):].lstrip(".")
            else:
                continue
            names = [f"{stem}.{a.name}".lstrip(".") for a in node.names] + [stem]
        for name in names:
            hit = _target(name, modules)
            if hit and hit != rel and not (rel.endswith("__init__") and hit.startswith(rel[: -len("__init__")])):
                out.add(hit)
    return out


def _graph():
    modules = _modules()
    return {rel: _imports(rel, path, modules) for rel, path in modules.items()}


def _layer(rel: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(rel == p or rel.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{rel} belongs to no layer: add it to LAYERS and ARCHITECTURE.md")


def _cycles(graph) -> list[list[str]]:
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def _upward(graph) -> list[str]:
    return sorted(f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
                  for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_low_layers_never_import_high_ones():
    wrong = _upward(_graph())
    assert not wrong, "\n".join(wrong)


def test_no_module_over_the_size_limit():
    long = {rel: n for rel, path in _modules().items() if (n := sum(1 for _ in open(path))) > MAX_LINES}
    assert not long, long


def test_architecture_names_every_layer():
    text = open(ARCHITECTURE).read()
    for prefixes in LAYERS[:-1]:
        for p in prefixes:
            assert re.search(rf"`{re.escape(p)}", text), f"ARCHITECTURE.md does not describe {p}"


def test_the_checks_see_a_cycle_and_a_layer_violation(tmp_path):
    """The checks themselves can fail: a planted cycle (one import inside a function) and an upward import."""
    low, high = tmp_path / "x.py", tmp_path / "y.py"
    low.write_text("def f():\n    from ..runtime import y\n")
    high.write_text("from mla_fuser.kernels import x\n")
    modules = {"kernels.x": str(low), "runtime.y": str(high)}
    graph = {rel: _imports(rel, path, modules) for rel, path in modules.items()}
    assert graph == {"kernels.x": {"runtime.y"}, "runtime.y": {"kernels.x"}}
    assert _cycles(graph) == [["kernels.x", "runtime.y", "kernels.x"]]
    assert _upward(graph) == ["kernels.x (layer 1) imports runtime.y (layer 7)"]
