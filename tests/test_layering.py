"""The package's import graph, read from the source (`ast`): no circles, and the layering rules of
docs/ARCHITECTURE.md. Every import in a module counts: inside functions (a lazy import does not hide a
circle) and under `if TYPE_CHECKING:` (an import made only for annotations still ties the two modules
together: neither can be read or moved without the other). Only the run-time torch checks leave the
type-only imports out, since those never execute."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each sub-package's source lives (kernels/, models/ and tui/ install under localserve).
SOURCES = {"localserve": ROOT / "localserve", "localserve.kernels": ROOT / "kernels",
           "localserve.models": ROOT / "models", "localserve.tui": ROOT / "tui"}
# the scheduler and its parts, the step contract and the block manager: bookkeeping, never tensors; a
# request's grammar (plain data) and the matchers that follow it (llguidance, no torch)
TORCH_FREE = ("localserve.engine.scheduler", "localserve.engine.request_queues", "localserve.engine.batch",
              "localserve.engine.admission", "localserve.engine.preemption", "localserve.engine.step",
              "localserve.kv.block_manager", "localserve.engine.grammar", "localserve.engine.constraints")


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if package == "localserve" and parts[0] in ("kernels", "models", "tui"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imports_of(path: Path, module: str, is_package: bool, type_only: bool = True) -> set[str]:
    """Every module or package `module` imports, at any depth of its code; with `type_only`, the
    imports under `if TYPE_CHECKING:` too."""
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    skipped = set() if type_only else {
        id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
        for statement in node.body for inner in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(type_only: bool) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, plus "torch" / "triton" when it imports those."""
    modules = module_files()
    edges = {}
    for module, path in modules.items():
        imported = imports_of(path, module, path.name == "__init__.py", type_only)
        edges[module] = {name for name in imported if name in modules and name != module}
        edges[module] |= {name.split(".")[0] for name in imported if name.split(".")[0] in ("torch", "triton")}
    return edges


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(type_only=True)


@pytest.fixture(scope="module")
def runtime_graph() -> dict[str, set[str]]:
    """The imports that run (an annotation naming a torch type imports no torch)."""
    return import_graph(type_only=False)


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that reach one another through imports (Tarjan's strongly connected
    components of more than one module), sorted, so a failure lists every circle at once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def test_no_import_circles(graph):
    assert import_circles(graph) == []


def test_import_circles_are_found():
    # the test's own check: a circle of three and one through a package, beside a module outside any
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "p": {"p.m"}, "p.m": {"p"}}
    assert import_circles(graph) == [["a", "b", "c"], ["p", "p.m"]]


def forbidden_imports(graph, source_prefix: str, target_prefixes: tuple[str, ...]) -> list[str]:
    return [f"{module} imports {target}" for module, targets in graph.items()
            if module == source_prefix or module.startswith(source_prefix + ".")
            for target in targets if any(target == t or target.startswith(t + ".") for t in target_prefixes)]


@pytest.mark.parametrize("source,forbidden", [
    # kv/ is the bottom of the engine's stack: the model, its attention and its loading sit above it
    ("localserve.kv", ("localserve.engine", "localserve.server", "localserve.attention", "localserve.models",
                       "localserve.loading", "localserve.tui")),
    ("localserve.engine", ("localserve.server", "localserve.tui")),
    ("localserve.attention", ("localserve.engine", "localserve.server", "localserve.tui")),
    ("localserve.models", ("localserve.engine", "localserve.server", "localserve.tui")),
])
def test_layering(graph, source, forbidden):
    assert forbidden_imports(graph, source, forbidden) == []


# The server's rooms (docs/ARCHITECTURE.md): each API family a folder that imports no other; the wire knows no
# API, no model and no generation; the API-neutral parts (the requests, generation and its stream, the registry,
# the monitor) import no API.
SERVER = "localserve.server"
API_FOLDERS = tuple(f"{SERVER}.{name}" for name in ("openai", "ollama", "anthropic", "llama_cpp", "embeddings"))


@pytest.mark.parametrize("api", API_FOLDERS)
def test_an_api_folder_imports_no_other_api_folder(graph, api):
    assert forbidden_imports(graph, api, tuple(other for other in API_FOLDERS if other != api)) == []


