"""benchmarks/bench_rl.py: a short harts rl run trained on trees and, on the same rollouts, expanded."""
from __future__ import annotations

import pytest


@pytest.mark.slow
def test_tree_and_expanded_training_of_one_run_agree_for_5_steps():
    # optional: the trainer extra
    import torch

    from benchmarks.bench_rl import result_markdown, run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run(quick=True)
    finally:
        torch.set_num_threads(threads)
    rows = result["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert any(r["tree_grad_norm"] > 0 for r in rows)  # rewards differ within groups: there is something to learn
    assert all(r["compression"] > 1.0 for r in rows)
    # Invariant E along the run: on the same weights, tree and expanded agree within 1e-6 every step
    assert result["anchored_loss_max_rel_diff"] <= 1e-6 and result["anchored_grad_norm_max_rel_diff"] <= 1e-6, result
    assert result["loss_max_rel_diff"] <= 1e-5 and result["grad_norm_max_rel_diff"] <= 1e-5, result  # drift after 5 steps
    w = result["wire"]
    assert w["tree_compact_json_bytes_per_token"] < w["tree_per_trajectory_json_bytes_per_token"] < w["flat_json_bytes_per_token"]
    assert w["tree_compact_proto_bytes_per_token"] < w["tree_per_trajectory_proto_bytes_per_token"] < w["flat_proto_bytes_per_token"]
    assert open(result["figure"], "rb").read(4) == b"\x89PNG"
    text = result_markdown(result)
    assert "| 5 |" in text and "compact" in text
