"""PlannerCore without a transport: idempotent submit, planning, sealed slices, long-poll, recovery."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest

from planner_service.core import PlannerCore, ServiceConfig
from planner_service.errors import (
    ConflictError, LimitError, NotFoundError, NotReadyError, PlanningError, StorageError, ValidationError,
)
from planner_service.ingest import json_to_proto
from planner_service.store.sqlite_files import file_bytes
from proto.harts.v1 import planner_pb2
from plan.seal import open_sealed
from tests.service_helpers import TOPOLOGY, rollout_doc

TOPO = planner_pb2.Topology(**TOPOLOGY)


@pytest.fixture()
def core(tmp_path):
    c = PlannerCore(ServiceConfig(db_path=str(tmp_path / "core.db"), max_request_bytes=1 << 20))
    c.start()
    yield c
    c.close()


def _body(doc: dict) -> bytes:
    return json.dumps(doc).encode()


def test_submit_is_idempotent_by_batch_id(core):
    doc = rollout_doc("s-idem")
    first = core.submit(_body(doc), "json")
    assert not first.duplicate and first.status.state == planner_pb2.STEP_STATE_SUBMITTED
    again = core.submit(_body(doc), "json")
    assert again.duplicate and again.status == first.status
    other = rollout_doc("s-idem", seed=1)
    with pytest.raises(ConflictError, match="batch_id"):
        core.submit(_body(other), "json")
    assert [s.step_id for s in core.list_steps()] == ["s-idem"]


def _reordered(value):
    """The same JSON value with every object's keys in reverse order."""
    if isinstance(value, dict):
        return {k: _reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reordered(v) for v in value]
    return value


def test_idempotency_compares_content_not_bytes(core):
    doc = rollout_doc("s-content")
    first = core.submit(_body(doc), "json")
    assert not first.duplicate
    spellings = {
        "indented, keys reversed": json.dumps(_reordered(doc), indent=3).encode(),
        "floats respelt": re.sub(r"-?\d+\.\d+", lambda m: f"{float(m.group()):.17e}", json.dumps(doc)).encode(),
        "explicit defaults": json.dumps({**doc, "trees": []}).encode(),
        "protobuf": json_to_proto(doc).SerializeToString(),
    }
    assert len(set(spellings.values()) | {_body(doc)}) == len(spellings) + 1
    for name, body in spellings.items():
        fmt = "proto" if name == "protobuf" else "json"
        resp = core.submit(body, fmt)
        assert resp.duplicate and resp.status == first.status, name
    assert core.submit_message(json_to_proto(doc)).duplicate
    changed = json.loads(_body(doc))
    changed["trajectories"][3]["tokens"][-1] = (changed["trajectories"][3]["tokens"][-1] + 1) % 64
    with pytest.raises(ConflictError, match="other content"):
        core.submit(_body(changed), "json")
    changed = json_to_proto(doc)
    changed.trajectories[0].reward = 0.5
    with pytest.raises(ConflictError):
        core.submit(changed.SerializeToString(), "proto")
    assert [s.step_id for s in core.list_steps()] == ["s-content"]


def test_rows_of_earlier_versions_are_compared_by_content(core):
    # an earlier version keyed steps by a SHA-256 of the body bytes
    import hashlib

    from planner_service.store import StepRecord

    doc = rollout_doc("s-legacy")
    body = _body(doc)
    core.store.insert_step(StepRecord(
        step_id="s-legacy", body_sha256="json:" + hashlib.sha256(body).hexdigest(), body_format="json",
        trajectories=6, unique_tokens=1, expanded_tokens=1, submitted_at=time.time(),
        state=planner_pb2.STEP_STATE_SUBMITTED), body)
    assert core.submit(json.dumps(doc, indent=1).encode(), "json").duplicate
    assert core.submit(json_to_proto(doc).SerializeToString(), "proto").duplicate
    with pytest.raises(ConflictError):
        core.submit(_body(rollout_doc("s-legacy", seed=2)), "json")


def test_invalid_batch_names_the_field_and_stores_nothing(core):
    doc = rollout_doc("s-bad")
    doc["trajectories"][2]["tokens"][3] = 64  # vocab_size is 64
    with pytest.raises(ValidationError) as err:
        core.submit(_body(doc), "json")
    assert err.value.field.startswith("trajectories[2].tokens")
    with pytest.raises(ValidationError, match="RolloutBatch"):
        core.submit(b"\xff\xff\xff", "proto")
    with pytest.raises(LimitError):
        core.submit(b" " * (core.cfg.max_request_bytes + 1), "json")
    assert core.list_steps() == []


