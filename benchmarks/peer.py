"""What a user would run instead: `transformers` Qwen3-Next on the same weights, and a common memory gauge.

    peer = TransformersPeer.from_model(model)            # CPU: our weights -> HF directory -> from_pretrained (fp32)
    peer = TransformersPeer.on_device(cfg, state, device="cuda", dtype=torch.bfloat16)   # GPU: built in memory
    seconds, cpu_seconds, saved = peer.train_step(trajectories, loss_masks)

One trajectory at a time, no KV cache, token-mean NLL, one fused AdamW step; fla bound or hidden
as the device needs; `SavedTensorBytes` counts the bytes autograd keeps for backward
(benchmarks/README.md, "The transformers peer"). Legend: L trajectory length, V vocabulary.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import tempfile
import weakref
from collections.abc import Iterator

import torch

from harts_client.timing import Stopwatch
from trainer.export import write_hf_dir
from trainer.optim import make_optimizer


class SavedTensorBytes:
    """Peak bytes of tensors saved for backward, while the context is active (storages once).

    Args:
        exclude: modules whose parameters are not counted (weights saved by a matmul's backward
            are the model, not activations).
    """

    def __init__(self, *exclude: torch.nn.Module):
        self.skip = {p.untyped_storage().data_ptr() for m in exclude for p in m.parameters()}
        self.live = 0
        self.peak = 0
        self.refs: dict[int, list[int]] = {}

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta":
            return t
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.skip or key == 0:
            return t
        ref = self.refs.get(key)
        if ref is None:
            ref = self.refs[key] = [0, st.nbytes()]
            self.live += ref[1]
            self.peak = max(self.peak, self.live)
        ref[0] += 1
        holder = _Held(t)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        ref = self.refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[key]

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, _Held) else x

    def __enter__(self) -> "SavedTensorBytes":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


class TransformersPeer:
    """transformers' Qwen3NextForCausalLM with the weights of one of our models."""

    def __init__(self, hf_model, lr: float = 1e-5):
        self.model = hf_model
        self.opt = make_optimizer(hf_model.parameters(), lr=lr)
        self.device = next(hf_model.parameters()).device

    @classmethod
    def from_model(cls, model, lr: float = 1e-5) -> "TransformersPeer":
        """Export `model` (a Qwen3NextForRL) as a HF directory and load it with transformers (fp32)."""
        sys.modules.setdefault("fla", None)  # transformers must not bind fla's GPU kernels on CPU
        # deferred: transformers binds fla (or not) when it loads, so only after the line above
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as tmp:
            path = write_hf_dir(f"{tmp}/hf", model.state_dict(), model.config, dtype=torch.float32)
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        hf.train()
        return cls(hf, lr=lr)

    @classmethod
    def on_device(cls, cfg, state: dict[str, torch.Tensor], *, device: torch.device | str, dtype: torch.dtype,
                  lr: float = 1e-5) -> "TransformersPeer":
        """Qwen3NextForCausalLM made on `device` from our config and full state dict, in `dtype`, no
        files (a multi-GB model written and read back costs tens of seconds). transformers v5 names
        and stacks the routed experts as we do, so our parameters load as they are.

        Raises:
            ValueError: a transformers parameter our state lacks, or a tensor it has no place for.
        """
        if torch.device(device).type == "cpu":
            sys.modules.setdefault("fla", None)
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # deferred: after the fla choice above

        hf_cfg = Qwen3NextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
        with torch.device(device):
            hf = Qwen3NextForCausalLM(hf_cfg)
        missing, unexpected = hf.load_state_dict(state, strict=False)
        params = dict(hf.named_parameters())
        if unexpected or any(k in params for k in missing):  # buffers (made by __init__) need no value
            raise ValueError(f"transformers Qwen3-Next: expected our parameter names, got missing "
                             f"{[k for k in missing if k in params][:5]}, unexpected {unexpected[:5]}")
        hf = hf.to(dtype)
        hf.train()
        return cls(hf, lr=lr)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train_step(self, trajectories: list[list[int]], loss_masks: list[list[int]] | None = None, *,
                   gauge: bool = True) -> tuple[float, float, int]:
        """Forward + backward of each trajectory, then one optimizer step (device work included:
        synchronised at the end).

        Args:
            gauge: measure saved-for-backward bytes (`SavedTensorBytes`: a Python hook per saved
                tensor; off for device timings).
        Returns:
            (wall seconds, process CPU seconds, peak saved-for-backward bytes of one trajectory; 0
            without the gauge).
        """
        n_loss = sum(sum(m[1:]) for m in loss_masks) if loss_masks else sum(len(t) - 1 for t in trajectories)
        peak = 0
        with Stopwatch() as sw:
            for i, toks in enumerate(trajectories):
                peak = max(peak, self.backward(toks, loss_masks[i] if loss_masks else None, n_loss=n_loss, gauge=gauge))
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self._sync()
        return sw.wall, sw.cpu, peak

    def backward(self, toks: list[int], loss_mask: list[int] | None, *, n_loss: float, gauge: bool = False) -> int:
        """Forward + backward of one trajectory's share of the loss: its negative log-likelihood
        summed over its loss positions, over `n_loss`. Gradients accumulate in .grad.

        Returns:
            peak saved-for-backward bytes (0 without the gauge).
        """
        ids = torch.tensor(toks, dtype=torch.long, device=self.device)[None]
        mask = torch.tensor(loss_mask[1:] if loss_mask else [1] * (len(toks) - 1), dtype=torch.float32, device=self.device)
        with SavedTensorBytes(self.model) if gauge else contextlib.nullcontext() as meter:
            logits_LV = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            logprob = torch.log_softmax(logits_LV, -1).gather(1, ids[0, 1:, None])[:, 0]
            loss = -(logprob * mask).sum() / max(n_loss, 1)
            peak = meter.peak if gauge else 0
            loss.backward()
        return peak

    @torch.no_grad()
    def logprobs(self, trajectories: list[list[int]]) -> tuple[float, float, list[torch.Tensor]]:
        """Forward only: each trajectory's token log-probs (positions 1..L-1), one at a time.

        Returns:
            (wall seconds, process CPU seconds, the log-probs of every trajectory, on the model's device).
        """
        out = []
        with Stopwatch() as sw:
            for toks in trajectories:
                ids = torch.tensor(toks, dtype=torch.long, device=self.device)[None]
                logits_LV = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
                out.append(torch.log_softmax(logits_LV, -1).gather(1, ids[0, 1:, None])[:, 0])
            self._sync()
        return sw.wall, sw.cpu, out


