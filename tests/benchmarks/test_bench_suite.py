"""The benchmark suite (`harts bench`): result files, skipped and failing modules, the headline table."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from benchmarks import headline, placement_table, suite, suite_config, tables
from benchmarks.allocator import steady_allocator
from harts_client.synthetic import WorkloadConfig


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    # --no-trainer and no `trainer` / `rl` modules: the CPU executor needs seconds per step, and the
    # modules have their own tests; test_trainer_throughput_on_a_tiny_workload times the headline's measurement.
    only = [n for n in suite_config.NAMES if n not in ("trainer", "rl")]
    r = subprocess.run([sys.executable, "-m", "harts_cli.main", "bench", "--quick", "--no-trainer", "--out", str(out),
                        "--only", ",".join(only)],
                       capture_output=True, text=True, timeout=300)
    return r, out, only


@pytest.mark.slow
@pytest.mark.integration
def test_quick_suite_writes_results(quick_run):
    r, out, only = quick_run
    assert r.returncode in (0, 1), r.stderr  # 1: some benchmark failed, reported in the files
    printed = json.loads(r.stdout)
    doc = json.loads((out / "results.json").read_text())
    assert doc["mode"] == "quick" and set(doc["benchmarks"]) == set(only) == set(printed["benchmarks"])
    assert r.returncode == (1 if any(e["status"] == "failed" for e in doc["benchmarks"].values()) else 0)
    wl = doc["benchmarks"]["workloads"]
    assert wl["status"] == "ok", wl.get("traceback")
    rows = wl["result"]["rows"]
    assert [row["workload"] for row in rows] == [s.name for s in headline.workload_specs(quick=True)]
    for row in rows:
        assert row["compression_ideal"] == pytest.approx(row["expanded_tokens"] / row["unique_tokens"])
        if "computed_tokens" in row:  # the planner has landed
            assert row["computed_tokens"] >= row["unique_tokens"]
            assert row["compression_achieved"] <= row["compression_ideal"] + 1e-9
            assert row["linear_attention_calls"] >= row["linear_attention_calls_expanded"] >= 1
        if "throughput_ratio" in row:  # the trainer has landed
            assert row["tree_tokens_per_cpu_s"] > 0 and row["fraction_of_ideal"] > 0
    for name, entry in doc["benchmarks"].items():
        assert entry["status"] in ("ok", "skipped", "failed")
        text = (out / f"{name}.md").read_text()
        assert f"Status: **{entry['status']}**" in text
        if entry["status"] == "skipped":
            assert entry["reason"] in text
    summary = (out / "summary.md").read_text()
    table = (out / "README-table.md").read_text()
    for row in rows:
        assert f"| {row['workload']} |" in summary and f"| {row['workload']} |" in table
    assert "token compression" in table and "HARTS" in table and "compression.png" in table
    assert (out / "compression.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_trainer_throughput_on_a_tiny_workload():
    pytest.importorskip("trainer.executor")
    pytest.importorskip("planner_service.planner")
    spec = headline.WorkloadSpec(name="tiny percall", gen=dict(scheme="percall", tasks=1, seed=0, scale=0.005, group_size=1, turns=(10, 10)))
    cfg = suite_config.SuiteConfig(quick=True, trainer_warmup=False, trainer_steps=1, reference_planner=False)
    threads = torch.get_num_threads()
    row = headline.measure_workload(spec, cfg)
    assert row["trainer_threads"] == 1 and torch.get_num_threads() == threads  # timed on one, then restored
    assert row["compression_ideal"] > 3 and row["linear_attention_calls_expanded"] == 1
    assert row["throughput_ratio"] == pytest.approx(row["expanded_step_cpu_seconds"] / row["tree_step_cpu_seconds"])
    assert row["throughput_ratio_wall"] == pytest.approx(row["expanded_step_seconds"] / row["tree_step_seconds"])
    assert row["tree_tokens_per_cpu_s"] == pytest.approx(row["expanded_tokens"] / row["tree_step_cpu_seconds"])
    assert row["fraction_of_ideal"] == pytest.approx(row["throughput_ratio"] / row["flop_compression"])
    assert row["fraction_of_token_compression"] == pytest.approx(row["throughput_ratio"] / row["compression_ideal"])
    # Replay rows cost the tree plan kernel FLOPs and its deep rows cost attention: the FLOP ideal
    # sits below the token compression and above the plan's achieved (row) compression here.
    assert row["flops_tree"]["linear_kernel"] > 0 and row["flops_expanded"]["attention"] > row["flops_tree"]["attention"]
    assert row["flop_compression"] == pytest.approx(row["flops_expanded"]["total"] / row["flops_tree"]["total"])
    assert row["compression_achieved"] <= row["flop_compression"] <= row["compression_ideal"]
    # the peer on the same weights: transformers, trajectory by trajectory
    assert row["transformers_tokens_per_cpu_s"] > 0 and row["peak_saved_bytes_transformers"] > 0
    assert row["tree_vs_transformers"] == pytest.approx(row["tree_tokens_per_cpu_s"] / row["transformers_tokens_per_cpu_s"])
    assert row["peak_saved_bytes_tree"] > 0 and row["peak_live_tokens_tree"] > 0


def test_missing_and_failing_modules_are_reported(tmp_path, monkeypatch):
    (tmp_path / "bench_boom_h5.py").write_text(textwrap.dedent("""
        def run(quick=False):
            raise RuntimeError("boom")
    """))
    (tmp_path / "bench_fine_h5.py").write_text(textwrap.dedent("""
        def run(quick=False):
            return {"quick": quick, "rows": [{"case": "a", "seconds": 0.5}], "tokens_per_s": 12345.6}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = {"ghost": ("benchmarks.bench_ghost_h5", "never written"),
               "boom": ("bench_boom_h5", "raises"), "fine": ("bench_fine_h5", "works")}
    monkeypatch.setattr(suite_config, "MODULES", modules)
    monkeypatch.setattr(suite_config, "NAMES", ("workloads", *modules))
    doc = suite.run_suite(suite_config.SuiteConfig(out_dir=tmp_path / "out", quick=True, only=("ghost", "boom", "fine")))
    b = doc["benchmarks"]
    assert list(b) == ["ghost", "boom", "fine"]
    assert b["ghost"]["status"] == "skipped" and "benchmarks/bench_ghost_h5.py is not present yet" in b["ghost"]["reason"]
    assert b["boom"]["status"] == "failed" and b["boom"]["error"] == "RuntimeError: boom"
    assert b["fine"]["status"] == "ok" and b["fine"]["result"]["quick"] is True
    fine = (tmp_path / "out" / "fine.md").read_text()
    assert "| tokens_per_s | 12,346 |" in fine and "| a | 0.500 |" in fine
    assert "RuntimeError: boom" in (tmp_path / "out" / "boom.md").read_text()
    assert not (tmp_path / "out" / "README-table.md").exists()  # the headline did not run


