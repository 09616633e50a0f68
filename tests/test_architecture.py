"""The import rules of docs/architecture.md, read from the source (nothing is imported): no import
cycles among cutelayers modules; imports only toward lower layers (so the runtime imports no op,
Flax or Equinox module, and tuning no op); kernels import no JAX; only the kernels and the launch
shim import the CuTe DSL when imported (a plain install imports every other module); only
runtime/_jax_compat.py touches JAX internals."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lowest first; a module imports from its own layer and the ones below, never from one above.
LAYERS = {
    "kernels": ("cutelayers.kernels",),
    "runtime": ("cutelayers.runtime", "cutelayers.backend"),
    "tuning": ("cutelayers.tuning",),
    "ops": ("cutelayers.ops", "cutelayers.cute_call", "cutelayers.aot"),
    "modules": ("cutelayers.flax", "cutelayers.equinox", "cutelayers._module_checks"),
    "package": ("cutelayers",),  # cutelayers/__init__.py and the demo, cutelayers/__main__.py
    "bench": ("cutelayers.bench",),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted((ROOT / "cutelayers").rglob("*.py"))}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports(name: str, module_level: bool = False) -> set[str]:
    """The modules that import statements of cutelayers module ``name`` name (``module_level``:
    only those that run when it is imported)."""
    path = MODULES[name]
    return imports_in(path.read_text(), name, is_package=path.name == "__init__.py", module_level=module_level)


def _statements(tree: ast.AST, module_level: bool):
    """Every node of ``tree``; with ``module_level``, none inside a function."""
    for node in ast.iter_child_nodes(tree):
        yield node
        if not (module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
            yield from _statements(node, module_level)


def imports_in(source: str, name: str, is_package: bool, module_level: bool = False) -> set[str]:
    """The modules named by the import statements of ``source``, module ``name``'s code, at module
    level or (unless ``module_level``) inside a function; ``from a import b`` names ``a.b`` when
    that is a cutelayers module, else ``a``."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in _statements(ast.parse(source), module_level):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:  # relative: from this package, or level - 1 packages up
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return found


def layer(name: str) -> int:
    """Index in :data:`LAYERS` of the layer of cutelayers module ``name`` (the longest prefix wins)."""
    matches = [(len(prefix), i) for i, prefixes in enumerate(LAYERS.values()) for prefix in prefixes
               if _within(name, prefix)]
    return max(matches)[1]


def import_graph() -> dict[str, set[str]]:
    """cutelayers module -> the cutelayers modules it imports."""
    return {name: {m for m in imports(name) if m in MODULES and m != name} for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge of a depth-first search (none: the graph is acyclic)."""
    found, state, path = [], {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == "open":
                found.append(path[path.index(successor):] + [successor])
            elif successor not in state:
                visit(successor)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "cutelayers.runtime.launch" in graph["cutelayers.runtime.primitive"]  # imported inside build_launcher
    assert "cutelayers.kernels.gemm" in graph["cutelayers.ops.linear"]  # inside methods only
    assert "cutelayers.kernels.gemm" not in imports("cutelayers.ops.linear", module_level=True)
    relative = "def f():\n    from .reduction import row_config\n    from .. import ops\n"
    assert imports_in(relative, "cutelayers.kernels.norm", is_package=False) == {"cutelayers.kernels.reduction",
                                                                                 "cutelayers.ops"}
    assert imports_in(relative, "cutelayers.kernels.norm", is_package=False, module_level=True) == set()
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    assert [" -> ".join(c) for c in cycles(import_graph())] == []


def test_imports_point_down_the_layers():
    names = list(LAYERS)
    upward = [f"{name} ({names[layer(name)]}) imports {m} ({names[layer(m)]})"
              for name, targets in import_graph().items() for m in sorted(targets) if layer(m) > layer(name)]
    assert upward == []


def test_kernels_import_no_jax():
    """With the layer rule (kernels, the lowest layer, import only kernels), a kernel is importable
    and testable with CuTe alone."""
    kernels = [name for name in MODULES if _within(name, "cutelayers.kernels")]
    assert "cutelayers.kernels.gemm" in kernels
    assert {name: sorted(m for m in imports(name) if m.split(".")[0] in ("jax", "jaxlib")) for name in kernels} \
        == {name: [] for name in kernels}


# What building kernels imports: the CuTe DSL and TVM-FFI (the `cute` extra) and cuda-bindings.
CUTE_PACKAGES = ("cutlass", "cuda", "tvm_ffi", "jax_tvm_ffi")


def test_only_kernels_and_the_launch_shim_import_cute_when_imported():
    """Everything else -- configs, ops, modules, the runtime -- imports (with a kernel module) the
    CuTe DSL only inside the functions that build a kernel, so a plain install imports it."""
    graph = {name: imports(name, module_level=True) for name in MODULES}
    needs_cute = {name for name, targets in graph.items() if any(t.split(".")[0] in CUTE_PACKAGES for t in targets)}
    while grown := {name for name, targets in graph.items() if targets & needs_cute} - needs_cute:
        needs_cute |= grown
    assert sorted(needs_cute) == ["cutelayers.kernels.gemm", "cutelayers.kernels.norm", "cutelayers.kernels.reduction",
                                  "cutelayers.kernels.softmax", "cutelayers.runtime.launch"]


def test_only_jax_compat_touches_jax_internals():
    users = sorted(str(path.relative_to(ROOT)) for folder in ("cutelayers", "models", "training")
                   for path in (ROOT / folder).rglob("*.py") if "jax._src" in path.read_text())
    assert users == ["cutelayers/runtime/_jax_compat.py"]