def _qwen3_next_modeling():
    # deferred: the caller decides first whether transformers may bind fla (`sys.modules["fla"]`)
    from transformers.models.qwen3_next import modeling_qwen3_next

    return modeling_qwen3_next


def gated_delta_rule_bound() -> str:
    """Which chunked gated delta rule transformers' Qwen3-Next calls: "fla" or "torch" (its reference).

    transformers picks it once, at import (`use_kernel_func_from_hub_with_fallback`): fla's when
    fla is importable; the choice sits in the wrapper's closure.
    """
    fn = _qwen3_next_modeling().torch_chunk_gated_delta_rule
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    impl = cells.get("implementation", inspect.unwrap(fn))
    return "fla" if getattr(impl, "__module__", "").startswith("fla") else "torch"


@contextlib.contextmanager
def torch_gated_delta_rule() -> Iterator[None]:
    """Inside the block transformers' Qwen3-Next runs its PyTorch chunked gated delta rule,
    whatever it bound at import."""
    mod = _qwen3_next_modeling()
    bound = mod.torch_chunk_gated_delta_rule
    mod.torch_chunk_gated_delta_rule = inspect.unwrap(bound)
    try:
        yield
    finally:
        mod.torch_chunk_gated_delta_rule = bound


@contextlib.contextmanager
def fla_hopper_guard_lifted() -> Iterator[None]:
    """Inside the block fla runs its gated `chunk_bwd_dqkwg` on Hopper with Triton 3.4-3.7.0 instead
    of raising (its check reads `fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1` at call time). Sound
    only where fla tiles K as BK = 128 (Hopper, K = 128): callers check the gradients."""
    from fla.ops.common import chunk_o  # optional: fla is installed on some GPU machines only

    old = chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        yield
    finally:
        chunk_o.TRITON_ABOVE_3_7_1 = old
