"""benchmarks.bench_fsdp_memory: its plan is a valid lock-step plan on every rank (the measurement
itself is the benchmark's, `python -m benchmarks.bench_fsdp_memory`)."""
from __future__ import annotations

from benchmarks.bench_fsdp_memory import make_plan, markdown
from plan.slice_check import check_rank


def test_the_plan_without_windows_padded_with_standins_is_lock_step():
    plan = make_plan(4, 2)
    assert plan.header.params.lockstep and len({len(r.steps) for r in plan.ranks}) == 1
    for r in plan.ranks:
        steps = check_rank(plan.header, r).steps
        assert sum(i < 0 for _, i in steps) == 2 * (len(steps) // 2 - len(r.microbatches))


def test_markdown_names_both_schedules_and_the_goal():
    r = {"world_size": 4, "layers": 2, "parameters": 10, "full_param_grad_bytes": 80, "unit_param_grad_bytes_max": 8,
         "goal_bytes": 44.0, "sharded": {"peak_param_grad_bytes": 40, "fraction_of_full": 0.5, "per_rank": [40] * 4,
                                         "meets_goal": True},
         "gathered": {"peak_param_grad_bytes": 90, "fraction_of_full": 1.125, "per_rank": [90] * 4}}
    text = markdown(r)
    assert "| true (lock-step) |" in text and "| false |" in text and "meets the goal: yes" in text