def test_plan_seals_one_slice_per_rank_and_serves_identical_bytes(core):
    core.submit(_body(rollout_doc("s-plan")), "json")
    with pytest.raises(NotReadyError):
        core.fetch("s-plan", 0)
    st = core.plan("s-plan", TOPO)
    assert st.state == planner_pb2.STEP_STATE_PLANNED
    assert st.stats.unique_tokens == st.unique_tokens and st.stats.expanded_tokens == st.expanded_tokens
    assert st.stats.compression_ideal > 1.0  # the rollouts share a prompt
    assert st.topology.world_size == 2 and st.topology.chunk_size == 16
    for rank in range(2):
        data = core.fetch("s-plan", rank)
        sl = open_sealed(data)
        assert sl.header.step_id == "s-plan" and sl.rank.rank == rank
        assert core.fetch("s-plan", rank) == data
        assert core.store.slice("s-plan", rank) == data
    with pytest.raises(NotFoundError, match="rank"):
        core.fetch("s-plan", 2)
    with pytest.raises(NotFoundError):
        core.fetch("nope", 0)
    # same topology again: the stored plan, not a new one; another topology: refused
    assert core.plan("s-plan", TOPO).planned_at == st.planned_at
    with pytest.raises(ConflictError, match="topology"):
        core.plan("s-plan", planner_pb2.Topology(world_size=3, microbatch_tokens=128, chunk_size=16))


def test_topology_errors_name_the_field(core):
    core.submit(_body(rollout_doc("s-topo")), "json")
    cases = {
        "topology.world_size": planner_pb2.Topology(world_size=0, microbatch_tokens=128),
        "topology.chunk_size": planner_pb2.Topology(world_size=1, microbatch_tokens=128, chunk_size=24),
        "topology.microbatch_tokens": planner_pb2.Topology(world_size=1, microbatch_tokens=8, chunk_size=16),
    }
    for field, topo in cases.items():
        with pytest.raises(ValidationError) as err:
            core.plan("s-topo", topo)
        assert err.value.field == field
    assert core.status("s-topo").state == planner_pb2.STEP_STATE_SUBMITTED


def test_planning_failure_is_stored_and_the_step_can_be_replanned(core):
    doc = rollout_doc("s-fail")
    core.submit(_body(doc), "json")
    longest = max(len(t["tokens"]) for t in doc["trajectories"])
    impossible = planner_pb2.Topology(world_size=1, microbatch_tokens=16, chunk_size=16, no_windows=True)
    assert longest > 16
    with pytest.raises(PlanningError):
        core.plan("s-fail", impossible)
    st = core.status("s-fail")
    assert st.state == planner_pb2.STEP_STATE_FAILED and st.error
    with pytest.raises(PlanningError):
        core.fetch("s-fail", 0)
    assert core.plan("s-fail", TOPO).state == planner_pb2.STEP_STATE_PLANNED


def test_submit_with_topology_plans_in_the_background_and_wakes_long_polls(core):
    doc = rollout_doc("s-poll")

    async def scenario():
        waiter = asyncio.create_task(core.aio.fetch("s-poll", 1, wait=20.0))
        await asyncio.sleep(0.2)  # the step does not exist yet: the fetch waits for it
        assert not waiter.done()
        threading.Thread(target=core.submit, args=(_body(doc), "json", TOPO)).start()
        return await waiter  # woken by the plan; a fetch that waited out its 20 s would raise instead

    data = asyncio.run(scenario())
    assert open_sealed(data).rank.rank == 1
    assert data == core.fetch("s-poll", 1)


def test_long_poll_gives_up_after_the_wait(core):
    core.submit(_body(rollout_doc("s-wait")), "json")

    async def scenario(step):
        t0 = time.perf_counter()
        with pytest.raises((NotReadyError, NotFoundError)) as err:
            await core.aio.fetch(step, 0, wait=0.3)
        return err.type, time.perf_counter() - t0

    kind, elapsed = asyncio.run(scenario("s-wait"))
    assert kind is NotReadyError and 0.25 <= elapsed < 3.0
    kind, elapsed = asyncio.run(scenario("unknown"))
    assert kind is NotFoundError and 0.25 <= elapsed < 3.0


