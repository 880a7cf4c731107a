"""The shape of the house (scripts/import_graph.py): no import circle among project modules, no
forbidden arrow between packages, and the scanner finds what it must on a planted tree."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


ig = _load()

#: circles that are known and owned elsewhere (none left); the test fails when one disappears, so
#: that the entry goes with it
KNOWN_CYCLES: set[str] = set()


@pytest.fixture(scope="module")
def graph():
    return ig.scan(ROOT)


def test_no_import_cycles(graph):
    found = {" -> ".join(c) for c in ig.cycles(graph)}
    assert found - KNOWN_CYCLES == set(), "new import circles:\n" + "\n".join(sorted(found - KNOWN_CYCLES))
    assert KNOWN_CYCLES - found == set(), "gone, remove from KNOWN_CYCLES: " + ", ".join(sorted(KNOWN_CYCLES - found))


@pytest.mark.parametrize("rule", ig.RULES, ids=lambda r: f"{r.source}-not-{'-'.join(r.targets[:3])}")
def test_no_forbidden_arrows(graph, rule):
    bad = [imp.where() for r, imp in ig.violations(graph, (rule,))]
    assert not bad, f"{rule.why}:\n" + "\n".join(bad)


def test_every_package_is_scanned(graph):
    assert {ig.top(m) for m in graph.modules} == set(ig.PACKAGES)
    assert "harts_cli.cmd_bench" in graph.modules and "plan.memory_model" in graph.modules


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_scanner_finds_lazy_type_only_and_relative_imports(tmp_path):
    _plant(tmp_path, {
        "plan/__init__.py": "",
        "plan/a.py": "from plan import b\n",  # `from pkg import submodule`: an arrow to the submodule only
        "plan/b.py": "def f():\n    from .a import x\n",  # relative and lazy: still a dependency
        "plan/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\nelse:\n    import numpy\n",
        "harts_client/__init__.py": "",
        "harts_client/g.py": "import os\n\ndef engine():\n    import torch.nn\n    from planner_service.core import X\n",
        "planner_service/__init__.py": "",
        "planner_service/core.py": "X = 1\n",
    })
    g = ig.scan(tmp_path)
    assert [" -> ".join(c) for c in ig.cycles(g)] == ["plan.a -> plan.b -> plan.a"]
    by = {(i.source, i.target): i for i in g.imports}
    assert ("plan.a", "plan") not in by and by["plan.b", "plan.a"].lazy
    assert by["plan.c", "torch"].type_only and not by["plan.c", "numpy"].type_only
    where = sorted(imp.where() for _, imp in ig.violations(g))
    assert where == ["harts_client.g:4 -> torch (lazy)", "harts_client.g:5 -> planner_service.core (lazy)",
                     "plan.c:3 -> torch (TYPE_CHECKING)"]


def test_script_checks_and_draws(tmp_path, capsys):
    _plant(tmp_path, {"kernels/__init__.py": "", "kernels/k.py": "import trainer.x\n",
                      "trainer/__init__.py": "", "trainer/x.py": "import kernels.k\n"})
    dot, svg = tmp_path / "g.dot", tmp_path / "g.svg"
    assert ig.main(["--root", str(tmp_path), "--check", "--dot", str(dot), "--svg", str(svg)]) == 1
    out = capsys.readouterr().out
    assert "kernels.k -> trainer.x -> kernels.k" in out and "kernels.k:1 -> trainer.x" in out
    assert '"kernels" -> "trainer" [label="1", color=red' in dot.read_text()
    text = svg.read_text()
    assert text.startswith("<svg") and ">kernels</text>" in text and 'stroke="red"' in text
    assert ig.main(["--root", str(tmp_path), "--modules", "trainer"]) == 0
    assert "trainer.x:1 -> kernels.k" in capsys.readouterr().out
