"""The suite-wide settings of tests/conftest.py take effect."""
from __future__ import annotations


def test_torch_runs_on_one_intra_op_thread():
    import torch

    assert torch.get_num_threads() == 1
