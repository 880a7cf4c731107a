"""The bytes of parameters and gradients a rank holds during a step, measured at FSDP2's unit boundaries.

    gauge = ParamGradGauge(model)          # hooks on every FSDP2 unit (or none for a plain module)
    gauge.begin_step()
    ...forwards and backwards...
    gauge.sample()                         # once more after the step's last backward
    gauge.peak                             # peak_param_grad_bytes of the step (this rank)

Measured, not computed from a formula; what a sample counts, where samples are taken and which
FSDP2 internals it reads: docs/design/execution.md ("Measuring parameter and gradient memory").
"""
from __future__ import annotations

import torch

__all__ = ["ParamGradGauge"]


class _SampleOnBackward(torch.autograd.Function):
    """Identity whose backward samples the gauge (before the enclosing FSDP2 unit's post-backward)."""

    @staticmethod
    def forward(ctx, gauge: "ParamGradGauge", x: torch.Tensor) -> torch.Tensor:
        ctx.gauge = gauge
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.gauge.sample()
        return None, grad


class ParamGradGauge:
    """Peak bytes of parameters + gradients of this rank (docs/design/execution.md, "Measuring parameter
    and gradient memory")."""

    def __init__(self, model: torch.nn.Module, *, enabled: bool = True):
        """`enabled`: False measures nothing (`peak` stays 0): no hooks, no samples."""
        from torch.distributed.fsdp import FSDPModule

        self.model = model
        self.peak = 0
        self.enabled = enabled
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)] if enabled else []
        self.groups = [g for m in self.units for g in m._get_fsdp_state()._fsdp_param_groups]
        self._handles = []
        self._hooked: set[int] = set()
        for m in self.units:
            self._handles.append(m.register_forward_hook(self._after_forward, prepend=True))
            if m is not model:
                self._handles.append(m.register_forward_pre_hook(self._wrap_input))

    def begin_step(self) -> None:
        """Start a step's peak from what is held now."""
        self.peak = 0
        self.sample()

    def sample(self) -> int:
        """Bytes held now (and the running peak updated)."""
        if not self.enabled:
            return 0
        seen: set[int] = set()
        total = 0

        def add(t) -> None:
            nonlocal total
            if t is None:
                return
            t = getattr(t, "_local_tensor", t)  # a DTensor's shard
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += s.nbytes()

        if self.groups:
            for g in self.groups:
                result = getattr(g, "_all_gather_result", None)
                add(getattr(result, "all_gather_output", None))
                for fp in g.fsdp_params:
                    add(fp._sharded_param_data)
                    for t in fp.all_gather_outputs:
                        add(t)
                    unsharded = getattr(fp, "_unsharded_param", None)
                    add(None if unsharded is None else unsharded.grad)
                    add(fp.unsharded_accumulated_grad)
                    add(fp.sharded_param.grad)
            for st in getattr(self.groups[0].comm_ctx, "reduce_scatter_states", []):
                add(st.reduce_scatter_input)
        else:
            for p in self.model.parameters():
                add(p)
                add(p.grad)
        self.peak = max(self.peak, total)
        return total

    def _after_forward(self, module, args, output):
        self.sample()
        if module is self.model:
            self._hook_root_params()

    def _wrap_input(self, module, args):
        if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            return (_SampleOnBackward.apply(self, args[0]), *args[1:])
        return None

    def _hook_root_params(self) -> None:
        """Sample after each gradient accumulation into the root unit's unsharded parameters (they
        exist after the root's first all-gather and are reused from then on)."""
        for g in self.model._get_fsdp_state()._fsdp_param_groups:
            for fp in g.fsdp_params:
                p = getattr(fp, "_unsharded_param", None)
                if p is not None and p.requires_grad and id(p) not in self._hooked:
                    self._hooked.add(id(p))
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, param: torch.Tensor) -> None:
        self.sample()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
