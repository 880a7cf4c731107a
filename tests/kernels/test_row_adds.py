"""`kernels.row_adds.RowAdds`: index_add_'s result and order without index_add_, under
`torch.use_deterministic_algorithms(True)`."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.row_adds import RowAdds


@pytest.mark.parametrize("target", [[0, 1, 2], [3, 0, 3, 3, 1, 0], [2], []], ids=["distinct", "repeats", "one", "empty"])
def test_row_adds_equal_sequential_index_add_bitwise(target):
    gen = torch.Generator().manual_seed(len(target))
    dst = torch.randn(4, 3, 5, generator=gen)
    src = torch.randn(len(target), 3, 5, generator=gen) * 1e3
    want = dst.clone().index_add_(0, torch.tensor(target, dtype=torch.long), src)
    plan = RowAdds.build(np.array(target))
    assert len(plan.levels) == (max(np.unique(target, return_counts=True)[1]) if target else 0)
    for t, _ in plan.levels:
        assert t.unique().numel() == t.numel()
    torch.use_deterministic_algorithms(True)
    try:
        got = plan.apply_(dst.clone(), src)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(got, want)


def test_row_adds_along_dim_1():
    dst = torch.zeros(2, 3)
    plan = RowAdds.build(np.array([2, 2, 0]))
    got = plan.apply_(dst, torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]]), dim=1)
    assert got.tolist() == [[4.0, 0.0, 3.0], [32.0, 0.0, 24.0]]
