"""Planner replicas on one PostgreSQL database, against a real server.

A throwaway PostgreSQL (`benchmarks/postgres_server.py`; skipped locally without the Debian package,
a failure under CI) backs `harts serve --db postgresql://...` replicas on 127.0.0.1. What must
hold: a step is planned once whichever replicas are asked; a replica that dies mid-plan releases
its planning lock and another replica plans the step; a long-poll on one replica wakes when
another stores the plan; and under load (4 submitters, 2 pollers, clients that know both URLs)
a kill -9 of one replica loses no acknowledged batch, changes no slice, and every poller gets its
plan. Every wait is bounded.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from benchmarks.postgres_server import PostgresServer
from harts_client.client import PlannerClient, RetryPolicy
from planner_service.server import ServerProcess
from tests.postgres_helpers import require_postgres
from tests.service_helpers import TOPOLOGY, rollout_doc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "replica-token"
QUICK = RetryPolicy(backoff_s=0.05, max_backoff_s=0.5)


@pytest.fixture(scope="module")
def pg():
    with PostgresServer(require_postgres()) as server:
        yield server


def _replica(pg, tmp_path, name: str) -> ServerProcess:
    return ServerProcess(pg.url, token=TOKEN, log_path=tmp_path / f"{name}.log").start()


def _planned_count(srv: ServerProcess) -> float:
    text = httpx.get(srv.http_url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    m = re.search(r'^harts_plans_total\{outcome="planned"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_step_is_planned_once_and_long_polls_wake_on_the_other_replica(pg, tmp_path):
    a, b = _replica(pg, tmp_path, "a"), _replica(pg, tmp_path, "b")
    try:
        with PlannerClient(a.http_url, token=TOKEN) as ca, PlannerClient(b.http_url, token=TOKEN) as cb:
            ids = [f"once-{i}" for i in range(6)]
            for i, sid in enumerate(ids):
                ca.submit(rollout_doc(sid, seed=i))
            # both replicas asked to plan every step at the same time
            threads = [threading.Thread(target=c.plan, args=(sid,), kwargs=dict(TOPOLOGY))
                       for sid in ids for c in (ca, cb)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert _planned_count(a) + _planned_count(b) == len(ids)
            assert all(ca.status(sid)["state"] == "planned" for sid in ids)
            for sid in ids:
                assert ca.fetch_plan_bytes(sid, 1, timeout=10) == cb.fetch_plan_bytes(sid, 1, timeout=10)

            # a long-poll on b for a step that a plans later
            got: dict = {}
            poll = threading.Thread(target=lambda: got.update(data=cb.fetch_plan_bytes("wake", 0, timeout=60)))
            poll.start()
            time.sleep(1.0)
            ca.submit(rollout_doc("wake", seed=9), **TOPOLOGY)
            poll.join(60)
            assert got["data"] == ca.fetch_plan_bytes("wake", 0, timeout=10)
    finally:
        a.stop()
        b.stop()
    for srv in (a, b):
        assert "Traceback" not in srv.log_text(), srv.log_text()[-3000:]


_HOLD = """
import sys, time
from planner_service.store.postgres import PostgresStore
store = PostgresStore(sys.argv[1])
with store.plan_lock("orphan") as got:
    print("locked" if got else "busy", flush=True)
    time.sleep(600)