def test_restart_recovers_plans_and_resumes_interrupted_planning(tmp_path):
    cfg = ServiceConfig(db_path=str(tmp_path / "r.db"))
    a = PlannerCore(cfg)
    a.start()
    a.submit(_body(rollout_doc("s-done")), "json")
    a.plan("s-done", TOPO)
    before = [a.fetch("s-done", r) for r in range(2)]
    a.submit(json_to_proto(rollout_doc("s-cut")).SerializeToString(), "proto")
    # a crash right after the plan was requested, before it was stored
    a.store.request_plan("s-cut", planner_pb2.Topology(world_size=2, microbatch_tokens=128, memory_tokens=1024,
                                                       chunk_size=16).SerializeToString(deterministic=True))
    a.close()

    b = PlannerCore(cfg)
    b.start()
    try:
        assert [b.fetch("s-done", r) for r in range(2)] == before
        data = asyncio.run(b.aio.fetch("s-cut", 0, wait=20.0))
        assert open_sealed(data).header.step_id == "s-cut"
        assert b.submit(json_to_proto(rollout_doc("s-cut")).SerializeToString(), "proto").duplicate
    finally:
        b.close()


def test_metrics_count_plans_and_waiting_steps(core):
    core.submit(_body(rollout_doc("s-m1")), "json")
    core.submit(_body(rollout_doc("s-m2")), "json")
    text = core.metrics.render().decode()
    assert "harts_steps_waiting 2.0" in text
    core.plan("s-m1", TOPO)
    text = core.metrics.render().decode()
    assert "harts_steps_waiting 1.0" in text
    assert "harts_plan_seconds_count 1.0" in text
    assert 'harts_plans_total{outcome="planned"} 1.0' in text
    assert "harts_compression_ideal_count 1.0" in text
    assert 'harts_ingest_bytes_total{format="json"}' in text


def test_default_topology_plans_every_submission(tmp_path):
    cfg = ServiceConfig(db_path=str(tmp_path / "d.db"), default_topology=TOPO)
    c = PlannerCore(cfg)
    c.start()
    try:
        c.submit(_body(rollout_doc("s-default")), "json")
        data = asyncio.run(c.aio.fetch("s-default", 1, wait=20.0))
        assert open_sealed(data).rank.rank == 1
        assert c.status("s-default").topology.world_size == TOPO.world_size
    finally:
        c.close()
    with pytest.raises(ValidationError):
        ServiceConfig(default_topology=planner_pb2.Topology(world_size=0))


def test_concurrent_plans_of_one_step_are_serialised(core):
    core.submit(_body(rollout_doc("s-race", trajectories=12)), "json")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: core.plan("s-race", TOPO), range(4)))
    assert len({r.planned_at for r in results}) == 1
    assert 'harts_plans_total{outcome="planned"} 1.0' in core.metrics.render().decode()


def _padded(doc: dict, nbytes: int) -> bytes:
    """The document followed by `nbytes` of JSON whitespace (stored with the body)."""
    return _body(doc) + b" " * nbytes


