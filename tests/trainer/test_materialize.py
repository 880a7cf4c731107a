"""No rank materialises the whole model (trainer.models.materialize, trainer.models.init).

Four gloo processes build the tiny model on the meta device, shard it with FSDP2 over all four
ranks and, in a second mesh dimension, over pairs of ranks (world size 2), and fill only their
shards: from a seed, the shards put together are bitwise the full weights of the one-process
build (world size 1), with generator blocks small enough that shards cut through them; from a
Hugging Face directory, likewise, and every rank reads from the safetensors only the rows (for
stacked experts: the experts) of its shards. `harts export` reads a DCP checkpoint unit by unit.
"""
from __future__ import annotations

import os
import queue as queue_mod
import socket
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.models import Qwen3NextForRL, build_model, debugmodel, load_model
from trainer.models import init as init_mod

SEED = 21
BLOCK = 200  # generator block of ~200 values: the embedding's 64-value rows come 3 to a block


def _worker(rank: int, port: int, hf_dir: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    import safetensors
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.config import ParallelismSection
    from trainer.distributed import DistContext
    from trainer.models.materialize import local_rows
    from trainer.parallelize import parallelize

    init_mod.BLOCK_ELEMENTS = BLOCK
    reads: list[tuple[str, int, int]] = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, rows):
            n = self.inner.get_shape()[0]
            start, stop, _ = rows.indices(n)
            reads.append((self.name, start, stop))
            return self.inner[rows]

    class Opened:
        def __init__(self, *a, **kw):
            self.inner = real_open(*a, **kw)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, name):
            return Recording(name, self.handle.get_slice(name))

    safetensors.safe_open = Opened
    try:
        ctx = DistContext(rank=rank, world_size=4, initialized=True)
        cfg = ParallelismSection()
        meshes = {4: init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)),
                  2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))["dp"]}
        out = {}
        for world, mesh in meshes.items():
            for source in ("seed", "hf"):
                reads.clear()
                model = build_model("tiny" if source == "seed" else hf_dir, seed=SEED,
                                    shard=lambda m: parallelize(m, mesh, cfg, ctx, reshard=True))
                shards = {}
                for name, p in model.named_parameters():
                    rows, local = local_rows(p)
                    shards[name] = (rows.start, rows.stop, local.detach().numpy().copy())
                out[(world, source)] = {"shards": shards, "reads": list(reads)}
        queue.put((rank, out))
    finally:
        safetensors.safe_open = real_open
        dist.destroy_process_group()


def _spawn(hf_dir: str) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, port, hf_dir, q)) for r in range(4)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + 300
    while len(out) < 4:
        try:
            rank, got = q.get(timeout=2)
            out[rank] = got
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                pytest.fail(f"a rank failed or hung (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from trainer.export import write_hf_dir

    hf_dir = tmp_path_factory.mktemp("hf") / "model"
    src = Qwen3NextForRL(debugmodel())
    src.init_weights(SEED + 1)
    write_hf_dir(hf_dir, src.state_dict(), src.config, dtype=torch.float32)
    return _spawn(str(hf_dir)), hf_dir


def _assembled(out: dict, world: int, source: str) -> dict[str, np.ndarray]:
    """The full tensors from the shards of the ranks of one FSDP2 group (ranks 0..world-1)."""
    full = {}
    for name in out[0][(world, source)]["shards"]:
        parts = sorted((out[r][(world, source)]["shards"][name] for r in range(world)), key=lambda p: p[:2])
        rows = [p for p in parts if p[1] > p[0]]
        assert [p[0] for p in rows] == [0] + [p[1] for p in rows[:-1]], name  # contiguous, in order
        full[name] = np.concatenate([p[2] for p in rows])
    return full


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_seeded_shards_are_bitwise_the_full_weights_at_any_world_size(shards, world, monkeypatch):
    out, _ = shards
    monkeypatch.setattr(init_mod, "BLOCK_ELEMENTS", BLOCK)
    one = build_model("tiny", seed=SEED)
    got = _assembled(out, world, "seed")
    assert got.keys() == dict(one.named_parameters()).keys()
    for name, p in one.named_parameters():
        assert np.array_equal(got[name], p.detach().numpy()), name
    embed = one.model.embed_tokens.weight.shape
    assert embed[0] % world == 0 and (embed[0] // world) % (BLOCK // embed[1]) != 0  # shards cut generator blocks


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_hf_shards_read_only_their_rows_from_safetensors(shards, world):
    out, hf_dir = shards
    whole = load_model(hf_dir)
    got = _assembled(out, world, "hf")
    for name, p in whole.named_parameters():
        assert np.array_equal(got[name], p.detach().numpy()), name
    n_experts = whole.config.num_experts
    for rank in range(world):
        shard_rows = {n: (a, b) for n, (a, b, _) in out[rank][(world, "hf")]["shards"].items()}
        for name, start, stop in out[rank][(world, "hf")]["reads"]:
            if ".mlp.experts." in name and name.split(".")[-3].isdigit():  # one expert's tensor: the rank's expert
                prefix, e = name.rsplit(".", 3)[0], int(name.split(".")[-3])
                a, b = shard_rows[prefix + (".down_proj" if "down_proj" in name else ".gate_up_proj")]
                assert a <= e < b <= n_experts, (rank, name)
            else:
                a, b = shard_rows[name if name in shard_rows else "model.embed_tokens.weight"]
                assert (start, stop) == (a, b), (rank, name, start, stop, a, b)


def test_harts_export_reads_the_checkpoint_unit_by_unit(tmp_path, monkeypatch):
    """`harts export` loads one unit's tensors at a time and writes files of at most max_shard_bytes."""
    import json

    from trainer import checkpoint
    from trainer.distributed import DistContext
    from trainer.export import export_checkpoint, unit_names

    model = build_model("tiny", seed=SEED)
    opt = torch.optim.AdamW(model.parameters())
    path = checkpoint.save(tmp_path / "ckpt", step=1, model=model, optimizer=opt, ctx=DistContext(),
                           meta={"step_ids": ["a"], "model": "tiny", "model_config": model.config.to_hf_dict()})
    calls = []
    real = checkpoint.load_model_tensors
    monkeypatch.setattr(checkpoint, "load_model_tensors", lambda p, t: (calls.append(sorted(t)), real(p, t))[1])
    out = export_checkpoint(path, tmp_path / "hf", dtype=torch.float32, max_shard_bytes=64 << 10)
    assert calls == [sorted(u) for u in unit_names(model)]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert len(files) > len(calls)
    for f in files:
        names = [k for k, v in index.items() if v == f]
        assert (out / f).stat().st_size <= (64 << 10) + 4096 or len(names) == 1, f
    back = load_model(out)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