"""


def test_a_replica_that_dies_mid_plan_releases_the_step_to_another(pg, tmp_path):
    from planner_service.core import PlannerCore, ServiceConfig
    from planner_service.store.postgres import PostgresStore
    from proto.harts.v1 import planner_pb2

    # the lock: held by a process, free once it is killed
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, pg.url], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        store = PostgresStore(pg.url)
        with store.plan_lock("orphan", wait=False) as got:
            assert not got
        holder.kill()
        holder.wait(30)
        deadline = time.monotonic() + 30
        while True:
            with store.plan_lock("orphan", wait=False) as got:
                if got:
                    break
            assert time.monotonic() < deadline, "the lock of a killed process was not released"
            time.sleep(0.1)
        store.close()
    finally:
        holder.kill()

    # a step whose plan was requested by a replica that died before storing it
    dead = PlannerCore(ServiceConfig(db_path=pg.url))
    dead.submit(json.dumps(rollout_doc("orphan", seed=3)).encode(), "json")
    topo = planner_pb2.Topology(world_size=2, microbatch_tokens=128, memory_tokens=1024, chunk_size=16)
    dead.store.request_plan("orphan", topo.SerializeToString(deterministic=True))
    dead.close()
    alive = PlannerCore(ServiceConfig(db_path=pg.url, resume_seconds=0.2))
    alive.start()
    try:
        deadline = time.monotonic() + 30
        while alive.status("orphan").state != planner_pb2.STEP_STATE_PLANNED:
            assert time.monotonic() < deadline, alive.status("orphan")
            time.sleep(0.1)
    finally:
        alive.close()


def test_kill_9_of_one_replica_under_load_loses_nothing(pg, tmp_path):
    a, b = _replica(pg, tmp_path, "load-a"), _replica(pg, tmp_path, "load-b")
    urls = [a.http_url, b.http_url]
    per_submitter, submitters = 10, 4
    acked: list[str] = []
    ack_lock = threading.Lock()
    errors: list[str] = []
    fetched: dict[tuple[str, int], bytes] = {}
    killed = threading.Event()

    def submit(k: int) -> None:
        with PlannerClient(urls[k % 2:] + urls[:k % 2], token=TOKEN, timeout=60, retry=QUICK) as c:
            for i in range(per_submitter):
                sid = f"load-{k}-{i}"
                try:
                    c.submit(rollout_doc(sid, seed=100 * k + i), **TOPOLOGY)
                except Exception as exc:  # an unacknowledged batch may be lost; record why
                    errors.append(f"{sid}: {exc}")
                    continue
                with ack_lock:
                    acked.append(sid)
                    if len(acked) == 12:
                        a.kill()  # SIGKILL, mid-load
                        killed.set()

    def poll(rank: int) -> None:
        with PlannerClient(urls[rank:] + urls[:rank], token=TOKEN, timeout=60, retry=QUICK) as c:
            done = 0
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                with ack_lock:
                    todo = acked[done:]
                    finished = len(acked) + len(errors) == per_submitter * submitters
                if not todo and finished:
                    return
                for sid in todo:
                    fetched[(sid, rank)] = c.fetch_plan_bytes(sid, rank, timeout=120, world_size=2)
                    done += 1
                time.sleep(0.05)
            errors.append(f"poller {rank} ran out of time")

    threads = [threading.Thread(target=submit, args=(k,)) for k in range(submitters)]
    threads += [threading.Thread(target=poll, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert killed.is_set()
        assert not errors, errors
        assert len(acked) == per_submitter * submitters
        with PlannerClient(b.http_url, token=TOKEN) as c:
            for sid in acked:  # every acknowledged batch is stored and planned, its slices unchanged
                assert c.status(sid)["state"] == "planned", sid
                for rank in range(2):
                    assert c.fetch_plan_bytes(sid, rank, timeout=30) == fetched[(sid, rank)], (sid, rank)
    finally:
        a.kill()
        b.stop()
    assert "Traceback" not in b.log_text(), b.log_text()[-3000:]


def test_a_database_outage_is_a_storage_fault_that_clears(pg):
    import asyncio

    from planner_service.core import PlannerCore, ServiceConfig
    from planner_service.errors import StorageError
    from proto.harts.v1 import planner_pb2

    core = PlannerCore(ServiceConfig(db_path=pg.url, storage_probe_seconds=0.2))
    core.start()
    try:
        core.submit(json.dumps(rollout_doc("outage-0")).encode(), "json")
        pg.pause()
        try:
            with pytest.raises(StorageError) as err:
                core.submit(json.dumps(rollout_doc("outage-1", seed=1)).encode(), "json")
            assert "127.0.0.1" in err.value.message and "harts@" in err.value.message
            deadline = time.monotonic() + 20
            while core.ready:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            pg.resume()
        deadline = time.monotonic() + 30
        while not core.ready:
            assert time.monotonic() < deadline, core.readiness()
            time.sleep(0.1)
        core.submit(json.dumps(rollout_doc("outage-1", seed=1)).encode(), "json")
        # the listener reconnected: a plan stored by another replica wakes a long-poll here
        other = PlannerCore(ServiceConfig(db_path=pg.url))
        try:
            async def poll():
                return await core.aio.fetch("outage-1", 0, 30)

            async def both():
                task = asyncio.ensure_future(poll())
                await asyncio.sleep(0.5)
                await asyncio.to_thread(other.plan, "outage-1", planner_pb2.Topology(**TOPOLOGY))
                return await asyncio.wait_for(task, 30)

            assert asyncio.run(both()) == other.fetch("outage-1", 0)
        finally:
            other.close()
    finally:
        core.close()