def _wait(check, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_delete_removes_the_step_its_body_and_slices(core):
    core.submit(_body(rollout_doc("s-del")), "json")
    core.plan("s-del", TOPO)
    core.fetch("s-del", 1)
    st = core.delete("s-del")
    assert st.step_id == "s-del" and st.state == planner_pb2.STEP_STATE_PLANNED
    for call in (lambda: core.status("s-del"), lambda: core.fetch("s-del", 1), lambda: core.store.body("s-del"),
                 lambda: core.delete("s-del")):
        with pytest.raises(NotFoundError):
            call()
    assert core.store.slice("s-del", 1) is None and core.list_steps() == []
    assert not core.submit(_body(rollout_doc("s-del")), "json").duplicate  # the id is free again
    assert 'harts_steps_deleted_total{cause="request"} 1.0' in core.metrics.render().decode()


def test_retention_keeps_the_newest_steps_and_compacts_the_file(tmp_path):
    db = tmp_path / "keep.db"
    c = PlannerCore(ServiceConfig(db_path=str(db), retain_steps=2))
    c.start()
    try:
        for i in range(6):
            c.submit(_padded(rollout_doc(f"s-keep-{i}", seed=i), 1 << 20), "json")
        assert _wait(lambda: [s.step_id for s in c.list_steps()] == ["s-keep-5", "s-keep-4"])
        assert _wait(lambda: 'harts_steps_deleted_total{cause="retention"} 4.0' in c.metrics.render().decode())
        # compaction gives the freed pages back: the file holds about the two kept bodies
        assert _wait(lambda: db.stat().st_size + Path(f"{db}-wal").stat().st_size < 3.5 * (1 << 20))
    finally:
        c.close()


def test_max_age_deletes_old_steps(tmp_path):
    c = PlannerCore(ServiceConfig(db_path=str(tmp_path / "age.db"), max_age_seconds=0.5, storage_probe_seconds=0.1))
    c.start()
    try:
        c.submit(_body(rollout_doc("s-old")), "json")
        time.sleep(0.3)
        c.submit(_body(rollout_doc("s-new", seed=1)), "json")
        assert _wait(lambda: [s.step_id for s in c.list_steps()] == ["s-new"], 5)
        assert _wait(lambda: c.list_steps() == [], 5)
    finally:
        c.close()


_EARLIER_SCHEMA = """
CREATE TABLE steps (step_id TEXT PRIMARY KEY, body_sha256 TEXT NOT NULL, body_format TEXT NOT NULL,
    body BLOB NOT NULL, trajectories INTEGER NOT NULL, unique_tokens INTEGER NOT NULL,
    expanded_tokens INTEGER NOT NULL, submitted_at REAL NOT NULL, state INTEGER NOT NULL, topology BLOB,
    stats BLOB, error TEXT NOT NULL DEFAULT '', planned_at REAL NOT NULL DEFAULT 0,
    world_size INTEGER NOT NULL DEFAULT 0);
CREATE TABLE slices (step_id TEXT NOT NULL, rank INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (step_id, rank)) WITHOUT ROWID;
"""


def test_a_database_of_an_earlier_version_is_read_deleted_and_vacuumed(tmp_path):
    import hashlib
    import sqlite3

    db = tmp_path / "earlier.db"
    old = sqlite3.connect(db)
    old.execute("PRAGMA page_size=65536")
    old.execute("PRAGMA journal_mode=WAL")
    old.executescript(_EARLIER_SCHEMA)
    for i in range(3):  # bodies inline in `steps`, keyed by a hash of the bytes, no auto-vacuum
        body = _padded(rollout_doc(f"s-early-{i}", seed=i), 1 << 20)
        old.execute("INSERT INTO steps VALUES (?, ?, 'json', ?, 6, 1, 1, ?, ?, NULL, NULL, '', 0, 0)",
                    (f"s-early-{i}", "json:" + hashlib.sha256(body).hexdigest(), body, time.time(),
                     planner_pb2.STEP_STATE_SUBMITTED))
    old.commit()
    old.close()
    c = PlannerCore(ServiceConfig(db_path=str(db)))
    c.start()
    try:
        assert c.submit(json.dumps(rollout_doc("s-early-1", seed=1), indent=2).encode(), "json").duplicate
        c.delete("s-early-2")  # space reused, the file does not shrink: no VACUUM behind the users' back
        assert _wait(lambda: c.store._vacuum_hint)
        assert c.store._db.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
        assert c.plan("s-early-0", TOPO).state == planner_pb2.STEP_STATE_PLANNED  # body read from the old column
        c.submit(_body(rollout_doc("s-later")), "json")  # stored the new way beside the old rows
        assert c.plan("s-later", TOPO).state == planner_pb2.STEP_STATE_PLANNED
        for i in range(2):
            c.delete(f"s-early-{i}")
    finally:
        c.close()
    before = db.stat().st_size
    c = PlannerCore(ServiceConfig(db_path=str(db), vacuum=True))  # harts serve --vacuum
    c.start()
    try:
        assert file_bytes(c.store.path) < before / 2  # converted before the service was ready
        assert c.store._db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
        assert [s.step_id for s in c.list_steps()] == ["s-later"] and c.fetch("s-later", 0)
    finally:
        c.close()


def test_vacuum_is_skipped_when_the_disk_has_no_room_for_its_copy(tmp_path, monkeypatch):
    import shutil
    import sqlite3

    from planner_service.store.sqlite import SQLiteStore as Store

    db = tmp_path / "full.db"
    old = sqlite3.connect(db)
    old.executescript(_EARLIER_SCHEMA)
    old.close()
    store = Store(db)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))
    assert store.compact(vacuum=True) == 0
    assert store._db.execute("PRAGMA auto_vacuum").fetchone()[0] == 0  # left as it was
    store.close()


