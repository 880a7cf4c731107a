"""benchmarks.bench_gpu and scripts/gpu_check.sh: the bench model, the section runner's budgets and
result files, the profile's counts, and the whole GPU check as `--dry-run` on the CPU (every step,
every section's code path)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import benchmarks.peer as peer_mod
from benchmarks.gpu.context import BenchContext
from benchmarks.gpu.fidelity import logprob_diff
from benchmarks.gpu.peer_section import peer_section
from benchmarks.gpu.runner import Deadline, Runner, SectionTimeout, Terminated
from benchmarks.gpu.settings import SECTIONS, dry_run, full, quick
from benchmarks.gpu.step_profile import summarize
from trainer.models import meta_model, model_config
from trainer.models.config import FULL, LINEAR

ROOT = Path(__file__).resolve().parents[2]


def test_bench_model_has_qwen3_next_80b_layer_shapes_and_2_52b_parameters():
    cfg = model_config("qwen3-next-8l-64e")
    assert cfg.layer_types == [LINEAR, LINEAR, LINEAR, FULL] * 2
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.vocab_size) == (2048, 64, 8, 151936)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (16, 32, 16, 2, 256)
    assert sum(p.numel() for p in meta_model(cfg).parameters()) == 2_516_045_952
    with pytest.raises(ValueError, match="qwen3-next-8l-64e.*tiny|tiny.*qwen3-next-8l-64e"):
        model_config("no-such-model")


def test_named_settings_validate_and_budgets_fit_the_issue():
    assert full().total_budget <= 7 * 60 and quick().total_budget <= 3 * 60
    assert full().microbatch_tokens == 8192 and full().chunk_size == 64 and full().model == "qwen3-next-8l-64e"
    assert {w.name for w in full().workloads} == {"tree", "percall"}
    assert dry_run().device == "cpu"
    with pytest.raises(ValueError, match="fidelity_workloads"):
        dataclasses.replace(full(), fidelity_workloads=("nope",))


def _runner(tmp_path, nominal, min_section_s=0.5):
    return Runner(tmp_path, total_s=sum(nominal.values()), nominal=nominal, order=tuple(nominal),
                  min_section_s=min_section_s)


def test_a_section_over_its_budget_keeps_its_partial_results_and_the_next_one_runs(tmp_path):
    runner = _runner(tmp_path, {"slow": 1.0, "next": 1.0})

    def slow(sec):
        sec.data["done"] = ["first unit"]
        sec.save()
        time.sleep(5)
        sec.data["done"].append("never")

    runner.run("slow", slow)
    runner.run("next", lambda sec: sec.data.update(ran=True))
    slow_doc = json.loads((tmp_path / "slow.json").read_text())
    assert slow_doc["status"] == "timeout" and slow_doc["data"] == {"done": ["first unit"]}
    assert slow_doc["seconds"] < 4
    assert json.loads((tmp_path / "next.json").read_text())["data"] == {"ran": True}


def test_budgets_are_shares_of_the_time_left_and_a_failed_section_does_not_stop_the_run(tmp_path):
    runner = _runner(tmp_path, {"a": 10.0, "b": 30.0, "c": 60.0})
    assert runner.budget_for("a") == pytest.approx(10.0, abs=0.1)
    assert runner.budget_for("b") == pytest.approx(100.0 * 30 / 90, abs=0.1)
    runner.run("a", lambda sec: 1 / 0)
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["status"] == "error" and "ZeroDivisionError" in doc["error"]
    runner.end = time.monotonic() + 1.0  # almost nothing left: shares below min_section_s are skipped
    assert runner.run("b", lambda sec: None)["status"] == "skipped"


def test_the_deadline_waits_for_a_held_block():
    with pytest.raises(SectionTimeout):
        with Deadline(0.05) as dl:
            with dl.hold():
                time.sleep(0.2)  # the alarm fires here and waits
                finished = True
            pytest.fail("the pending alarm must raise right after the held block")
    assert finished


def test_sigterm_writes_the_running_section_and_stops(tmp_path):
    runner = _runner(tmp_path, {"killed": 10.0})
    before = signal.getsignal(signal.SIGTERM)

    def section(sec):
        sec.data["unit"] = 1
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)

    with pytest.raises(Terminated):
        runner.run("killed", section)
    doc = json.loads((tmp_path / "killed.json").read_text())
    assert doc["status"] == "terminated" and doc["data"] == {"unit": 1}
    assert signal.getsignal(signal.SIGTERM) == before


def test_profile_counts_and_device_gaps_from_trace_events():
    us = 1000  # ns
    events = [
        ("aten::mm", False, 0, 5 * us), ("aten::mm", False, 6 * us, 5 * us), ("aten::add", False, 12 * us, us),
        ("aten::_local_scalar_dense", False, 13 * us, us), ("cudaLaunchKernel", False, 0, us),
        ("cudaLaunchKernel", False, 6 * us, us), ("cudaStreamSynchronize", False, 14 * us, us),
        ("gemm", True, 10 * us, 20 * us), ("gemm", True, 25 * us, 10 * us),     # overlap: busy 10-35
        ("add", True, 50 * us, 5 * us),                                          # gap of 15 us
        ("Memcpy DtoH (Device -> Pageable)", True, 2055 * us, us),               # gap of 2000 us
    ]
    out = summarize(events, microbatches=2)
    c = out["counts"]
    assert (c["kernels"], c["memcpys"], c["kernel_launches"], c["aten_ops"], c["mm_ops"], c["host_syncs"],
            c["device_to_host_copies"]) == (3, 1, 2, 4, 2, 2, 1)
    assert out["per_microbatch"]["aten_ops"] == 2.0
    assert out["top_kernels"][0]["name"] == "gemm" and out["top_kernels"][0]["calls"] == 2
    g = out["gaps"]
    assert g["gaps"] == 2 and g["idle_ms"] == pytest.approx(2.015) and g["span_ms"] == pytest.approx(2.046)
    assert [b["count"] for b in g["buckets"]] == [0, 1, 0, 1]
    assert g["largest"][0]["after"] == "add" and g["largest"][0]["before"].startswith("Memcpy")


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step_and_every_bench_section_on_the_cpu(tmp_path):
    """scripts/gpu_check.sh --dry-run (about 90 s here): its steps (the GPU test groups skip without
    CUDA) and bench_gpu --dry-run, the tiny model on the CPU: every section ends "ok" with its
    figures, tree == expanded bitwise as the CPU guarantees, the peer agrees with our log-probs."""
    out, packed = tmp_path / "out", tmp_path / "packed"
    env = {**os.environ, "OUT": str(packed), "GPU_CHECK_RESULTS": str(out), "PYTHON": sys.executable,
           "HARTS_SITE": str(tmp_path / "site"), "HARTS_SITE_FLA": str(tmp_path / "site-fla")}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    # what the device tool sends back: at most 8 files, everything in results.tgz
    assert {p.name for p in packed.iterdir()} <= {"results.tgz", "summary.txt", "report.md", "gpu-figures.jsonl"}
    with tarfile.open(packed / "results.tgz") as tar:
        assert "./bench/report.md" in tar.getnames()
    log = (out / "bench.log").read_text()[-3000:] if (out / "bench.log").is_file() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log
    steps = {line.split()[0] for line in (out / "summary.txt").read_text().splitlines() if " rc=" in line}
    assert steps == {"env", "tests-gdn-bf16-misc", "tests-gdn-fp32", "tests-tree-bf16-misc", "tests-tree-fp32",
                     "tests-gdn-640", "tests-invariant-tuning", "tests-trainer", "bench-warm", "bench"}
    bench = out / "bench"
    docs = {name: json.loads((bench / f"{name}.json").read_text()) for name in SECTIONS}
    assert {n: d["status"] for n, d in docs.items()} == dict.fromkeys(SECTIONS, "ok")
    assert docs["env"]["data"]["matmul"]["tflops"] > 0
    for row in docs["throughput"]["data"]["rows"]:
        assert row["windows"]["tokens_per_s"] > 0 and row["expanded"]["tokens_per_s"] > 0 and row["flop_ideal"] > 1
        assert row["windows"]["microbatches"] >= 2  # B = 256 cuts the trees: windows run
        assert row["windows_compiled"]["tokens_per_s"] > 0 and row["compiled_speedup"] > 0
    cells = docs["fidelity"]["data"]["runs"]
    assert {c["dtype"] for c in cells} == {"bfloat16", "float32"}
    assert all(v["bitwise_equal"] and v["expert_load_equal"] for c in cells for v in c["vs_expanded"].values())
    prof = docs["profile"]["data"]
    assert prof["counts"]["aten_ops"] > 1000 and prof["counts"]["mm_ops"] > 0 and "top_kernels" not in prof
    peer = docs["peer"]["data"]
    assert peer["bound"] == "torch" and peer["variants"]["torch_gdn"]["tokens_per_s"] > 0
    assert peer["agreement"]["max_abs"] < 1e-4 and set(peer["ratios"]) == {"windows_vs_torch_gdn", "expanded_vs_torch_gdn"}
    assert docs["kernels"]["data"]["returncode"] == 0 and "report" in docs["kernels"]["data"]
    report = (bench / "report.md").read_text()
    assert "## Update throughput" in report and "## transformers peer" in report and "windows, compiled" in report
    (bench / "report.md").unlink()
    rendered = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", "--render", str(bench)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0 and (bench / "report.md").read_text() == report


def test_logprob_diff_reports_max_mean_and_bits():
    nan = float("nan")
    ref = SimpleNamespace(logprobs={"a": np.array([nan, -1.0, -2.0]), "b": np.array([-0.5])}, expert_load=np.ones(3))
    same = SimpleNamespace(logprobs={"b": np.array([-0.5]), "a": np.array([nan, -1.0, -2.0])}, expert_load=np.ones(3))
    off = SimpleNamespace(logprobs={"a": np.array([nan, -1.0, -2.5]), "b": np.array([-0.5])}, expert_load=np.zeros(3))
    assert logprob_diff(ref, same) == {"positions": 3, "same_entries": True, "max_abs": 0.0, "mean_abs": 0.0,
                                       "bitwise_equal": True, "expert_load_equal": True}
    d = logprob_diff(ref, off)
    assert (d["max_abs"], d["mean_abs"], d["bitwise_equal"], d["expert_load_equal"]) == (0.5, pytest.approx(0.5 / 3), False, False)


@pytest.mark.slow
def test_peer_section_lifts_fla_hopper_refusal_and_checks_the_gradients(tmp_path, monkeypatch):
    """The peer section's branch for fla on Hopper with Triton 3.4-3.7.0 (what the H200 image has),
    on the CPU: transformers "binds fla", whose backward refuses (the RuntimeError fla raises,
    naming issue #640) unless its guard is lifted; the section records the refusal, runs the
    guard-lifted variant and its gradient check, then the PyTorch gated delta rule."""
    sys.modules.setdefault("fla", None)  # transformers must not bind fla's GPU kernels on CPU
    active = set()

    def marker(name):
        @contextlib.contextmanager
        def ctx():
            active.add(name)
            try:
                yield
            finally:
                active.discard(name)
        return ctx

    refusal = ("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated chunk_bwd_dqkwg "
               "(see #640). Please upgrade Triton to >= 3.7.1 or install tilelang")
    backward = peer_mod.TransformersPeer.backward

    def refusing_backward(self, *args, **kwargs):
        if not active:
            raise RuntimeError(refusal)
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(peer_mod, "gated_delta_rule_bound", lambda: "fla")
    monkeypatch.setattr(peer_mod, "fla_hopper_guard_lifted", marker("lifted"))
    monkeypatch.setattr(peer_mod, "torch_gated_delta_rule", marker("torch"))
    monkeypatch.setattr(peer_mod.TransformersPeer, "backward", refusing_backward)
    runner = _runner(tmp_path, {"peer": 120.0})
    doc = runner.run("peer", lambda sec: peer_section(BenchContext(dry_run()), sec))
    d = doc["data"]
    assert doc["status"] == "ok", doc["error"]
    assert "#640" in d["variants"]["fla"]["error"]
    assert d["variants"]["fla_guard_lifted"]["tokens_per_s"] > 0 and d["variants"]["torch_gdn"]["tokens_per_s"] > 0
    assert d["grad_check"]["parameters"] > 0 and d["grad_check"]["grad_rel_err_max"] == 0.0  # both ran PyTorch here
    assert d["agreement"]["max_abs"] < 1e-4
    assert d["ratios"] == {} and any("no ratios" in n for n in doc["notes"])