def test_headline_table_formats_every_column():
    row = {"workload": "tree (k=2)", "expanded_tokens": 123456, "compression_ideal": 6.0, "computed_per_unique": 1.04,
           "compression_achieved": 5.77, "planner_seconds": 0.0123, "planner_ref_seconds": 1.5,
           "linear_attention_calls": 4, "linear_attention_calls_expanded": 1, "flop_compression": 5.9,
           "tree_tokens_per_cpu_s": 4800.4, "expanded_tokens_per_cpu_s": 1000.0, "transformers_tokens_per_cpu_s": 900.0,
           "tree_vs_transformers": 5.333, "expanded_vs_transformers": 1.111, "throughput_ratio": 4.8,
           "fraction_of_ideal": 0.81, "tree_vs_transformers_ideal": 0.904}
    table = tables.headline_table([row, {"workload": "bare"}])
    header, rule, full, bare = table.splitlines()
    assert header.count("|") == rule.count("|") == full.count("|") == bare.count("|") == len(tables.HEADLINE) + 1
    assert full == ("| tree (k=2) | 123,456 | 6.00x | 1.040 | 5.77x | 0.012 | 1.500 | 4 / 1 | 5.90x | 4,800 | 1,000 | 900 "
                    "| 5.33x | 1.11x | 4.80x | 81% | 90% |")
    assert bare == "| bare |" + " - |" * (len(tables.HEADLINE) - 1)
    # Planning only (--full): the throughput columns are left out.
    planned = {k: v for k, v in row.items() if k in ("workload", "expanded_tokens", "compression_ideal", "computed_per_unique",
                                                     "compression_achieved", "planner_seconds", "planner_ref_seconds",
                                                     "linear_attention_calls", "linear_attention_calls_expanded")}
    header, _, line = tables.headline_table([planned]).splitlines()
    assert "throughput" not in header and "FLOP" not in header and line.endswith("| 4 / 1 |")