# ---- the last hostile-audit defects, each from its reproducer


def test_the_content_digest_includes_the_policy_version(core):
    doc = rollout_doc("pv", seed=1)
    assert not core.submit(_body({**doc, "policy_version": 3}), "json").duplicate
    assert core.submit(_body({**doc, "policy_version": 3}), "json").duplicate
    for other in ({**doc, "policy_version": 4}, doc):  # another version, or none, is other content
        with pytest.raises(ConflictError):
            core.submit(_body(other), "json")


def test_a_row_digested_without_the_policy_version_is_compared_by_content(core):
    doc = {**rollout_doc("pv-old", seed=2), "policy_version": 7}
    core.submit(_body(doc), "json")
    core.store._db.execute("UPDATE steps SET body_sha256 = 'content-v1:0000' WHERE step_id = 'pv-old'")
    assert core.submit(_body(doc), "json").duplicate
    with pytest.raises(ConflictError):
        core.submit(_body({**doc, "policy_version": 8}), "json")


@pytest.mark.parametrize("step_id", [".", "..", "a\x00b", "   ", "\t", "x" * 513, "a/b"],
                         ids=["dot", "dotdot", "nul", "spaces", "tab", "too-long", "slash"])
def test_step_ids_the_client_cannot_reach_are_refused(core, step_id):
    with pytest.raises(ValidationError) as err:
        core.submit(_body(rollout_doc(step_id)), "json")
    assert err.value.field == "batch_id" and len(err.value.message) < 700
    for call in (core.status, core.delete, lambda s: core.fetch(s, 0), lambda s: core.plan(s, TOPO)):
        with pytest.raises(ValidationError) as err:
            call(step_id)
        assert err.value.field == "step_id" and len(err.value.message) < 700
    assert core.list_steps() == []


def test_memory_tokens_beyond_the_plans_byte_budget_names_the_field_and_fails_nothing(core):
    huge = planner_pb2.Topology(world_size=2, memory_tokens=2**62)
    with pytest.raises(ValidationError) as err:
        core.submit(_body(rollout_doc("mt")), "json", huge)
    assert err.value.field == "topology.memory_tokens"
    assert core.list_steps() == []  # nothing stored
    core.submit(_body(rollout_doc("mt")), "json")
    with pytest.raises(ValidationError) as err:
        core.plan("mt", huge)
    assert err.value.field == "topology.memory_tokens"
    assert core.status("mt").state == planner_pb2.STEP_STATE_SUBMITTED  # not marked failed


