"""What a user would run instead: `transformers` Qwen3-Next on the same weights, and a common memory gauge.

    peer = TransformersPeer.from_model(model)            # our weights -> HF directory -> Qwen3NextForCausalLM
    seconds, cpu_seconds, saved = peer.train_step(trajectories, loss_masks)

`TransformersPeer` runs forward + backward of every trajectory one at a time (batch 1: without
fla, transformers' Qwen3-Next takes no packed varlen batch; its pure-torch gated delta rule
ignores `cu_seqlens`), with the token-mean negative log-likelihood over the loss positions, then
one fused AdamW step: the same work per token as a HARTS step. Attention is transformers'
default on the CPU (PyTorch SDPA).

`SavedTensorBytes` measures activation memory the same way for every runner: the bytes of the
tensors autograd keeps for backward (storages counted once, parameters excluded), live at once
at the worst point of the step, through saved-tensor hooks.

Legend: L trajectory length, V vocabulary.
"""
from __future__ import annotations

import sys
import tempfile
import weakref

import torch

from harts_client.timing import Stopwatch


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
        from trainer.optim import make_optimizer

        self.model = hf_model
        self.opt = make_optimizer(hf_model.parameters(), lr=lr)

    @classmethod
    def from_model(cls, model, lr: float = 1e-5) -> "TransformersPeer":
        """Export `model` (a Qwen3NextForRL) as a HF directory and load it with transformers (fp32)."""
        sys.modules.setdefault("fla", None)  # ENV.md: transformers must not bind fla's GPU kernels on CPU
        from transformers import AutoModelForCausalLM

        from trainer.export import write_hf_dir

        with tempfile.TemporaryDirectory() as tmp:
            path = write_hf_dir(f"{tmp}/hf", model.state_dict(), model.config, dtype=torch.float32)
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        hf.train()
        return cls(hf, lr=lr)

    def train_step(self, trajectories: list[list[int]], loss_masks: list[list[int]] | None = None
                   ) -> tuple[float, float, int]:
        """Forward + backward of each trajectory, then one optimizer step.

        Returns:
            (wall seconds, process CPU seconds, peak saved-for-backward bytes of one trajectory).
        """
        n_loss = sum(sum(m[1:]) for m in loss_masks) if loss_masks else sum(len(t) - 1 for t in trajectories)
        peak = 0
        with Stopwatch() as sw:
            for i, toks in enumerate(trajectories):
                ids = torch.tensor(toks, dtype=torch.long)[None]
                mask = torch.tensor(loss_masks[i][1:] if loss_masks else [1] * (len(toks) - 1), dtype=torch.float32)
                with SavedTensorBytes(self.model) as gauge:
                    logits_LV = self.model(input_ids=ids).logits[0, :-1].float()
                    logprob = torch.log_softmax(logits_LV, -1).gather(1, ids[0, 1:, None])[:, 0]
                    loss = -(logprob * mask).sum() / max(n_loss, 1)
                    peak = max(peak, gauge.peak)
                    loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return sw.wall, sw.cpu, peak

    @torch.no_grad()
    def logprobs(self, trajectories: list[list[int]]) -> tuple[float, float, list[torch.Tensor]]:
        """Forward only: each trajectory's token log-probs (positions 1..L-1), one at a time.

        Returns:
            (wall seconds, process CPU seconds, the log-probs of every trajectory).
        """
        out = []
        with Stopwatch() as sw:
            for toks in trajectories:
                ids = torch.tensor(toks, dtype=torch.long)[None]
                logits_LV = self.model(input_ids=ids).logits[0, :-1].float()
                out.append(torch.log_softmax(logits_LV, -1).gather(1, ids[0, 1:, None])[:, 0])
        return sw.wall, sw.cpu, out
