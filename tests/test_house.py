"""The house's imports run one way: pages → ui → recording → serving, training, speculative → engine → weights →
errors, texts; the command line (model/tools) sits on the top floor beside the pages and ui, and neither imports it;
the API server (server/) on that floor too, apart, and started by `python -m model serve`; the load-test client
(loadtest/, which asks the command line for reference runs) and the benchmarks above everything;
deploy/ apart, importing nothing of the project.

Every import of a project module, also those inside functions, is read from the source (ast), so that a lazy
import cannot hide a circle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# lower number = lower in the house; a module may import its own room or the floors below, never above, and two
# rooms on one floor stay apart ("model": its __init__ and the `python -m model` entry point, above the command line
# it starts; deploy/ on the ground floor, apart: it starts the app as processes)
FLOORS = {"deploy": 0, "model.texts": 0, "model.errors": 1, "model.weights": 2, "model.engine": 3,
          "model.training": 4, "model.speculative": 4, "model.serving": 4, "model.recording": 5, "ui": 6,
          "model.tools": 6, "server": 6, "app_pages": 7, "model": 7, "app": 8, "loadtest": 8, "benchmarks": 9}
# what a room may not use although its floor allows it: pages and ui never reach the command line's room, nor the
# API server's (server/: a page talks to it over HTTP, as any client)
APART = {("app_pages", "model.tools"), ("app_pages", "server")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    rooms = ("model", "ui", "app_pages", "benchmarks", "deploy", "loadtest", "server")
    paths = [ROOT / "app.py"] + [p for d in rooms for p in (ROOT / d).rglob("*.py")]
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
    assert "model.serving.timing" in edges["benchmarks.conditions"]  # the benchmarks are read too
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
            if there > here or (there == here and other != room) or (room, other) in APART:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_the_pages_and_ui_never_import_the_command_line():
    """Made red by one such arrow: the rule itself, not only today's graph."""
    edges = graph()
    assert not any(t.startswith("model.tools") for m, ts in edges.items() if m.startswith(("ui", "app_pages"))
                   for t in ts)
    reach = {"app_pages.serving": {"model.tools.serve_bench"}, "ui.run": {"model.tools.cli"}}
    for module, target in ((m, t) for m, ts in reach.items() for t in ts):
        here, room = floor(module)
        there, other = floor(target)
        assert there > here or (there == here and other != room) or (room, other) in APART, (module, target)


def test_the_batched_decode_is_the_models_own_forward():
    """No branch on the model's class in the serving room: every architecture takes positions and row keys."""
    for path in (ROOT / "model" / "serving").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                kinds = ast.unparse(node.args[1])
                assert not any(name in kinds for name in ("Llama", "Gemma3", "DecoderOnly")), (path, kinds)


# the serving room's own floors (issue 50): the request type below the memories, the memories below the servers,
# the measurements (measure.py, and workload.py, the Serving page's run) beside and above them; their formulas,
# timers and quality checks (costs, timing, quality) above the engine, which imports none of them
SERVING_FLOORS = {"request": 0, "blocks": 0, "paged": 1, "memory": 2, "runner": 2, "tiers": 3, "disaggregated": 3,
                  "engine": 5, "costs": 5.5, "timing": 5.5, "quality": 5.5, "forecast": 6,
                  "measure": 6, "crossover": 6, "analysis": 6, "queues": 6, "kv_lessons": 6, "kv_runs": 7,
                  "workload": 7}


def test_the_serving_room_imports_downward():
    """Made red once by memory.py importing the scheduler (now the engine's): a memory never knows who schedules
    it; and once by disaggregated.py importing the engine: a connector (the tier, the prefill worker) sits below the
    engine that builds it. Every module of the room has a floor (red once without costs'): one left out could be
    imported from any floor."""
    edges = graph()
    room = {m.removeprefix("model.serving.") for m in edges if m.startswith("model.serving.")}
    assert room == set(SERVING_FLOORS), room ^ set(SERVING_FLOORS)
    for module, level in SERVING_FLOORS.items():
        for target in edges[f"model.serving.{module}"]:
            name = target.removeprefix("model.serving.")
            assert name not in SERVING_FLOORS or SERVING_FLOORS[name] < level, (module, name)


def test_the_paged_pass_calls_the_model_in_one_place():
    """The model's forward is called in runner.py only: the engine's step, the prefill worker, the tier's crossover
    and the measurements' timed decode steps (measure.py) all run its pass. Made red once by the prefill worker's own
    call, and once by measure.py's accuracy calling the modules itself."""
    allowed = {"runner.py"}
    for path in (ROOT / "model" / "serving").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "module":
                assert path.name in allowed, (path.name, ast.unparse(node))


def test_one_step_in_the_serving_room():
    """Exactly one `def step(` in the serving room: engine.Engine's, the one schedule-and-run loop that the serving
    pages, the command line and the HTTP server drive. Made red once by QueueRun's own step (a wrapper that kept a
    second record), and once by a second `def step` put back in scheduler.py (the Serving page's slot server, before
    it ran on the engine's padded memory)."""
    found = [f"{path.stem}:{node.lineno}" for path in (ROOT / "model" / "serving").rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "step"]
    assert len(found) == 1 and found[0].startswith("engine:"), found


def test_the_memories_are_told_apart_in_memory_py_only():
    """No comparison of a layout or memory name with a string ("padded", "paged") and no isinstance on a memory
    class outside model/serving/memory.py: the scheduler, the runs, the pages and the command line see one protocol.
    Made red once by QueueRun's `settings.layout == "paged"` branches."""
    rooms = [ROOT / "model", ROOT / "ui", ROOT / "app_pages", ROOT / "server"]
    memories = ("BlockMemory",)
    for path in (p for room in rooms if room.exists() for p in room.rglob("*.py")):
        if path == ROOT / "model" / "serving" / "memory.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                names = [ast.unparse(x).split(".")[-1] for x in (node.left, *node.comparators)]
                strings = [x.value for x in (node.left, *node.comparators) if isinstance(x, ast.Constant)]
                assert not ({"layout", "memory"} & set(names) and set(strings) & {"padded", "paged"}), (
                    path, ast.unparse(node))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                assert not any(m in ast.unparse(node.args[1]) for m in memories), (path, ast.unparse(node))


def test_serve_reaches_the_server_room_from_the_entry_point_only():
    """`python -m model serve` is model/__main__.py's: the command line (model/tools) and the pages never import
    server/. Red once the entry point's lazy import is dropped, or a page imports server.loop."""
    edges = graph()
    assert "server.cli" in edges["model.__main__"]
    assert not any(t.startswith("server") for m, ts in edges.items() if m.startswith(("model.tools", "app_pages", "ui"))
                   for t in ts)
