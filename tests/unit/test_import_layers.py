"""fivar's modules import one way: no module reaches itself through the imports it makes at import time, nor
through the imports its functions make when called (a lazy import defers a circle, it does not remove it), and
spec -> codegen -> jit -> runtime import only downward, counting the imports functions make: AttentionVariant's calls
(`v.prefill(...)`, `v.reference(...)`) are added from above the runtime (fivar.runtime.methods), as FusionVariant's
are (fivar.fusion.variant), so the spec loads, and parses variants, without any kernel layer."""
import ast
import functools
from pathlib import Path

import fivar

PACKAGE = Path(fivar.__file__).parent

#: What no module under fivar/spec may import, in any statement: the layers above it.
ABOVE_THE_SPEC = ("fivar.codegen", "fivar.jit", "fivar.runtime", "fivar.bench")

#: Layers from the bottom: a module imports (at import time or in its functions) only its own layer and those below.
#: Modules outside these layers (fivar.cache, fivar.flashinfer_compat, fusion, bench, the CLI...) are checked for
#: circles only.
LAYERS = (("fivar.errors", "fivar.lang", "fivar.paths", "fivar.config", "fivar.flashinfer_layout"),
          ("fivar.spec",), ("fivar.codegen",), ("fivar.jit",), ("fivar.runtime",))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str], in_functions: bool = False) -> set[str]:
    """The fivar modules `name` imports when it is imported: statements outside functions (and outside
    `if TYPE_CHECKING:`), resolved to modules (a name imported from a package is its submodule if one exists).
    With in_functions=True also those its functions import when they run."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not in_functions:
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith("fivar"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                if base.startswith("fivar"):
                    for a in node.names:
                        out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
            if isinstance(getattr(node, "body", None), list):  # classes, functions, if/for/while/with/try
                visit(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []) +
                      getattr(node, "handlers", []))
    visit(ast.parse(path.read_text()).body)
    return {m for m in out if m in modules and m != name}


@functools.cache  # parsing every module is the tests' time: once per run for each form (the tests only read it)
def _graph(in_functions: bool = False) -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(p, name, modules, in_functions) for name, p in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_graph_sees_imports():
    graph = _graph()
    assert "fivar.jit.build" in graph["fivar.runtime.plans"]
    assert "fivar.config" in graph["fivar.codegen.fa3"] and "fivar.flashinfer_compat" in graph["fivar.codegen.fa3"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    # fusion.runtime imports fusion.build inside bind() only: seen with in_functions, not without
    assert "fivar.fusion.build" not in graph["fivar.fusion.runtime"]
    assert "fivar.fusion.build" in _graph(in_functions=True)["fivar.fusion.runtime"]
    # AttentionVariant.plan_decode(cuda_graph=True) imports the graph plans when called
    assert "fivar.runtime.graph" in _graph(in_functions=True)["fivar.runtime.methods"]
    assert "fivar.runtime.graph" not in graph["fivar.runtime.methods"]


def _layer(module: str) -> int | None:
    return next((i for i, names in enumerate(LAYERS) for n in names if module == n or module.startswith(n + ".")),
                None)


def test_no_import_circles():
    cycles = _cycles(_graph())
    assert not cycles, f"import circles: {cycles}"


def test_no_import_circles_through_imports_inside_functions():
    cycles = _cycles(_graph(in_functions=True))
    assert not cycles, f"import circles through imports inside functions: {cycles}"


def test_layers_point_down():
    """No edge to a higher layer; the leaves and the spec import nothing outside the layers."""
    up = []
    for a, bs in _graph(in_functions=True).items():
        la = _layer(a)
        if la is None:
            continue
        for b in bs:
            lb = _layer(b)
            if lb > la if lb is not None else la <= 1:
                up.append(f"{a} -> {b}")
    assert not up, f"imports pointing up the layers: {sorted(up)}"
    assert _layer("fivar.spec.names") == 1 and _layer("fivar.runtime.ops") == 4 and _layer("fivar.cache") is None


def _every_import(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every module an import statement anywhere in `source` names (top level, functions, classes, `if
    TYPE_CHECKING:`), relative ones resolved from module `name`: `from ..runtime import graph` gives fivar.runtime
    and fivar.runtime.graph; also importlib.import_module / __import__ of a literal name."""
    package = name if is_package else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) \
                and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__"):
            out.add(node.args[0].value)
    return out


def _reaches_above_the_spec(imports: set[str]) -> list[str]:
    return sorted(m for m in imports if any(m == up or m.startswith(up + ".") for up in ABOVE_THE_SPEC))


def test_every_import_sees_imports_inside_functions():
    old = """from . import live
class AttentionVariant:
    def plan_decode(self):
        if cuda_graph:
            from ..runtime.graph import GraphDecodePlan
    def reference(self):
        from .. import codegen
def _runtime():
    import fivar.jit.build
    return importlib.import_module("fivar.bench.runner")
"""
    got = _every_import(old, "fivar.spec.variant")
    assert _reaches_above_the_spec(got) == ["fivar.bench.runner", "fivar.codegen", "fivar.jit.build",
                                            "fivar.runtime.graph", "fivar.runtime.graph.GraphDecodePlan"]
    assert "fivar.spec.live" in got and not _reaches_above_the_spec({"fivar.spec.live", "fivar.runtimes", "torch"})


def test_the_spec_imports_no_layer_above_it():
    """No module under fivar/spec imports the codegen, the JIT, the runtime or the benchmarks, in any statement:
    a declaration loads, parses and lowers without them."""
    spec = PACKAGE / "spec"
    found = {}
    for path in sorted(spec.rglob("*.py")):
        name = _module_name(path)
        up = _reaches_above_the_spec(_every_import(path.read_text(), name, path.name == "__init__.py"))
        if up:
            found[name] = up
    assert len(list(spec.rglob("*.py"))) > 10
    assert not found, f"fivar/spec imports layers above it: {found}"



#: A module longer than this is more than one room: split it where its sections already are.
MAX_MODULE_LINES = 600


def test_no_module_is_longer_than_a_room():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
