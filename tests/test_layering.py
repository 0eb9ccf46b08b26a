"""The package's import structure: no import cycles between ringllm modules (counting imports made
inside functions, which is how a cycle hides), and no file importing or reaching into another
module's private (`_`-prefixed) names. Read from the sources with `ast`; nothing is imported."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIRS = {"ringllm": "pyengine", "ringllm.models": "models", "ringllm.runtime": "runtime",
                "ringllm.native": "native"}


def _modules() -> dict[str, str]:
    """Module name -> source path of every .py file of the package."""
    out = {}
    for pkg, folder in PACKAGE_DIRS.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if d != "__pycache__" and os.path.exists(os.path.join(dirpath, d, "__init__.py"))]
            rel = os.path.relpath(dirpath, base)
            prefix = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
            for name in files:
                if name.endswith(".py"):
                    out[prefix if name == "__init__.py" else prefix + "." + name[:-3]] = os.path.join(dirpath, name)
    return out


MODULES = _modules()


def _is_module(name: str) -> bool:
    """A module of the package, compiled extensions included (native/_ringllm_cuda.*.so)."""
    if name in MODULES:
        return True
    pkg, _, leaf = name.rpartition(".")
    folder = os.path.dirname(MODULES[pkg]) if pkg in MODULES else None
    return folder is not None and any(f.startswith(leaf + ".") for f in os.listdir(folder))


def _imports(path: str, module: str | None):
    """(imported module, imported names, alias map) of every ringllm import in the file, at any depth."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    edges, private, aliases = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ringllm"):
            for a in node.names:
                full = node.module + "." + a.name
                if _is_module(full):
                    edges.add(full)
                    aliases[a.asname or a.name] = full
                else:
                    edges.add(node.module)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(f"{path}: from {node.module} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ringllm"):
                    edges.add(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and not _is_module(aliases[node.value.id] + "." + node.attr)):
            private.append(f"{path}: {node.value.id}.{node.attr}")
    edges.discard(module)
    return edges, private


def test_no_import_cycles():
    graph = {m: {e for e in _imports(p, m)[0] if e in MODULES} for m, p in MODULES.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for e in sorted(graph[m]):
            if state.get(e) == 1:
                cycles.append(" -> ".join(stack[stack.index(e):] + [e]))
            elif e not in state:
                visit(e, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_imports():
    found = []
    paths = list(MODULES.values())
    for folder in ("tests", "bench"):
        base = os.path.join(ROOT, folder)
        paths += [os.path.join(base, f) for f in sorted(os.listdir(base)) if f.endswith(".py")]
    for p in paths:
        found += _imports(p, None)[1]
    assert not found, "private names used across files:\n" + "\n".join(found)
