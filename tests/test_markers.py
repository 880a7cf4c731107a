"""Test tiers stay honest: every test that starts the planner service, torchrun or a multi-process
world carries the `integration` marker (`make test-fast` deselects it), read from the sources.

A test needs the marker when its body, a module-level helper it calls, or a fixture it requests
(at any depth, in its module or a conftest) names `ServerProcess` or `start_serve`, spawns
processes through a multiprocessing context (`ctx.Process(...)`, `mp.spawn(...)`) or runs
`torch.distributed.run` / `torchrun` (a command-line argument of a call), or calls a shared helper
that starts a multi-process world (`tests.dist_helpers.spawn_ranks`). The marker may sit on the
test, its class, or the module's `pytestmark`.
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: names whose use starts the planner service or a multi-process world (shared test helpers included)
SERVICE_NAMES = {"ServerProcess", "start_serve", "spawn_ranks"}
#: string constants that launch torchrun
TORCHRUN = {"torch.distributed.run", "torchrun"}


def _starts_processes(fn: ast.AST) -> bool:
    """Does this function's own body start the service, torchrun or a multi-process world?"""
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id in SERVICE_NAMES:
            return True
        if isinstance(node, ast.Attribute) and node.attr in SERVICE_NAMES:
            return True
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("Process", "spawn"):
            return True
        # a command line handed to a call: run(["-m", "torch.distributed.run", ...])
        args = [e for a in node.args for e in (a.elts if isinstance(a, (ast.List, ast.Tuple)) else [a])]
        if any(isinstance(a, ast.Constant) and a.value in TORCHRUN for a in args):
            return True
    return False


def _called_names(fn: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _is_fixture(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            return True
    return False


def _marks(node: ast.AST) -> set[str]:
    """Marker names in decorators (`@pytest.mark.X`, `@pytest.mark.X(...)`) or a `pytestmark` value."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark":
            out.add(n.attr)
    return out


def _module_marks(tree: ast.Module) -> set[str]:
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            out |= _marks(node.value)
    return out


def _functions(tree: ast.Module) -> list[tuple[ast.FunctionDef, set[str]]]:
    """Every function at module level or in a class, with the marks of its class (if any)."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node, set()))
        elif isinstance(node, ast.ClassDef):
            class_marks = set().union(*(_marks(d) for d in node.decorator_list)) | _module_marks(node)
            out += [(f, class_marks) for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return out


def unmarked_integration_tests(root: Path = TESTS) -> list[str]:
    """`path::test` of each test that starts processes (module docstring) without the marker."""
    conftest_fixtures: dict[str, ast.FunctionDef] = {}
    for path in sorted(root.rglob("conftest.py")):
        for fn, _ in _functions(ast.parse(path.read_text())):
            if _is_fixture(fn):
                conftest_fixtures[fn.name] = fn
    missing = []
    for path in sorted(root.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        funcs = _functions(tree)
        helpers = {f.name: f for f, _ in funcs}
        fixtures = conftest_fixtures | {f.name: f for f, _ in funcs if _is_fixture(f)}
        memo: dict[str, bool] = {}

        def starts(fn: ast.FunctionDef, seen: frozenset = frozenset()) -> bool:
            if fn.name in memo:
                return memo[fn.name]
            if fn.name in seen:
                return False
            seen = seen | {fn.name}
            deps = [fixtures[a.arg] for a in fn.args.args if a.arg in fixtures]
            deps += [helpers[n] for n in _called_names(fn) if n in helpers]
            memo[fn.name] = result = _starts_processes(fn) or any(starts(d, seen) for d in deps)
            return result

        module_marks = _module_marks(tree)
        for fn, class_marks in funcs:
            if not fn.name.startswith("test_") or _is_fixture(fn):
                continue
            marks = module_marks | class_marks | set().union(*(_marks(d) for d in fn.decorator_list))
            if starts(fn) and "integration" not in marks:
                missing.append(f"{path.relative_to(root.parent)}::{fn.name}")
    return missing


def test_tests_that_start_processes_are_marked_integration():
    missing = unmarked_integration_tests()
    assert not missing, "mark these @pytest.mark.integration (they start the service, torchrun or processes):\n" + "\n".join(missing)


def test_the_check_sees_fixtures_helpers_and_marks(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(
        "import pytest\n@pytest.fixture\ndef live():\n    return start_serve('db', 'log')\n")
    (tmp_path / "tests" / "test_planted.py").write_text(
        "import pytest\n"
        "@pytest.fixture(scope='module')\ndef server(live):\n    return live\n"
        "def _world():\n    ctx = mp.get_context('spawn')\n    return [ctx.Process(target=print) for _ in range(2)]\n"
        "def test_through_fixtures(server):\n    pass\n"
        "def test_through_a_helper():\n    _world()\n"
        "def test_through_the_shared_helper():\n    spawn_ranks(print, 2, ())\n"
        "def test_torchrun():\n    run(['-m', 'torch.distributed.run'])\n"
        "@pytest.mark.integration\ndef test_marked(server):\n    pass\n"
        "class TestGroup:\n    pytestmark = pytest.mark.integration\n    def test_in_class(self, server):\n        pass\n"
        "def test_plain():\n    assert ['-m', 'torch.distributed.run'] == cmd('torchrun --nproc_per_node')\n")
    got = unmarked_integration_tests(tmp_path / "tests")
    assert got == [f"tests/test_planted.py::{n}" for n in ("test_through_fixtures", "test_through_a_helper",
                                                                 "test_through_the_shared_helper", "test_torchrun")]
