"""Memory bounds of the service: the slice and forest caches hold at most their
byte budgets, a request body is read into one buffer, and a rejected batch is not copied on the
way to its 413."""
from __future__ import annotations

import asyncio
import json
import tracemalloc

import numpy as np
import pytest

from planner_service.core.caches import ByteLRU
from planner_service.core import PlannerCore, ServiceConfig
from planner_service.errors import LimitError
from planner_service.transport.http import _read_body
from proto.harts.v1 import planner_pb2, rollouts_pb2
from tests.service_helpers import TOPOLOGY, rollout_doc


def test_byte_lru_evicts_least_recently_used_and_skips_oversized_values():
    sizes = []
    lru = ByteLRU(100, len, sizes.append)
    lru.put("a", b"x" * 40)
    lru.put("b", b"x" * 40)
    assert lru.get("a") is not None  # "b" is now the least recently used
    lru.put("c", b"x" * 40)
    assert "b" not in lru and "a" in lru and "c" in lru and lru.nbytes == 80
    lru.put("huge", b"x" * 101)  # larger than the whole budget: not kept, nothing evicted
    assert "huge" not in lru and len(lru) == 2
    lru.pop("a")
    assert lru.nbytes == 40 and sizes[-1] == 40


def test_slice_cache_is_bounded_by_bytes_and_evicted_plans_are_served_from_the_store(tmp_path):
    core = PlannerCore(ServiceConfig(db_path=str(tmp_path / "cache.db"), slice_cache_bytes=40_000,
                                     forest_cache_bytes=60_000))
    core.start()
    try:
        first = {}
        for i in range(8):
            step = f"s-cache-{i}"
            core.submit(json.dumps(rollout_doc(step, seed=i, trajectories=8)).encode(), "json")
            core.plan(step, planner_pb2.Topology(**TOPOLOGY))
            first[step] = [core.fetch(step, r) for r in range(2)]
            assert core.caches.slices.nbytes <= 40_000 and core.caches.forests.nbytes <= 60_000
        step_bytes = sum(map(len, first["s-cache-0"]))
        assert 8 * step_bytes > 40_000  # a count bound of 8 steps would hold more than the budget
        assert not any(key[0] == "s-cache-0" for key in core.caches.slices._items)
        metrics = core.metrics.render().decode()
        held = float(metrics.split('harts_cache_bytes{cache="slices"} ')[1].split()[0])
        assert 0 < held <= 40_000
        for step, slices in first.items():  # identical bytes, cached or not
            assert [core.fetch(step, r) for r in range(2)] == slices
    finally:
        core.close()


def _request(chunks: list[bytes], declared: int | None):
    from starlette.requests import Request

    headers = [(b"content-type", b"application/json")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    pending = list(chunks)

    async def receive():  # like uvicorn, a new bytes object per message
        chunk = pending.pop(0)
        return {"type": "http.request", "body": bytes(memoryview(chunk)), "more_body": bool(pending)}

    return Request({"type": "http", "method": "POST", "path": "/v1/steps", "headers": headers, "query_string": b""},
                   receive)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_request_body_is_read_into_one_buffer(declared):
    size, piece = 8 << 20, 64 << 10
    chunks = [bytes([i % 251]) * piece for i in range(size // piece)]
    expected = b"".join(chunks)
    request = _request(chunks, size if declared else None)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_read_body(_request([b"{}"], 2 if declared else None), 10))  # imports, first use
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            body = loop.run_until_complete(_read_body(request, size))
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    finally:
        loop.close()
    assert body == expected
    # a list of the received chunks joined at the end would peak at twice the body
    assert peak < 1.5 * size, peak
    with pytest.raises(LimitError):
        asyncio.run(_read_body(_request(chunks, size if declared else None), size - 1))


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_a_rejected_protobuf_batch_is_not_copied_before_its_413(tmp_path):
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident size
    except OSError:
        pytest.skip("needs /proc/self/clear_refs (Linux) to measure the peak")
    core = PlannerCore(ServiceConfig(db_path=str(tmp_path / "mem.db")))
    core.start()
    try:
        batch = rollouts_pb2.RolloutBatch(batch_id="too-long", vocab_size=64)
        traj = batch.trajectories.add(id="a")
        traj.tokens = np.ones(12 << 20, "<i4").tobytes()  # 48 MiB: 12M tokens, over max_trajectory_length
        body = batch.SerializeToString()
        del batch, traj
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = _vm("VmRSS")
        with pytest.raises(LimitError, match="max_trajectory_length"):
            core.submit(body, "proto")
        peak = _vm("VmHWM") - start
        # the parsed message plus ingest's view of its tokens; no canonical re-serialisation first
        assert peak < 2.5 * len(body), (peak >> 20, len(body) >> 20)
        assert core.list_steps() == []
    finally:
        core.close()
