"""`kernels.devices`: layouts match tensors by the device a spelling resolves to (the first GPU run: a layout
prepared on "cuda" was refused for q on "cuda:0"). Accelerator devices are faked through the
current-index lookup, so these run on the CPU."""
from __future__ import annotations

import pytest
import torch

from kernels import devices
from kernels.devices import resolve_device, same_device
from kernels.gated_delta_rule import prepare_layout
from kernels.tree_attention import prepare_tree_layout


@pytest.fixture
def current_cuda(monkeypatch):
    """Set the fake current CUDA index: `current_cuda(1)`."""

    def set_index(i: int) -> None:
        monkeypatch.setattr(devices, "_current_index", lambda device_type: {"cuda": i}[device_type])

    return set_index


def test_resolve_device_makes_the_index_explicit(current_cuda):
    current_cuda(1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert resolve_device("cpu:0") == resolve_device("cpu") == resolve_device(None) == torch.device("cpu")
    assert resolve_device("meta") == torch.device("meta")


@pytest.mark.parametrize(
    "a, b, current, same",
    [
        ("cuda", "cuda:0", 0, True),
        ("cuda:0", "cuda", 0, True),
        ("cuda", "cuda:0", 1, False),
        ("cuda", "cuda:1", 1, True),
        ("cuda:0", "cuda:1", 0, False),
        ("cuda", "cpu", 0, False),
        ("cpu", "cpu:0", 0, True),
    ],
)
def test_same_device_compares_resolved_devices(current_cuda, a, b, current, same):
    current_cuda(current)
    assert same_device(a, b) is same
    assert same_device(torch.device(a), torch.device(b)) is same


def test_layouts_store_resolved_devices_and_do_not_copy_for_another_spelling():
    """Both layouts resolve their device once; `.to` a spelling of the same device is a no-op (the
    GDN layout used to copy its index tensors on every call prepared on "cuda")."""
    cu = torch.tensor([0, 5, 12])
    gdn = prepare_layout(cu, torch.tensor([1]), torch.tensor([7]), 4, device="cpu:0")
    assert gdn.device == torch.device("cpu")
    assert gdn.to("cpu") is gdn and gdn.to(torch.device("cpu", 0)) is gdn
    tree = prepare_tree_layout(torch.tensor([0, 3]), torch.tensor([3, 2]), torch.tensor([0, 0, 1]),
                               torch.tensor([[0, 3]]), num_rows=5, device="cpu:0")
    assert tree.device == torch.device("cpu")
    assert tree.to("cpu:0") is tree


def test_a_layout_moves_every_index_tensor_to_another_device(monkeypatch):
    """`ChunkLayout.to` moves its tensors, its RowAdds' levels included, handing `to_device` tensors
    only ("meta" stands for a second device; the first GPU run failed here, handing it a RowAdds)."""
    from dataclasses import fields

    from kernels import row_adds
    from kernels.gated_delta_rule import layout as gdn_layout
    from kernels.row_adds import RowAdds

    def tensors_only(t, device):
        assert isinstance(t, torch.Tensor), type(t)
        return devices.to_device(t, device)

    monkeypatch.setattr(gdn_layout, "to_device", tensors_only)
    monkeypatch.setattr(row_adds, "to_device", tensors_only, raising=False)

    cu = torch.tensor([0, 21, 37, 77])
    # exports after 16 rows of sequence 0, after 32 and all 40 rows of sequence 2
    layout = prepare_layout(cu, torch.tensor([0, 2, 2]), torch.tensor([16, 32, 40]), 16, device="cpu")
    moved = layout.to("meta")
    assert moved.device == torch.device("meta")
    tensors = 0
    for f in fields(moved):
        value = getattr(moved, f.name)
        for v in (value.values() if isinstance(value, dict) else (value,)):
            parts = [t for level in v.levels for t in level] if isinstance(v, RowAdds) else [v]
            for t in parts:
                if isinstance(t, torch.Tensor):
                    assert t.device.type == "meta", f.name
                    tensors += 1
    assert moved.export_adds_J and tensors > 10