@pytest.mark.parametrize("source,forbidden", [
    (f"{SERVER}.wire", (*API_FOLDERS, f"{SERVER}.registry", f"{SERVER}.generation", f"{SERVER}.monitor",
                        f"{SERVER}.app", f"{SERVER}.http_app")),
    (f"{SERVER}.request", (*API_FOLDERS, f"{SERVER}.registry", f"{SERVER}.generation", f"{SERVER}.wire")),
    (f"{SERVER}.generation", API_FOLDERS),
    (f"{SERVER}.registry", (*API_FOLDERS, f"{SERVER}.generation")),
    (f"{SERVER}.monitor", (*API_FOLDERS, f"{SERVER}.generation")),
])
def test_the_neutral_server_rooms_import_no_api(graph, source, forbidden):
    assert forbidden_imports(graph, source, forbidden) == []


def test_the_server_rooms_are_found():
    # the rules above name folders: each must exist, or a rule would pass by checking nothing
    modules = set(module_files())
    for room in (*API_FOLDERS, *(f"{SERVER}.{name}" for name in ("wire", "request", "generation", "registry",
                                                                  "monitor"))):
        assert room in modules and any(module.startswith(room + ".") for module in modules), room


def test_kernels_import_only_torch_triton_and_the_standard_library():
    allowed = {"torch", "triton", "fla"} | set(sys.stdlib_module_names)  # fla-core: Triton kernels (gated_delta.py)
    for path in SOURCES["localserve.kernels"].rglob("*.py"):
        for name in imports_of(path, "localserve.kernels", True):
            top = name.split(".")[0]
            assert top in allowed or name.startswith("localserve.kernels"), f"{path.name} imports {name}"


