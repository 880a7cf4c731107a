"""Planner settings (DESIGN §4)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class PlanConfig:
    """What a step is planned for. Validation errors name the field and the remedy."""

    world_size: int = 1
    """Number of data-parallel trainer ranks (>= 1)."""
    microbatch_tokens: int = 4096
    """Token budget B per microbatch: computed rows (kept + replay + duplicated) must fit."""
    memory_tokens: int = 0
    """Live-activation budget M per rank, in tokens; 0 means 8 * microbatch_tokens."""
    chunk_size: int = 64
    """Linear-attention chunk size C; a power of two, equal to the kernel's."""
    conv_kernel: int = 4
    """Short-convolution kernel size K of the linear-attention layers."""
    sharing: bool = True
    """False: the trajectory-expanded baseline (each trajectory its own tree)."""
    windows: bool = True
    """False: every cross-microbatch edge duplicates the prefix in the child."""
    replay: bool = True
    """False: ablation, hand over states at unaligned branch depths instead of replaying."""
    all_positions: bool = False
    """True: a log-prob entry for every position 1..L-1 (not only loss positions)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {self.world_size}")
        c = self.chunk_size
        if c < 1 or c & (c - 1):
            raise ValueError(f"chunk_size: expected a power of two (e.g. 64), got {c}")
        if self.microbatch_tokens < c:
            raise ValueError(
                f"microbatch_tokens: expected >= chunk_size ({c}), got {self.microbatch_tokens}; raise the budget"
            )
        if self.memory_tokens == 0:
            self.memory_tokens = 8 * self.microbatch_tokens
        if self.memory_tokens < self.microbatch_tokens:
            raise ValueError(
                f"memory_tokens: expected >= microbatch_tokens ({self.microbatch_tokens}), got {self.memory_tokens}"
            )
        if self.conv_kernel < 1:
            raise ValueError(f"conv_kernel: expected >= 1, got {self.conv_kernel}")
