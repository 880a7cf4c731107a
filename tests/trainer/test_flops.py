"""trainer.flops: the per-row constants against the model's own weights, and a plan's FLOPs on small
hand-checkable plans (one trajectory; a shared prefix with an unaligned branch)."""
from __future__ import annotations

import pytest

from tests.executor_helpers import make_plan
from trainer.flops import dense_flops_per_row, linear_kernel_flops_per_row, plan_flops
from trainer.models import build_model
from trainer.models.config import FULL


@pytest.mark.parametrize("name", ["tiny", "tiny-dense", "small"])
def test_dense_flops_match_the_weights_a_row_uses(name):
    """2 x (the matmul weights one row multiplies with) + the depthwise conv, counted from the model:
    every projection, the routed experts at top-k / E of their size, the router and shared expert."""
    model = build_model(name, seed=0)
    cfg = model.config
    used = 0.0
    for pname, p in model.named_parameters():
        if not pname.startswith("model.layers.") or p.dim() < 2:
            continue
        # routed experts: top-k of E per row; the depthwise conv: one multiply-add per weight too
        used += p.numel() * (cfg.num_experts_per_tok / cfg.num_experts if ".mlp.experts." in pname else 1)
    assert dense_flops_per_row(cfg) == pytest.approx(2 * used)


def test_one_trajectory():
    model = build_model("tiny", seed=0)
    cfg = model.config
    L, C = 37, 8
    f = plan_flops(make_plan([list(range(1, L + 1))], chunk_size=C), cfg, chunk_size=C)
    n_full = cfg.layer_types.count(FULL)
    n_linear = len(cfg.layer_types) - n_full
    assert f.dense == pytest.approx(L * dense_flops_per_row(cfg))
    assert f.attention == pytest.approx(n_full * 4 * cfg.num_attention_heads * cfg.head_dim * L * (L + 1) / 2)
    assert f.linear_kernel == pytest.approx(n_linear * L * linear_kernel_flops_per_row(cfg, C))
    assert f.lm_head == pytest.approx(2 * cfg.hidden_size * cfg.vocab_size * (L - 1))
    assert f.total == pytest.approx(f.dense + f.attention + f.linear_kernel + f.lm_head)


def test_shared_prefix_counts_replay_and_depth():
    """Two trajectories share 11 tokens and branch inside chunk 1 (C = 8): the tree computes the
    prefix once, replays the 3 shared rows of chunk 1 in its branches' kernel sequences (the test
    plan maker starts every child segment at the chunk boundary, so both branches replay), and its
    attention work is the expanded one minus the prefix's second copy."""
    cfg = build_model("tiny", seed=0).config
    C, P, B = 8, 11, 6
    prefix = list(range(1, P + 1))
    trajs = [prefix + [100 + i for i in range(B)], prefix + [200 + i for i in range(B)]]
    tree = plan_flops(make_plan(trajs, chunk_size=C), cfg, chunk_size=C)
    flat = plan_flops(make_plan(trajs, chunk_size=C, sharing=False), cfg, chunk_size=C)
    n_full = cfg.layer_types.count(FULL)
    n_linear = len(cfg.layer_types) - n_full
    per_key = n_full * 4 * cfg.num_attention_heads * cfg.head_dim
    assert flat.dense / tree.dense == pytest.approx(2 * (P + B) / (P + 2 * B))
    assert flat.attention - tree.attention == pytest.approx(per_key * P * (P + 1) / 2)
    replay = 2 * (P - (P // C) * C)
    assert tree.linear_kernel == pytest.approx(n_linear * (P + 2 * B + replay) * linear_kernel_flops_per_row(cfg, C))
    assert flat.total / tree.total < 2 * (P + B) / (P + 2 * B)  # below the token compression