def test_modes_and_names():
    assert suite_config.SuiteConfig(full=True).names() == ["workloads"]
    assert suite_config.SuiteConfig(only=("planner",)).names() == ["planner"]
    with pytest.raises(ValueError, match="^only: expected"):
        suite_config.SuiteConfig(only=("nope",))
    with pytest.raises(ValueError, match="^full: expected"):
        suite_config.SuiteConfig(quick=True, full=True)
    full = headline.workload_specs(full=True)
    # Full scale keeps the published lengths: tens of millions of expanded tokens per workload.
    assert all(WorkloadConfig(**s.gen).scale == 1.0 and s.windows for s in full)
    r = subprocess.run([sys.executable, "-m", "harts_cli.main", "bench", "--only", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "expected names from" in r.stderr


def test_steady_allocator_sets_the_glibc_thresholds():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert steady_allocator() is True


def test_bench_trainer_forward_only_modes_against_transformers():
    """The log-prob modes (what `harts logprobs` runs) beside transformers' forward, same weights."""
    pytest.importorskip("trainer.executor")
    from benchmarks import bench_trainer  # optional: after the importorskip above

    name, gen = bench_trainer.QUICK_WORKLOADS[0]
    row = bench_trainer.bench_workload(name, gen, steps=1, chunk_size=16, microbatch_tokens=256, model_name="tiny",
                                       max_baseline_tokens=2000,
                                       modes=("windows_logprobs", "expanded_logprobs", "transformers_logprobs"))
    assert row["windows_logprobs_tokens_per_cpu_s"] > 0 and row["transformers_logprobs_tokens_per_cpu_s"] > 0
    assert row["logprobs_expanded_vs_transformers"] == pytest.approx(
        row["expanded_logprobs_tokens_per_cpu_s"] / row["transformers_logprobs_tokens_per_cpu_s"])
    assert "windows_peak_saved_bytes" not in row  # no backward, no saved activations measured
    assert "| windows / transformers |" in bench_trainer.result_markdown({"workloads": [row], "settings": {}})


def test_placement_table_shows_the_lockstep_ratio_of_every_cell():
    rows = placement_table.run_placement(suite_config.SuiteConfig(quick=True))["rows"]
    worlds, budgets, _ = placement_table.PLACEMENT_GRID["quick"]
    assert len(rows) == 3 * len(worlds) * len(budgets)
    for r in rows:
        assert r["lockstep_ratio"] >= 1.0 - 1e-9 and r["lockstep_phases"] > 0
        assert r["lockstep_met"] == (r["lockstep_ratio"] <= placement_table.LOCKSTEP_TARGET)
    table = placement_table.placement_table(rows).splitlines()
    assert "lockstep_ratio" in table[0]
    assert all(f"{r['lockstep_ratio']:.3f}" in line for r, line in zip(rows, table[2:]))
