"""`harts calibrate`: the NNLS fit recovers known coefficients, synthetic batches span the
features, and a short real calibration writes a cost model that `harts plan` balances with."""
from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import pytest

from harts_cli import cmd_calibrate
from harts_cli.cmd_calibrate import SHAPES, fit_report, plan_features, synthetic_batch
from harts_cli.main import main
from planner_service import ingest
from planner_service.planner import PlanConfig, plan_step
from planner_service.planner.cost_model import DEFAULT_TRANSFER_ROWS_PER_BYTE, FEATURES, CostModel, nnls
from proto.harts.v1 import plan_pb2


def test_nnls_matches_the_best_nonnegative_subset_fit():
    rng = np.random.default_rng(0)
    for _ in range(20):
        A = rng.random((30, 4))
        b = A @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.01 * rng.standard_normal(30)
        x = nnls(A, b)
        assert (x >= 0).all()
        best = np.inf
        for k in range(5):  # brute force: least squares on every support, kept if non-negative
            for cols in itertools.combinations(range(4), k):
                z = np.zeros(4)
                if cols:
                    z[list(cols)] = np.linalg.lstsq(A[:, list(cols)], b, rcond=None)[0]
                if (z >= 0).all():
                    best = min(best, float(np.linalg.norm(A @ z - b)))
        assert np.linalg.norm(A @ x - b) <= best + 1e-9


def test_fit_recovers_coefficients_and_the_step_overhead():
    rng = np.random.default_rng(1)
    X = np.column_stack([rng.integers(100, 4000, 40), rng.integers(1e3, 1e6, 40), rng.integers(1, 9, 40), rng.integers(10, 900, 40)])
    truth = np.array([2e-4, 3e-7, 5e-3, 1e-5])
    t = X @ truth + 0.02
    coef, overhead, report = fit_report(X.astype(float), t, np.arange(30), np.arange(30, 40))
    np.testing.assert_allclose(coef, truth, rtol=1e-6)
    assert overhead == pytest.approx(0.02) and report["r2"] == pytest.approx(1.0) and report["max_rel_error"] < 1e-6


def test_synthetic_batches_span_the_features():
    rng = np.random.default_rng(0)
    feats = []
    for i, shape in enumerate(SHAPES * 2):
        doc = synthetic_batch(rng, shape, 600, 64, 0.5, f"s{i}", chunk=16)
        f = ingest.forest_from_json(json.dumps(doc))
        plan = plan_step(f, PlanConfig(microbatch_tokens=4096, chunk_size=16, windows=False))
        feats.append(plan_features(plan))
    F = np.array(feats)
    assert (F[:, 1] / F[:, 0]).max() > 5 * (F[:, 1] / F[:, 0]).min(), "attention per row must vary"
    assert F[:, 2].max() >= 4 and F[:, 2].min() == 1, "calls must vary"


def _calibrate(capsys, out, *extra: str) -> tuple[dict, CostModel]:
    """A short `harts calibrate` of the tiny model: its printed report and the cost model it wrote."""
    assert main(["calibrate", "--model", "tiny", "--chunk-size", "16", "--repeats", "1", *extra, "-o", str(out)]) == 0
    return json.loads(capsys.readouterr().out), CostModel.load(out)


#: seconds per feature (rows, attention pairs, calls, log-prob rows) and per step of the stand-in clock
CLOCK = np.array([2e-5, 1e-8, 1e-3, 1e-5]), 0.01


def test_calibrate_writes_a_cost_model_that_plan_accepts(tmp_path, capsys, monkeypatch):
    """The whole command: synthetic batches planned and run as training steps, the fit, the file,
    `harts plan` with it. The step times it fits come from a clock linear in each batch's features
    (six tiny batches timed on a loaded 2-core machine can show no per-token cost at all, which
    the command rightly refuses to write)."""
    timed = cmd_calibrate._time_batches

    def linear_clock(args, model, ex, rng):
        X, t = timed(args, model, ex, rng)
        assert (t > 0).all()  # the batches did run
        return X, X @ CLOCK[0] + CLOCK[1]

    monkeypatch.setattr(cmd_calibrate, "_time_batches", linear_clock)
    out = tmp_path / "cost.json"
    report, cm = _calibrate(capsys, out, "--samples", "6", "--max-rows", "256", "--transfer-backend", "none")
    # four fitted batches for five unknowns (with the step overhead): a fit, not the clock's coefficients
    assert cm.fit["r2_train"] == pytest.approx(1.0)
    assert cm.transfer_byte == pytest.approx(cm.row * DEFAULT_TRANSFER_ROWS_PER_BYTE) and "transfer" not in report  # not measured
    assert all(getattr(cm, n) >= 0 for n in FEATURES) and sum(getattr(cm, n) for n in FEATURES) > 0
    assert cm.fit["samples"] == 6 and cm.fit["held_out"] == 2 and "r2" in report and "max_rel_error" in report
    assert cm.source.startswith("harts calibrate --model tiny")
    batch = tmp_path / "b.json"
    rng = np.random.default_rng(0)
    batch.write_text(json.dumps(synthetic_batch(rng, "branches", 400, 256, 0.5, "b")))
    assert main(["plan", str(batch), "--world-size", "2", "--microbatch-tokens", "128", "--chunk-size", "16",
                 "--cost-model", str(out)]) == 0
    plan_report = json.loads(capsys.readouterr().out)
    assert plan_report["makespan"] < 60, "costs are seconds of the calibrated trainer"


@pytest.mark.integration
def test_calibrate_measures_the_point_to_point_bandwidth_into_transfer_byte(tmp_path, capsys):
    """Two gloo processes bounce buffers through the trainer's P2PTransport: transfer_byte is seconds per byte."""
    report, cm = _calibrate(capsys, tmp_path / "cost.json", "--samples", "4", "--max-rows", "128", "--transfer-max-mb", "1")
    t = report["transfer"]
    assert t["backend"] == "gloo" and t["sizes"][0] == 1024 and t["sizes"][-1] == 1 << 20
    assert cm.transfer_byte == report["transfer_byte"] == t["transfer_byte"] > 0
    assert t["bandwidth_gb_s"] == pytest.approx(1e-9 / cm.transfer_byte) and t["latency_seconds"] < 1.0

    msg = plan_pb2.CostModel()
    cm.fill(msg, transfer=True)
    assert msg.transfer_byte == cm.transfer_byte  # what a plan made with this file carries


def test_calibrate_refuses_a_too_small_transfer_measurement():
    with pytest.raises(ValueError, match=r"--transfer-max-mb: expected >= 0.0625 \(64 KiB\), got 0.01"):
        _run_calibrate(["--transfer-max-mb", "0.01"])


def _run_calibrate(extra: list[str]) -> int:

    p = argparse.ArgumentParser()
    cmd_calibrate.add_arguments(p)
    return cmd_calibrate.run(p.parse_args(extra))
