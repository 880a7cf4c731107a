"""Device identity for layouts and tensors: compare the device a spelling resolves to, not the spelling.

    same_device("cuda", "cuda:0")      # True when cuda:0 is the current device
    idx = to_device(idx_cpu, "cuda")   # from pinned memory, without a stream synchronisation

`torch.device("cuda") != torch.device("cuda:0")` although a tensor created on the first is on the
second, so layouts prepared once store and compare `resolve_device`'s answer
(docs/design/execution.md, "Small pieces").
"""
from __future__ import annotations

import torch

__all__ = ["resolve_device", "same_device", "to_device"]

_INDEXLESS = ("cpu", "meta")


def _current_index(device_type: str) -> int:
    """The current device index of an accelerator type (`torch.cuda.current_device()` for "cuda")."""
    return torch.get_device_module(device_type).current_device()


def resolve_device(device: torch.device | str | None) -> torch.device:
    """`device` with its index made explicit: "cuda" -> "cuda:<current>", "cpu:0" -> "cpu"; None -> cpu."""
    device = torch.device("cpu" if device is None else device)
    if device.type in _INDEXLESS:
        return torch.device(device.type)
    if device.index is None:
        return torch.device(device.type, _current_index(device.type))
    return device


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether a and b name one device once resolved (`resolve_device`)."""
    a, b = torch.device(a), torch.device(b)
    if a == b:
        return True
    return a.type == b.type and resolve_device(a) == resolve_device(b)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: a copy from pageable memory makes
    CUDA synchronise the stream first (the host would stop at every index tensor of every layout),
    one from pinned memory is queued behind the running kernels."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
