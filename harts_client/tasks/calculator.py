"""Arithmetic with a calculator tool: a verifiable multi-turn task for small policies.

    Q: 37+45-12                       prompt (after a system line shared by every episode)
    calc 37+45<eos>                   policy turn 1: a tool call
    = 82                              observation: the calculator's answer (context, no loss)
    calc 82-12<eos>                   policy turn 2
    = 70
    A: 70<eos>                        policy turn 3: the answer; the episode ends

The rules, the reward (`partial_credit`) and the demonstration (`demo_accuracy`):
docs/design/training-loop.md ("Tasks").
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from harts_client.tasks.episode import Episode

__all__ = ["CalculatorTask", "Instance", "evaluate"]

_CALL = re.compile(r"^calc\s+(-?\d+(?:\s*[-+*]\s*-?\d+)*)\s*$")
_ANSWER = re.compile(r"^A:\s*(-?\d+)\s*$")
_EXPR = re.compile(r"^(-?\d+)((?:[-+*]-?\d+)*)$")
_TERM = re.compile(r"([-+*])(-?\d+)")
_SPLITS = {"train": 0, "eval": 1}


@dataclass(frozen=True, slots=True)
class Instance:
    """One question: numbers[0] ops[0] numbers[1] ops[1] ... evaluated left to right."""

    id: str
    numbers: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def question(self) -> str:
        return str(self.numbers[0]) + "".join(f"{o}{n}" for o, n in zip(self.ops, self.numbers[1:]))

    def partials(self) -> list[int]:
        """The value after each operator (the last one is the answer)."""
        out, acc = [], self.numbers[0]
        for o, n in zip(self.ops, self.numbers[1:]):
            acc = _apply(acc, o, n)
            out.append(acc)
        return out

    @property
    def answer(self) -> int:
        return self.partials()[-1]


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def evaluate(expression: str) -> int | None:
    """Value of `A op B op C ...` (integers, + - *, left to right); None when it is not one."""
    m = _EXPR.match(expression.replace(" ", ""))
    if m is None:
        return None
    acc = int(m.group(1))
    for op, num in _TERM.findall(m.group(2)):
        acc = _apply(acc, op, int(num))
    return acc


class CalculatorTask:
    """Arithmetic chains solved through calculator calls (docs/design/training-loop.md, "Tasks").

    Args:
        operands: numbers per question (>= 2); operands - 1 tool calls, then the answer.
        digits: digits of each number (>= 1).
        ops: the operators drawn, a non-empty subset of "+-*".
        system: text before every question (shared by all episodes of an instance).
        partial_credit: reward correct intermediate calls too (1 / operands each).
        demo_accuracy: probability that a demonstrated call is right (warm-start data).
    """

    name = "calculator"

    def __init__(self, *, operands: int = 3, digits: int = 2, ops: str = "+-",
                 system: str = "Solve with calc. Reply 'calc X' or 'A: N'.\n", partial_credit: bool = False,
                 demo_accuracy: float = 1.0):
        if operands < 2:
            raise ValueError(f"task.operands: expected >= 2, got {operands}")
        if digits < 1:
            raise ValueError(f"task.digits: expected >= 1, got {digits}")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"task.ops: expected a non-empty subset of '+-*', got {ops!r}")
        if not 0.0 <= demo_accuracy <= 1.0:
            raise ValueError(f"task.demo_accuracy: expected in [0, 1], got {demo_accuracy}")
        self.operands, self.digits, self.ops = operands, digits, ops
        self.system, self.partial_credit, self.demo_accuracy = system, partial_credit, demo_accuracy
        self.max_turns = operands

    def instances(self, split: str, count: int, seed: int) -> list[Instance]:
        """`count` questions of `split` ("train" or "eval": disjoint streams) from `seed`."""
        if split not in _SPLITS:
            raise ValueError(f"split: expected one of {sorted(_SPLITS)}, got {split!r}")
        rng = np.random.default_rng([seed, _SPLITS[split]])
        lo, hi = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10 ** self.digits
        out = []
        for i in range(count):
            numbers = tuple(int(x) for x in rng.integers(lo, hi, self.operands))
            ops = tuple(self.ops[int(j)] for j in rng.integers(0, len(self.ops), self.operands - 1))
            out.append(Instance(f"{split}-{seed}-{i}", numbers, ops))
        return out

    def prompt(self, instance: Instance) -> str:
        return f"{self.system}Q: {instance.question}\n"

    def observe(self, instance: Instance, turns: list[str]) -> str | None:
        """The calculator's answer to the last turn; None when the episode is over."""
        last = turns[-1].strip()
        if _ANSWER.match(last) or len(turns) >= self.max_turns:
            return None
        call = _CALL.match(last)
        value = evaluate(call.group(1)) if call else None
        return "error\n" if value is None else f"= {value}\n"

    def reward(self, episode: Episode) -> float:
        inst: Instance = episode.instance
        texts = [t.strip() for t in episode.texts]
        answer = _ANSWER.match(texts[-1]) if texts else None
        if answer is not None and int(answer.group(1)) == inst.answer:
            return 1.0
        if not self.partial_credit:
            return 0.0
        partials = inst.partials()
        credit = 0
        for k, text in enumerate(texts[: len(partials)]):
            call = _CALL.match(text)
            if call and evaluate(call.group(1)) == partials[k]:
                credit += 1
        return credit / self.operands

    def demonstration(self, instance: Instance, rng: np.random.Generator) -> list[str]:
        """Policy turns of a solving episode (a wrong operand per call with prob. 1 - demo_accuracy)."""
        turns, acc = [], instance.numbers[0]
        lo, hi = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10 ** self.digits
        for op, num in zip(instance.ops, instance.numbers[1:]):
            if rng.random() >= self.demo_accuracy:
                num = int(rng.integers(lo, hi))
            turns.append(f"calc {acc}{op}{num}")
            acc = _apply(acc, op, num)
        turns.append(f"A: {acc}")
        return turns
