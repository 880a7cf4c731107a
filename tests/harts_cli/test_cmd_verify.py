"""`harts verify` and `harts logprobs` (harts_cli/cmd_verify.py, cmd_logprobs.py), run in-process."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harts_cli.main import main
from trainer.layout import layout_from_sequences
from trainer.models import RunOptions, build_model
from trainer.executor import kernel_backend



@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    rng = np.random.default_rng(0)
    p = rng.integers(0, 256, 21).tolist()
    q = p[:13] + rng.integers(0, 256, 4).tolist()
    trajs = [p + rng.integers(0, 256, n).tolist() for n in (30, 17, 5)] + [q, p[:9]]
    doc = {"batch_id": "cli", "vocab_size": 256, "trajectories": [
        {"id": f"t{i}", "tokens": t, "advantage": float(rng.normal()), "loss_mask": [0] * 9 + [1] * (len(t) - 9)}
        for i, t in enumerate(trajs)]}
    path = tmp_path_factory.mktemp("cli") / "batch.json"
    path.write_text(json.dumps(doc))
    return path, trajs


def _run(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_verify_meets_targets(batch, capsys):
    path, _ = batch
    rep = _run(capsys, ["verify", str(path), "--model", "tiny", "--chunk-size", "8", "--microbatch-tokens", "64", "--repack-baseline"])
    assert rep["targets_met"] is True
    assert rep["baseline_repacked"]["linear_outputs_bitwise_equal"] is True and rep["baseline_repacked"]["microbatches"] >= 1
    assert rep["linear_outputs_bitwise_equal"] is True and rep["linear_layers_compared"] == [0, 1, 2]
    assert rep["logprob_max_abs_diff"] <= 1e-5 and rep["grad_rel_diff_max"] <= 1e-5 and rep["expert_load_equal"]
    assert set(rep["grad_rel_diff"]) >= {"lm_head.weight", "model.layers.0.linear_attn.A_log"}
    assert rep["computed_tokens"] < rep["computed_tokens_ref"]


def test_verify_no_replay_shows_a_difference(batch, capsys):
    path, _ = batch
    rep = _run(capsys, ["verify", str(path), "--chunk-size", "8", "--no-replay"])
    assert rep["replay"] is False
    assert rep["linear_outputs_bitwise_equal"] is False and rep["linear_outputs_max_abs_diff"] > 0
    assert rep["targets_met"] is False


def test_logprobs_writes_every_position(batch, capsys, tmp_path):
    path, trajs = batch
    out = tmp_path / "lp.json"
    summary = _run(capsys, ["logprobs", str(path), "--model", "tiny", "--seed", "3", "--chunk-size", "8", "-o", str(out)])
    got = json.loads(out.read_text())
    assert summary["trajectories"] == len(trajs) and sorted(got) == [f"t{i}" for i in range(len(trajs))]
    model = build_model("tiny", seed=3)
    layout = layout_from_sequences(trajs, conv_kernel=4, chunk_size=8)
    with torch.no_grad():
        logits = model.logits(model(layout, RunOptions(linear_fn=kernel_backend("ref"), chunk_size=8)).hidden).float()
    want = torch.log_softmax(logits, -1)[layout.logprobs.row, layout.logprobs.label].numpy()
    flat = np.concatenate([got[f"t{i}"] for i in range(len(trajs))])
    assert flat.shape == want.shape
    np.testing.assert_allclose(flat, want, rtol=0, atol=1e-5)


def test_bad_model_argument_is_a_clear_error(batch, capsys):
    path, _ = batch
    assert main(["logprobs", str(path), "--model", "/nonexistent", "-o", "/dev/null"]) == 2
    assert "--model: expected one of" in capsys.readouterr().err


def test_verify_windows_and_recomputation(batch, capsys):
    """B below the longest trajectory (51 tokens): sharing windows; a small M forces recomputation."""
    path, _ = batch
    rep = _run(capsys, ["verify", str(path), "--chunk-size", "8", "--microbatch-tokens", "24", "--memory-tokens", "60"])
    assert rep["windows"] > 0 and rep["recomputed_microbatches"] > 0, rep
    assert rep["targets_met"] is True, rep


def test_no_windows_ablation_raises_the_budget(batch, capsys, tmp_path):
    path, trajs = batch
    out = tmp_path / "lp.json"
    summary = _run(capsys, ["logprobs", str(path), "--chunk-size", "8", "--microbatch-tokens", "24", "--no-windows", "-o", str(out)])
    assert summary["windows"] == 0
    windowed = _run(capsys, ["logprobs", str(path), "--chunk-size", "8", "--microbatch-tokens", "24", "-o", str(tmp_path / "w.json")])
    assert windowed["windows"] > 0
    a, b = json.loads(out.read_text()), json.loads((tmp_path / "w.json").read_text())
    for tid in a:
        np.testing.assert_allclose(a[tid], b[tid], rtol=0, atol=1e-6)
