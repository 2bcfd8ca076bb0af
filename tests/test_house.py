"""The house's imports run one way: pages → ui → tools → training, speculative → engine → weights → errors, texts.

Every import of a project module, also those inside functions, is read from the source (ast), so that a lazy
import cannot hide a circle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# lower number = lower in the house; a module may import its own floor or below, never above
# ("model": its __init__ and the `python -m model` entry point, above the command line it starts)
FLOORS = {"model.texts": 0, "model.errors": 1, "model.weights": 2, "model.engine": 3, "model.training": 4,
          "model.speculative": 4, "model.tools": 5, "model": 6, "ui": 7, "app_pages": 8, "app": 9}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    paths = [ROOT / "app.py"] + [p for d in ("model", "ui", "app_pages") for p in (ROOT / d).rglob("*.py")]
    return {module_name(p): p for p in paths}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules that `path` imports: `from a.b import c` names a.b.c when c is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found & known


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}


def floor(module: str) -> tuple[int, str]:
    room = max((r for r in FLOORS if module == r or module.startswith(r + ".")), key=len)
    return FLOORS[room], room


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a circle of imports."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_lazy_imports():
    edges = graph()
    assert "model.tools.bench" in edges["model.tools.cli"]  # imported inside a function
    assert "model.engine.hf" in edges["model.engine.loading"]  # `from model.engine import hf`, inside a function


def test_no_circle_of_imports():
    assert cycles(graph()) == []


def test_cycles_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_run_one_way():
    upward = []
    for module, targets in graph().items():
        here, room = floor(module)
        for target in targets:
            there, other = floor(target)
            # a room may use itself and the floors below; two rooms on one floor stay apart
            if there > here or (there == here and other != room):
                upward.append(f"{module} -> {target}")
    assert upward == []
