"""plait's modules import one another without a circle: every import counts, the lazy ones inside
functions too (a lazy import hides a circle, it does not remove it)."""

import ast
import os

import plait

PACKAGE = os.path.dirname(plait.__file__)


def module_files() -> dict[str, str]:
    """Dotted module name -> file, for every module of the package (a package is its __init__)."""
    out = {}
    for root, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, name), os.path.dirname(PACKAGE))[:-3].split(os.sep)
                out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(root, name)
    return out


def imports_of(module: str, path: str, modules: set[str]) -> set[str]:
    """The plait modules `module` names in any import statement. `from a import b` is a.b when that is a
    module, else a; importing a.b does not count as importing a (Python runs a's __init__ first, but an
    __init__ that imports its own submodules is not a circle)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                out.add(name if name in modules else base)
    return {m for m in out if m in modules and m != module}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {module: imports_of(module, path, set(files)) for module, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_the_package_has_no_import_circle():
    found = cycles(import_graph())
    assert found == [], "import circles (each a group of modules that reach one another):\n" + "\n".join(
        " <-> ".join(group) for group in found)


def test_the_cycle_finder_finds_a_circle_and_sees_lazy_imports():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "plait.workers.vllm_engine" in graph["plait.workers.engine"]  # imported inside a function only
    assert "plait.config" in graph["plait.cli"]
