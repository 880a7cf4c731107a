"""Small generated Python repositories with one planted bug and the tests that catch it.

    repo = generate_repo(np.random.default_rng(3), modules=2, functions=3)
    repo.files["toolkit/numbers.py"]       # the package's modules (one of them buggy), tests/test_*.py
    repo.bug                               # where: path, 1-based line, the buggy and the correct line
    repo.failing                           # ["tests/test_numbers.py::test_gcd"]

The library's functions are trusted code, run here to compute the expected values; the policy's
code only runs in the sandbox (docs/design/training-loop.md, "Tasks").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Function", "Bug", "Repo", "generate_repo", "FUNCTIONS", "THEMES", "PACKAGES"]

_WORDS = ("banana", "Sky", "queue", "Education", "rhythm", "level", "Racecar", "noon", "python", "A man a plan",
          "hello world", "stats", "Was it a car", "tree", "OpenAI", "abba", "x")


@dataclass(frozen=True, slots=True)
class Function:
    """A function of the library: its source, one-line mutations and an input generator."""

    name: str
    params: str
    body: str
    """The body, indented by 4 spaces, lines joined by newlines."""
    mutations: tuple[tuple[str, str], ...]
    """(text, replacement) pairs; each text occurs in exactly one line of the body."""
    args: Callable[[np.random.Generator], tuple]

    def source(self, mutation: tuple[str, str] | None = None) -> str:
        body = self.body if mutation is None else self.body.replace(mutation[0], mutation[1], 1)
        return f"def {self.name}({self.params}):\n{body}\n"


def _ints(lo: int, hi: int, n_lo: int = 0, n_hi: int = 6) -> Callable[[np.random.Generator], list[int]]:
    return lambda r: [int(x) for x in r.integers(lo, hi, int(r.integers(n_lo, n_hi)))]


def _word(r: np.random.Generator) -> str:
    return _WORDS[int(r.integers(0, len(_WORDS)))]


def _sorted_or_not(r: np.random.Generator) -> list[int]:
    xs = _ints(0, 6, 0, 6)(r)
    return sorted(xs) if r.random() < 0.5 else xs


FUNCTIONS: dict[str, Function] = {f.name: f for f in (
    Function("clamp", "x, lo, hi", "    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x",
             (("return hi", "return lo"), ("x < lo", "x > lo")),
             lambda r: (int(r.integers(-20, 21)), int(r.integers(-10, 0)), int(r.integers(1, 11)))),
    Function("factorial", "n", "    result = 1\n    for k in range(2, n + 1):\n        result *= k\n    return result",
             (("n + 1", "n"), ("result = 1", "result = 0")), lambda r: (int(r.integers(0, 9)),)),
    Function("gcd", "a, b", "    while b:\n        a, b = b, a % b\n    return a",
             (("return a", "return b"), ("while b:", "while b > 1:")),
             lambda r: (int(r.integers(1, 60)), int(r.integers(1, 60)))),
    Function("fibonacci", "n", "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
             (("a, b = 0, 1", "a, b = 1, 1"), ("return a", "return b")), lambda r: (int(r.integers(0, 15)),)),
    Function("digit_sum", "n", "    total = 0\n    for ch in str(abs(n)):\n        total += int(ch)\n    return total",
             (("abs(n)", "n"), ("total += int(ch)", "total = int(ch)")), lambda r: (int(r.integers(-999, 1000)),)),
    Function("to_fahrenheit", "celsius", "    return celsius * 9 / 5 + 32",
             (("9 / 5", "5 / 9"), ("+ 32", "- 32")), lambda r: (int(r.integers(-40, 101)),)),
    Function("mean", "values", "    if not values:\n        return 0.0\n    return sum(values) / len(values)",
             (("/ len(values)", "/ (len(values) + 1)"), ("return 0.0", "return 1.0")), lambda r: (_ints(-9, 10)(r),)),
    Function("is_sorted", "values",
             "    for i in range(len(values) - 1):\n        if values[i] > values[i + 1]:\n            return False\n"
             "    return True",
             (("values[i] > values[i + 1]", "values[i] >= values[i + 1]"), ("len(values) - 1", "len(values) - 2")),
             lambda r: (_sorted_or_not(r),)),
    Function("chunk", "values, size",
             "    out = []\n    for start in range(0, len(values), size):\n        out.append(values[start:start + size])\n"
             "    return out",
             (("start:start + size", "start:start + size - 1"), ("range(0,", "range(1,")),
             lambda r: (_ints(0, 10, 0, 8)(r), int(r.integers(1, 4)))),
    Function("dedupe", "values",
             "    seen = set()\n    out = []\n    for v in values:\n        if v not in seen:\n            seen.add(v)\n"
             "            out.append(v)\n    return out",
             (("out.append(v)", "out.insert(0, v)"), ("seen.add(v)", "pass")), lambda r: (_ints(0, 4, 0, 7)(r),)),
    Function("running_total", "values",
             "    total = 0\n    out = []\n    for v in values:\n        total += v\n        out.append(total)\n    return out",
             (("total += v", "total = v"), ("out.append(total)", "out.append(v)")), lambda r: (_ints(-5, 6)(r),)),
    Function("max_index", "values",
             "    best = 0\n    for i in range(1, len(values)):\n        if values[i] > values[best]:\n            best = i\n"
             "    return best",
             (("values[i] > values[best]", "values[i] < values[best]"), ("range(1,", "range(2,")),
             lambda r: (_ints(-9, 10, 1, 7)(r),)),
    Function("count_vowels", "text",
             "    count = 0\n    for ch in text.lower():\n        if ch in \"aeiou\":\n            count += 1\n    return count",
             (("\"aeiou\"", "\"aeio\""), ("text.lower()", "text")), lambda r: (_word(r),)),
    Function("reverse_words", "sentence", "    words = sentence.split()\n    return \" \".join(reversed(words))",
             (("reversed(words)", "words"), ("\" \".join", "\"\".join")), lambda r: (f"{_word(r)} {_word(r)} {_word(r)}",)),
    Function("is_palindrome", "text",
             "    cleaned = [ch.lower() for ch in text if ch.isalnum()]\n    return cleaned == cleaned[::-1]",
             (("ch.lower()", "ch"), ("cleaned[::-1]", "cleaned[1:]")), lambda r: (_word(r),)),
    Function("word_lengths", "text", "    return {word: len(word) for word in text.split()}",
             (("len(word)", "len(word) - 1"), ("text.split()", "text.split(\"a\")")), lambda r: (f"{_word(r)} {_word(r)}",)),
)}

#: module name -> the functions it may hold
THEMES: dict[str, tuple[str, ...]] = {
    "numbers": ("clamp", "factorial", "gcd", "fibonacci", "digit_sum", "to_fahrenheit"),
    "sequences": ("mean", "is_sorted", "chunk", "dedupe", "running_total", "max_index"),
    "text": ("count_vowels", "reverse_words", "is_palindrome", "word_lengths"),
}
PACKAGES = ("toolkit", "mathkit", "corelib", "pyhelpers", "utilbox", "minilib")


@dataclass(frozen=True, slots=True)
class Bug:
    """The planted bug: the one line that differs from the correct repository."""

    path: str
    line: int
    """1-based line number in `path`."""
    buggy: str
    correct: str
    function: str


@dataclass(frozen=True, slots=True)
class Repo:
    """A generated repository: its files (path -> text), the bug and the tests it makes fail."""

    package: str
    files: dict[str, str]
    bug: Bug
    failing: tuple[str, ...]
    """Test ids ("tests/test_<module>.py::test_<function>") that fail before the fix."""


def _call(fn_source: str, name: str, args: tuple):
    scope: dict = {}
    exec(fn_source, scope)  # trusted library code (this module), never the policy's
    try:
        return ("ok", scope[name](*args))
    except Exception as exc:  # a mutant may raise: the test then fails with that exception
        return ("raises", type(exc).__name__)


def _test_source(package: str, module: str, fn: Function, cases: list[tuple]) -> str:
    lines = [f"def test_{fn.name}():"]
    for args in cases:
        kind, want = _call(fn.source(), fn.name, args)
        assert kind == "ok", (fn.name, args, want)
        lines.append(f"    assert {fn.name}({', '.join(map(repr, args))}) == {want!r}")
    return "\n".join(lines) + "\n"


def generate_repo(rng: np.random.Generator, *, modules: int = 2, functions: int = 3, cases: int = 3) -> Repo:
    """A repository with one planted bug (docs/design/training-loop.md, "Tasks").

    Args:
        modules: modules in the package (1 <= modules <= len(THEMES)).
        functions: functions per module (1 <= functions <= 4).
        cases: asserts per test (>= 1; the buggy function's test gets one more when needed).
    """
    if not 1 <= modules <= len(THEMES):
        raise ValueError(f"task.modules: expected 1 <= modules <= {len(THEMES)}, got {modules}")
    if not 1 <= functions <= 4:
        raise ValueError(f"task.functions: expected 1 <= functions <= 4, got {functions}")
    if cases < 1:
        raise ValueError(f"task.cases: expected >= 1, got {cases}")
    package = PACKAGES[int(rng.integers(0, len(PACKAGES)))]
    themes = [list(THEMES)[int(i)] for i in sorted(rng.choice(len(THEMES), modules, replace=False))]
    chosen = {t: [THEMES[t][int(i)] for i in sorted(rng.choice(len(THEMES[t]), functions, replace=False))] for t in themes}
    bug_theme = themes[int(rng.integers(0, modules))]
    bug_fn = FUNCTIONS[chosen[bug_theme][int(rng.integers(0, functions))]]
    mutation = bug_fn.mutations[int(rng.integers(0, len(bug_fn.mutations)))]
    files = {f"{package}/__init__.py": f'"""{package}: small utilities."""\n'}
    bug = None
    for theme in themes:
        path = f"{package}/{theme}.py"
        parts, line = [f'"""{theme.capitalize()} helpers."""\n'], 2
        tests = [f"from {package}.{theme} import {', '.join(chosen[theme])}\n"]
        for name in chosen[theme]:
            fn = FUNCTIONS[name]
            cases_of = [fn.args(rng) for _ in range(cases)]
            if fn is bug_fn:
                source = fn.source(mutation)
                at = next(i for i, ln in enumerate(fn.body.split("\n")) if mutation[0] in ln)
                correct = fn.body.split("\n")[at]
                bug = Bug(path, line + 2 + 1 + at, correct.replace(mutation[0], mutation[1], 1), correct, name)
                differs = lambda a: _call(fn.source(), name, a) != _call(source, name, a)  # noqa: E731
                if not any(differs(a) for a in cases_of):
                    for _ in range(1000):
                        a = fn.args(rng)
                        if differs(a):
                            cases_of.append(a)
                            break
                    else:  # pragma: no cover - every mutation of the library has distinguishing inputs
                        raise AssertionError(f"no input tells {name} from its mutant {mutation}")
            else:
                source = fn.source()
            parts.append("\n\n" + source)
            line += 2 + source.count("\n")
            tests.append("\n\n" + _test_source(package, theme, fn, cases_of))
        files[path] = "".join(parts)
        files[f"tests/test_{theme}.py"] = "".join(tests)
    assert bug is not None and files[bug.path].split("\n")[bug.line - 1] == bug.buggy
    return Repo(package, files, bug, (f"tests/test_{bug_theme}.py::test_{bug.function}",))