@pytest.mark.parametrize("module", TORCH_FREE)
def test_bookkeeping_modules_import_no_torch(runtime_graph, module):
    reachable, todo = set(), [module]
    while todo:
        for target in runtime_graph.get(todo.pop(), ()):
            if target not in reachable:
                reachable.add(target)
                todo.append(target)
    assert "torch" not in reachable, f"{module} reaches torch"
    # And at run time: importing it leaves torch out of the process.
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_imports_no_torch_for_the_chat_client():
    code = ("import sys; from localserve.cli import build_parser; build_parser(); "
            "import localserve.chat.client; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_test_modules_import_only_the_shared_helpers():
    # a test module imported by another ties two unrelated files together (and pytest may collect the
    # imported tests twice): whatever tests share lives in tests/helpers
    tests_root = ROOT / "tests"
    modules = {}
    for path in tests_root.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    shared = {module for module, path in modules.items() if path.name == "__init__.py" or module.startswith(
        "tests.helpers.")}
    found = sorted({f"{path.relative_to(ROOT)} imports {name}" for module, path in modules.items()
                    for name in imports_of(path, module, path.name == "__init__.py")
                    if name in modules and name not in shared})
    assert found == [], "\n".join(found)


# ---- the scheduler decides, the runner computes: no torch, no model call (docs/ARCHITECTURE.md)
MODEL_SIDE = ("torch", "triton", "localserve.models", "localserve.attention", "localserve.kernels",
              "localserve.loading", "localserve.engine.engine", "localserve.engine.model_runner",
              "localserve.engine.sampler", "localserve.engine.draft_model", "localserve.engine.ngram_drafter",
              "localserve.engine.builder")
# the attention package's registry of backend names (EngineConfig checks a name; it imports no backend)
NOT_MODEL_SIDE = {"localserve.attention"}


def test_the_scheduler_reaches_no_torch_and_no_model_code(runtime_graph):
    """The scheduler and every module it imports at run time, transitively: none is torch, a model, the
    runner or a drafter (it knows drafters only through engine/drafting.py's interface)."""
    reachable, todo = {"localserve.engine.scheduler"}, ["localserve.engine.scheduler"]
    while todo:
        for target in runtime_graph.get(todo.pop(), ()):
            if target not in reachable:
                reachable.add(target)
                todo.append(target)
    assert {"localserve.engine.speculation", "localserve.engine.drafting"} <= reachable  # the check sees them
    assert sorted(name for name in reachable - NOT_MODEL_SIDE
                  if any(name == side or name.startswith(side + ".") for side in MODEL_SIDE)) == []


SCHEDULE_WITH_A_RAISING_DRAFTER = """
import importlib.util
import sys
from localserve.engine.drafting import Draft
from localserve.engine.speculation import Speculation

def helper(name):  # read alone: the helpers' package imports torch for its fixtures
    spec = importlib.util.spec_from_file_location(name, f"{sys.argv[1]}/tests/helpers/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

make_scheduler, make_request, run = (getattr(helper("scheduler_states"), name)
                                     for name in ("make_scheduler", "make_request", "run"))
FixedStepCost = helper("spec_costs").FixedStepCost

class ForwardRaises:
    def propose(self, queries):
        raise AssertionError("the scheduler ran the drafter")
    def release(self, seq_id):
        pass

scheduler = make_scheduler(32)
bm = scheduler.block_manager
scheduler.speculation = Speculation(ForwardRaises(), 4, bm, 8, FixedStepCost(), scheduler.events)
requests = [run(scheduler, make_request(i, list(range(1, 30)), [[5, 6]], max_tokens=40)) for i in range(2)]
for step in range(3):
    batch = scheduler.schedule()  # drafting decided, not done
    assert [query.max_tokens for query in batch.drafting.queries] == [4, 4], batch.drafting
    assert isinstance(batch.drafting.drafter, ForwardRaises) and batch.num_draft_tokens == 0
    scheduler.add_drafts(batch, [Draft([7, 8]), Draft([])], 0.001)
    assert [row.query_len for row in batch.rows] == [3, 1] and batch.num_draft_tokens == 2
    assert batch.step_input.chunks == [row.chunk for row in batch.rows]
    scheduler.mark_computed(batch)
    for row, accepted in zip(batch.rows, [1, 0]):
        draft = scheduler.take_draft(row) if row.num_draft_tokens else Draft([])
        row.seq.token_ids.extend([7][:accepted] + [9])
        if draft.token_ids:
            scheduler.settle_draft(row.seq, len(draft.token_ids), accepted)
        row.seq.pending_append = True
    bm.check_integrity()
assert scheduler.speculation.totals.num_drafts == 3 and scheduler.speculation.totals.num_accepted_tokens == 3
assert "torch" not in sys.modules, "torch was imported"
"""


def test_schedule_never_runs_a_drafter_and_imports_no_torch():
    """Run time: a scheduler with speculation schedules steps whose rows draft, with a drafter that raises
    if asked for a draft; the engine's part (the drafts handed back, the verification settled) is played by
    hand; torch is never imported."""
    subprocess.run([sys.executable, "-c", SCHEDULE_WITH_A_RAISING_DRAFTER, str(ROOT)], check=True, cwd=ROOT)


def test_schedule_never_runs_the_draft_models_forward_pass():
    """The draft model's own drafter, over a runner whose forward pass raises: schedule() hands it out
    and never calls it; the engine would (and here it raises)."""
    from localserve.engine.draft_model import DraftModelDrafter
    from localserve.engine.drafting import Draft
    from localserve.engine.speculation import Speculation
    from localserve.kv.block_manager import BlockManager
    from tests.helpers.scheduler_states import make_request, make_scheduler, run
    from tests.helpers.spec_costs import FixedStepCost

    class ForwardRaises:
        device = "cpu"

        def execute(self, step_input):
            raise AssertionError("the draft model's forward pass ran")

    scheduler = make_scheduler(32)
    drafter = DraftModelDrafter(ForwardRaises(), BlockManager(32, 16, 0, enable_prefix_caching=True))
    scheduler.speculation = Speculation(drafter, 4, scheduler.block_manager, 8, FixedStepCost(), scheduler.events)
    run(scheduler, make_request(0, list(range(1, 30)), [[5, 6]], max_tokens=40))
    batch = scheduler.schedule()
    assert batch.drafting.drafter is drafter and [query.max_tokens for query in batch.drafting.queries] == [4]
    with pytest.raises(AssertionError, match="forward pass ran"):
        batch.drafting.drafter.propose(batch.drafting.queries)
    scheduler.add_drafts(batch, [Draft([])], 0.0)  # no draft after all: the step is a plain decode
    assert [row.query_len for row in batch.rows] == [1] and batch.step_input.chunks == [batch.rows[0].chunk]
    with pytest.raises(ValueError, match="add_drafts: this batch asks for no drafts"):
        scheduler.add_drafts(batch, [Draft([7])], 0.0)
