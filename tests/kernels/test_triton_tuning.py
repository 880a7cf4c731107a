"""`kernels.triton_tuning`: candidates that differ in num_stages only, the JSON tuning cache (for
Tritons without `cache_results`) round trip on a stand-in autotuner, and config pinning."""
from __future__ import annotations

import json

import pytest
import triton

from kernels import triton_tuning
from kernels.triton_tuning import JsonTuningCache, autotune, pinned, stages


def test_autotune_refuses_candidates_whose_numerics_differ():
    with pytest.raises(ValueError, match="num_stages only"):
        autotune([triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)], key=["K"])
    with pytest.raises(ValueError, match="num_stages only"):
        autotune([triton.Config({"BV": 32}, num_warps=4), triton.Config({"BV": 64}, num_warps=4)], key=["K"])
    configs = stages(8, (2, 3), BV=32)
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in configs] == [({"BV": 32}, 8, 2), ({"BV": 32}, 8, 3)]
    autotune(configs, key=["K"])  # accepted


def test_every_kernel_tunes_over_num_stages_only():
    """The kernels' candidates (checked at import by `autotune`) really are in place, first one first."""
    from kernels.gated_delta_rule import output_triton, state_triton, wy_triton
    from kernels.tree_attention import triton_kernel

    for kernel in (output_triton._dqkwg_kernel, wy_triton._wy_bwd_kernel, triton_kernel._tree_attn_dkdv_kernel):
        cands = triton_tuning.candidates(kernel)
        assert len(cands) == 2 and len({(c.num_warps, tuple(c.kwargs.items())) for c in cands}) == 1
    fwd = triton_tuning.candidates(state_triton._state_fwd_kernel)
    assert [(c.kwargs["BV"], c.num_warps) for c in fwd] == [(32, 4), (32, 4)]


class _FakeJit:
    cache_key = "source-digest"
    __name__ = "_fake_kernel"


class _FakeTuner:
    """The attributes JsonTuningCache and `pinned` use: fn, configs, cache, run (which 'tunes' key
    (K, 'bf16')), harts_candidates."""

    def __init__(self, configs):
        self.fn, self.configs, self.cache, self.tuned = _FakeJit(), configs, {}, 0
        self.harts_candidates = configs

    def run(self, *args, **kwargs):
        key = (kwargs["K"], "bf16")
        if key not in self.cache:
            self.tuned += 1
            self.cache[key] = self.configs[-1]
        return self.cache[key]


def test_json_tuning_cache_reuses_a_choice_across_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    configs = stages(4, (2, 3))
    first = _FakeTuner(configs)
    JsonTuningCache(first, device_name="NVIDIA H200").install()
    assert first.run(K=64).num_stages == 3 and first.tuned == 1
    (path,) = (tmp_path / "harts-autotune").glob("_fake_kernel-*.json")
    assert json.loads(path.read_text()) == [[[64, "bf16"], {"kwargs": {}, "num_warps": 4, "num_stages": 3}]]

    second = _FakeTuner(configs)  # a later process: empty in-memory cache
    JsonTuningCache(second, device_name="NVIDIA H200").install()
    assert second.run(K=64).num_stages == 3 and second.tuned == 0
    assert second.run(K=128) is configs[-1] and second.tuned == 1
    assert len(json.loads(path.read_text())) == 2

    other_gpu = _FakeTuner(configs)
    JsonTuningCache(other_gpu, device_name="NVIDIA A100").install()
    other_gpu.run(K=64)
    assert other_gpu.tuned == 1 and len(list((tmp_path / "harts-autotune").glob("*.json"))) == 2


def test_pinned_runs_one_config_and_restores_the_tuning_state():
    tuner = _FakeTuner(stages(4, (2, 3)))
    tuner.cache[(1, "bf16")] = tuner.configs[0]
    before = tuner.configs
    with pinned({tuner: before[1]}):
        assert tuner.configs == [before[1]] and tuner.cache == {}
    assert tuner.configs is before and tuner.cache == {(1, "bf16"): before[0]}