def test_an_idle_server_writes_nothing(tmp_path):
    c = PlannerCore(ServiceConfig(db_path=str(tmp_path / "idle.db"), storage_probe_seconds=0.05))
    c.start()
    try:
        c.submit(_body(rollout_doc("idle")), "json", TOPO)
        _until(lambda: c.status("idle").state == planner_pb2.STEP_STATE_PLANNED)
        c.store.compact()  # under the store lock: checkpoints and truncates the WAL
        files = [tmp_path / "idle.db", tmp_path / "idle.db-wal"]
        before = [(p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        time.sleep(1.0)  # about 20 probes
        assert [(p.stat().st_size, p.stat().st_mtime_ns) for p in files] == before
        assert c.ready
    finally:
        c.close()


def test_plans_are_stored_compressed_and_served_byte_identical(tmp_path):
    """The replicas benchmark's batch shape, at a tenth of its size: 12 trajectories sharing 60% of their
    tokens, planned for 8 ranks; the stored slices stay within 3x the submitted JSON."""
    import numpy as np

    rng = np.random.default_rng(0)
    nodes = [{"id": 0, "tokens": rng.integers(0, 151936, 6000).tolist()}]
    nodes += [{"id": i + 1, "parent": 0, "tokens": rng.integers(0, 151936, 4000).tolist()} for i in range(12)]
    trajs = [{"id": f"t{i}", "node": i + 1, "advantage": float(rng.normal())} for i in range(12)]
    body = _body({"batch_id": "big", "vocab_size": 151936, "trees": [{"id": "task", "nodes": nodes, "trajectories": trajs}]})
    c = PlannerCore(ServiceConfig(db_path=str(tmp_path / "big.db"), slice_cache_bytes=0))
    c.start()
    try:
        c.submit(body, "json")
        c.plan("big", planner_pb2.Topology(world_size=8, microbatch_tokens=512))
        stored = c.store._db.execute("SELECT SUM(LENGTH(data)) FROM slices").fetchone()[0]
        sealed = [c.fetch("big", r) for r in range(8)]
        for r, data in enumerate(sealed):
            sl = open_sealed(data)  # verified: checksum and all
            assert sl.rank.rank == r
        raw = sum(map(len, sealed))
        assert stored <= 3 * len(body) < raw, (stored, len(body), raw)
    finally:
        c.close()


def _sqlite_core(tmp_path, monkeypatch, free: list[int], **settings):
    import shutil

    real = shutil.disk_usage

    def usage(path):
        u = real(path)
        return shutil._ntuple_diskusage(u.total, u.total - free[0], free[0])

    monkeypatch.setattr(shutil, "disk_usage", usage)
    c = PlannerCore(ServiceConfig(db_path=str(tmp_path / "space.db"), min_free_bytes=1 << 20, storage_probe_seconds=0.05,
                                  **settings))
    c.start()
    return c


def test_deleting_and_retention_go_on_while_the_disk_is_short_of_space(tmp_path, monkeypatch):
    """The audit: on a full disk `DELETE /v1/steps/{id}` answered 503 (8 of 8) and retention was
    blocked the same way, so the disk could not be freed through the API."""
    free = [1 << 30]
    c = _sqlite_core(tmp_path, monkeypatch, free, max_age_seconds=3600.0)
    try:
        for name in ("a", "b", "c"):
            c.submit(_body(rollout_doc(name, seed=len(name))), "json")
        free[0] = 1000
        _until(lambda: not c.ready)
        with pytest.raises(StorageError):
            c.submit(_body(rollout_doc("d", seed=4)), "json")  # a write that takes space is refused
        assert c.delete("a").step_id == "a"  # one that frees space is not
        c.maintenance.max_age_seconds = 1e-9  # every step is too old now: retention deletes them
        c.maintenance.wake()
        _until(lambda: c.list_steps() == [])
        assert 'harts_steps_deleted_total{cause="retention"} 2.0' in c.metrics.render().decode()
        assert not c.ready  # the (simulated) disk is still full
    finally:
        c.close()


def test_a_plan_that_does_not_fit_on_the_disk_waits_while_small_writes_go_on(tmp_path, monkeypatch):
    free = [1 << 30]
    c = _sqlite_core(tmp_path, monkeypatch, free)
    try:
        c.submit(_body(rollout_doc("fits", seed=1, trajectories=60)), "json")  # its plan stores ~20 KB
        free[0] = (1 << 20) + 8000  # the reserve and a little more: room for a small batch, not for the plan
        with pytest.raises(StorageError) as err:
            c.plan("fits", planner_pb2.Topology(world_size=2, microbatch_tokens=128, chunk_size=16,
                                                memory_tokens=1 << 20))
        assert err.value.need > 0 and "too full" in err.value.message
        st = c.status("fits")
        assert st.state == planner_pb2.STEP_STATE_FAILED and "when the disk has room" in st.error
        assert c.ready  # the disk is not below its reserve: the service still serves and stores
        c.submit(_body(rollout_doc("small", seed=2)), "json")
        time.sleep(0.5)  # probes and resume rounds: the plan must not be stored into the reserve
        assert c.status("fits").state == planner_pb2.STEP_STATE_FAILED
        free[0] = 1 << 30  # space freed: the waiting plan runs
        _until(lambda: c.status("fits").state == planner_pb2.STEP_STATE_PLANNED)
    finally:
        c.close()


def test_a_disk_below_the_reserve_is_not_ready_and_recovers_when_space_is_freed(tmp_path, monkeypatch):
    free = [1 << 30]
    c = _sqlite_core(tmp_path, monkeypatch, free)
    try:
        c.submit(_body(rollout_doc("before")), "json")
        free[0] = 1000
        with pytest.raises(StorageError) as err:
            c.submit(_body(rollout_doc("during", seed=1)), "json")
        assert "is full" in err.value.message or "too full" in err.value.message
        _until(lambda: not c.ready)
        assert c.status("before").state == planner_pb2.STEP_STATE_SUBMITTED  # reads go on
        free[0] = 2 << 20  # a little space: above the reserve
        _until(lambda: c.ready)
        c.submit(_body(rollout_doc("during", seed=1)), "json")
    finally:
        c.close()


def _until(check, seconds: float = 20.0) -> None:
    """Wait until check() holds (AssertionError after `seconds`)."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_slow_plans_and_submissions_never_hold_up_a_read(core, monkeypatch):
    """The hostile audit: six slow submissions filled the six threads of the pool that status
    reads shared with them, and a status GET went from 3 ms to 29.9 s. Here every submission and
    every plan blocks until released: status, list and a planned slice still answer."""
    import planner_service.planner as planner
    from planner_service import ingest

    core.submit(_body(rollout_doc("s-read")), "json")
    core.plan("s-read", TOPO)
    for i in range(2):
        core.submit(_body(rollout_doc(f"s-slow-plan-{i}", seed=i)), "json")
    release = threading.Event()
    parse, plan_step = ingest.forest_from_json, planner.plan_step

    def slow_parse(*args, **kwargs):
        release.wait(120)
        return parse(*args, **kwargs)

    def slow_plan(*args, **kwargs):
        release.wait(120)
        return plan_step(*args, **kwargs)

    monkeypatch.setattr(ingest, "forest_from_json", slow_parse)
    monkeypatch.setattr(planner, "plan_step", slow_plan)

    async def main():
        # more slow submissions than the event loop's default pool has threads (min(32, cores + 4))
        writes = [asyncio.ensure_future(core.aio.submit(_body(rollout_doc(f"s-slow-{i}", seed=i)), "json"))
                  for i in range(40)]
        plans = [asyncio.ensure_future(core.aio.plan(f"s-slow-plan-{i}", TOPO)) for i in range(2)]
        await asyncio.sleep(0.2)
        try:
            # bounds that only a starved read reaches
            status = await asyncio.wait_for(core.aio.status("s-read"), 60)
            steps = await asyncio.wait_for(core.aio.list_steps(), 60)
            data = await asyncio.wait_for(core.aio.fetch("s-read", 1), 60)
        finally:
            release.set()
        await asyncio.gather(*writes, *plans)
        return status, steps, data

    status, steps, data = asyncio.run(main())
    assert status.state == planner_pb2.STEP_STATE_PLANNED and open_sealed(data).rank.rank == 1
    assert "s-read" in {s.step_id for s in steps}
    assert len(core.list_steps(100)) == 43


def test_submit_answers_the_digest_of_what_it_stored_and_refuses_other_bytes(core):
    """The answer's body_sha256 is the SHA-256 of the body stored (byte for byte, both forms); a
    body that is not what the client digested is refused with nothing stored."""
    import hashlib

    from planner_service.errors import IntegrityError

    doc = rollout_doc("s-digest", seed=3)
    body = _body(doc)
    digest = hashlib.sha256(body).hexdigest()
    altered = body.replace(b'"tokens": [', b'"tokens": [1', 1)
    with pytest.raises(IntegrityError) as err:
        core.submit(altered, "json", body_sha256=digest)
    assert err.value.field == "body_sha256" and "altered in transit" in err.value.message
    assert core.list_steps() == []
    resp = core.submit(body, "json", body_sha256=digest.upper())  # hex digits in either case
    assert resp.body_sha256 == digest and core.store.body("s-digest") == ("json", body)
    # a duplicate in another spelling answers the digest of the bytes it carried (compared by content)
    pb = json_to_proto(doc).SerializeToString()
    again = core.submit_message(json_to_proto(doc), body=pb, body_sha256=hashlib.sha256(pb).hexdigest())
    assert again.duplicate and again.body_sha256 == hashlib.sha256(pb).hexdigest()
    # gRPC stores the batch bytes as they arrived
    other = json_to_proto(rollout_doc("s-digest-pb", seed=4))
    raw = other.SerializeToString()
    assert core.submit_message(other, body=raw).body_sha256 == hashlib.sha256(raw).hexdigest()
    assert core.store.body("s-digest-pb") == ("proto", raw)
