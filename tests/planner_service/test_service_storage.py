"""Storage faults against a real `harts serve` on 127.0.0.1.

The database lives on a small tmpfs so the disk can really fill up; `chattr +i` makes files
immutable. Both need root (the project's CI and developer machines run as root); the test is
skipped where they are not permitted. What must hold: a write that cannot be stored answers 503
naming the reason (nothing stored), readiness flips (HTTP /readyz and gRPC health), a plan that
could not be stored shows its step failed with the error and runs again once the storage
recovers; a database or WAL deleted under the running service loses no acknowledged batch (the
database is written back at once, or writes are refused), and a restart on a database that lacks
acknowledged batches is not ready until told to accept it; deleting frees a full disk. Every
wait is bounded.
"""
from __future__ import annotations

import errno
import json
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from planner_service.server import ServerProcess
from tests.service_helpers import TOPOLOGY, rollout_doc, start_serve

pytestmark = pytest.mark.integration


@pytest.fixture()
def tmpfs(tmp_path):
    """A 16 MiB tmpfs (skips unless mount and chattr are permitted)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("needs permission to mount a tmpfs (root)")
    try:
        probe = mnt / "probe"
        probe.touch()
        if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode:
            pytest.skip("needs chattr +i on tmpfs (root)")
        subprocess.run(["chattr", "-i", str(probe)], check=True)
        probe.unlink()
        yield mnt
    finally:
        subprocess.run(["chattr", "-R", "-i", str(mnt)], capture_output=True)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _chattr(flag: str, *paths: Path) -> None:
    subprocess.run(["chattr", flag, *[str(p) for p in paths if p.exists()]], check=True)


def _fill(path: Path) -> None:
    """Write until the file system is full."""
    chunk = b"\0" * (256 << 10)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    chunk = b"\0" * 4096
    with open(path, "ab", buffering=0) as f:  # the last partial blocks
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass


def _until(check, seconds: float = 5.0):
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def _grpc_health(target: str) -> str:
    with grpc.insecure_channel(target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def _padded(doc: dict, mib: float) -> bytes:
    """The document followed by whitespace: a body of about `mib` MiB whose bytes are all stored."""
    return json.dumps(doc).encode() + b" " * int(mib * (1 << 20))


def test_disk_full_immutable_and_deleted_database(tmpfs):
    db = tmpfs / "harts.db"
    srv = ServerProcess(db, extra=["--min-free-mb", "1"]).start()
    c = httpx.Client(base_url=srv.http_url, timeout=20)
    ct = {"Content-Type": "application/json"}
    try:
        assert c.post("/v1/steps", json=rollout_doc("ok"), params=TOPOLOGY).status_code == 200
        assert c.get("/v1/steps/ok/ranks/1/plan", params={"wait": 10}).status_code == 200
        assert c.post("/v1/steps", json=rollout_doc("later", seed=1)).status_code == 200

        # -- disk full
        filler = tmpfs / "filler"
        _fill(filler)
        r = c.post("/v1/steps", content=_padded(rollout_doc("full", seed=2), 2), headers=ct)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["code"] == "UNAVAILABLE" and "full" in err["message"] and str(db) in err["message"]
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
        assert "full" in ready.json()["reason"]
        assert _until(lambda: _grpc_health(srv.grpc_target) == "NOT_SERVING")
        assert c.get("/v1/steps/ok").json()["state"] == "planned"  # reads still work
        assert c.get("/v1/steps/ok/ranks/0/plan").status_code == 200
        r = c.post("/v1/steps/later/plan", json=TOPOLOGY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "UNAVAILABLE"
        st = c.get("/v1/steps/later").json()
        assert st["state"] == "failed" and "storage" in st["error"] and "planned again" in st["error"]
        assert c.get("/v1/steps/later/ranks/0/plan").status_code == 503
        assert "harts_storage_ok 0.0" in c.get("/metrics").text

        filler.unlink()  # the storage recovers: readiness returns and the failed plan runs again
        assert _until(lambda: c.get("/readyz").status_code == 200)
        assert _until(lambda: c.get("/v1/steps/later").json()["state"] == "planned")
        assert _until(lambda: _grpc_health(srv.grpc_target) == "SERVING")
        r = c.post("/v1/steps", content=_padded(rollout_doc("full", seed=2), 2), headers=ct)
        assert r.status_code == 200 and r.json()["duplicate"] is False  # nothing was stored by the 503

        # -- immutable database files
        _chattr("+i", db, Path(f"{db}-wal"))
        r = c.post("/v1/steps", json=rollout_doc("imm", seed=3))
        assert r.status_code == 503 and "not writable" in r.json()["error"]["message"], r.text
        assert c.get("/readyz").status_code == 503
        _chattr("-i", db, Path(f"{db}-wal"))
        assert _until(lambda: c.get("/readyz").status_code == 200)
        assert c.post("/v1/steps", json=rollout_doc("imm", seed=3)).status_code == 200

        # -- deleted while running: the open database is written back at once and serving goes on
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        assert _until(db.exists, 10)
        assert c.post("/v1/steps", json=rollout_doc("gone", seed=4)).status_code == 200
        assert c.get("/readyz").status_code == 200 and c.get("/v1/steps/ok").status_code == 200
    finally:
        c.close()
        srv.stop()
    log = srv.log_text()
    assert "Traceback" not in log
    assert log.count("storage fault") <= 4 and "storage recovered" in log, log[-3000:]


def test_unwritable_database_at_start_is_not_ready_until_writable(tmpfs):
    from planner_service.store.sqlite import SQLiteStore as Store

    db = tmpfs / "ro.db"
    Store(db).close()  # an existing database, then made immutable before the service starts
    _chattr("+i", db)
    srv = start_serve(db, tmpfs.parent / "ro.log", extra=["--min-free-mb", "1"])  # returns once the port accepts, ready or not
    try:
        assert "harts serve: not ready: storage" in srv.log_text()
        assert "harts serve: ready" not in srv.log_text()
        ready = httpx.get(srv.http_url + "/readyz", timeout=5)
        assert ready.status_code == 503 and ready.json()["status"] == "unavailable", ready.text
        assert str(db) in ready.json()["reason"]
        r = httpx.post(srv.http_url + "/v1/steps", json=rollout_doc("ro"), timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "UNAVAILABLE"
        _chattr("-i", db)
        assert _until(lambda: httpx.get(srv.http_url + "/readyz", timeout=5).status_code == 200)
        assert _until(lambda: "harts serve: ready" in srv.log_text(), 3)
        r = httpx.post(srv.http_url + "/v1/steps", json=rollout_doc("ro"), timeout=10)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
    assert "Traceback" not in srv.log_text()


# ---- a deleted WAL, a disk full at start-up


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_a_wal_deleted_under_the_service_loses_no_acknowledged_batch(tmp_path, stop):
    """The audit: a kill -9 0.1-3 s after `rm db-wal` lost 10 of 10 acknowledged batches (they lived
    only in the deleted WAL until the 5 s probe). Every acknowledged write is in the database file
    now: a kill at once, before anything noticed the deletion, loses none."""
    db = tmp_path / "wal.db"
    srv = ServerProcess(db, log_path=tmp_path / "wal.log").start()
    c = httpx.Client(base_url=srv.http_url, timeout=20)
    try:
        for i in range(10):
            assert c.post("/v1/steps", json=rollout_doc(f"w{i}", seed=i)).status_code == 200
        Path(f"{db}-wal").unlink()
    finally:
        c.close()
        srv.kill() if stop == "sigkill" else srv.stop()
    srv.start()
    try:
        with httpx.Client(base_url=srv.http_url, timeout=20) as c:
            ids = {s["step_id"] for s in c.get("/v1/steps", params={"limit": 100}).json()["steps"]}
            assert ids == {f"w{i}" for i in range(10)}
            Path(f"{db}-wal").unlink()  # noticed while running: a new WAL, and serving goes on
            assert _until(lambda: "WAL of" in srv.log_text(), 10)
            for i in range(10, 14):
                assert c.post("/v1/steps", json=rollout_doc(f"w{i}", seed=i)).status_code == 200
            assert c.get("/readyz").status_code == 200
    finally:
        srv.kill()
    srv.start()
    try:
        with httpx.Client(base_url=srv.http_url, timeout=20) as c:
            ids = {s["step_id"] for s in c.get("/v1/steps", params={"limit": 100}).json()["steps"]}
        assert ids == {f"w{i}" for i in range(14)}
    finally:
        srv.stop()
    assert "Traceback" not in srv.log_text()


def test_a_deleted_database_is_written_back_else_writes_are_refused_and_a_restart_is_not_ready(tmpfs):
    """The audit: a deleted database file refused writes while the service ran, but a restart came
    up ready on an empty database (0 of 10 batches) without a word."""
    db = tmpfs / "del.db"
    log_path = tmpfs.parent / "del.log"
    srv = ServerProcess(db, extra=["--min-free-mb", "1"], log_path=log_path).start()
    try:
        with httpx.Client(base_url=srv.http_url, timeout=20) as c:
            for i in range(10):
                assert c.post("/v1/steps", json=rollout_doc(f"d{i}", seed=i)).status_code == 200
            for suffix in ("", "-wal", "-shm"):
                Path(f"{db}{suffix}").unlink()
            assert _until(db.exists, 10)  # written back from the open connection
    finally:
        srv.kill()  # at once: what was written back is all there is
    srv.start()
    try:
        with httpx.Client(base_url=srv.http_url, timeout=20) as c:
            assert {s["step_id"] for s in c.get("/v1/steps").json()["steps"]} == {f"d{i}" for i in range(10)}
            assert c.post("/v1/steps", json=rollout_doc("d10", seed=10)).status_code == 200
            # a full disk: the database cannot be written back; writes are refused, readiness says why
            filler = tmpfs / "filler"
            _fill(filler)
            db.unlink()  # its blocks stay taken while the service holds it open
            r = c.post("/v1/steps", json=rollout_doc("d11", seed=11))
            assert r.status_code == 503 and "could not be written back" in r.json()["error"]["message"], r.text
            ready = c.get("/readyz")
            assert ready.status_code == 503 and "deleted" in ready.json()["reason"]
            assert c.get("/v1/steps/d3").status_code == 200  # reads go on from the open connection
    finally:
        srv.kill()  # the deleted file, and the 11 batches it held, are gone now
    filler.unlink()
    srv.start(ready=False)
    try:
        with httpx.Client(base_url=srv.http_url, timeout=20) as c:
            ready = c.get("/readyz")
            assert ready.status_code == 503 and "lacks acknowledged writes" in ready.json()["reason"], ready.text
            assert "--accept-data-loss" in ready.json()["reason"]
            r = c.post("/v1/steps", json=rollout_doc("d12", seed=12))
            assert r.status_code == 503 and "lacks acknowledged writes" in r.json()["error"]["message"]
    finally:
        srv.stop()
    srv.extra.append("--accept-data-loss")
    srv.start()  # ready: told to serve the database as it is
    try:
        with httpx.Client(base_url=srv.http_url, timeout=20) as c:
            assert c.get("/v1/steps").json()["steps"] == []
            assert c.post("/v1/steps", json=rollout_doc("d12", seed=12)).status_code == 200
    finally:
        srv.stop()
    srv.extra.remove("--accept-data-loss")
    srv.start()  # and from then on, the same database is simply ready
    srv.stop()
    log = srv.log_text()
    assert "Traceback" not in log and "serving" in log and "--accept-data-loss" in log


def test_a_restart_on_a_full_disk_still_serves_acknowledged_steps(tmpfs):
    db = tmpfs / "full.db"
    srv = ServerProcess(db, extra=["--min-free-mb", "1"], log_path=tmpfs.parent / "full.log").start()
    with httpx.Client(base_url=srv.http_url, timeout=20) as c:
        assert c.post("/v1/steps", json=rollout_doc("kept"), params=TOPOLOGY).status_code == 200
        slice_ = c.get("/v1/steps/kept/ranks/1/plan", params={"wait": 10})
        assert slice_.status_code == 200
    srv.stop()
    filler = tmpfs / "filler"
    _fill(filler)
    srv.start(ready=False)
    try:
        with httpx.Client(base_url=srv.http_url, timeout=20) as c:
            ready = c.get("/readyz")
            assert ready.status_code == 503 and "full" in ready.json()["reason"], ready.text
            assert c.get("/v1/steps/kept").json()["state"] == "planned"  # reads of acknowledged steps
            assert c.get("/v1/steps/kept/ranks/1/plan").content == slice_.content
            r = c.post("/v1/steps", json=rollout_doc("new", seed=1))
            assert r.status_code == 503
            filler.unlink()
            assert _until(lambda: c.get("/readyz").status_code == 200, 10)
            assert c.post("/v1/steps", json=rollout_doc("new", seed=1)).status_code == 200
    finally:
        srv.stop()
    assert "Traceback" not in srv.log_text()


def test_deleting_frees_a_full_disk(tmpfs):
    """The audit: on a full disk DELETE answered 503 (8 of 8) and retention was blocked the same
    way (test_service_core covers retention). A deletion needs no disk space (freed pages are not
    overwritten, the WAL keeps blocks for its frames), and compaction gives the space back, so the
    service becomes ready again."""
    import shutil

    db = tmpfs / "free.db"
    srv = ServerProcess(db, extra=["--min-free-mb", "0.5"], log_path=tmpfs.parent / "free.log").start()
    try:
        with httpx.Client(base_url=srv.http_url, timeout=60) as c:
            for i in range(4):  # about 750 KB each as stored (compressed)
                doc = rollout_doc(f"f{i}", seed=i, trajectories=2000, vocab=65536)
                assert c.post("/v1/steps", json=doc).status_code == 200
            filler = tmpfs / "filler"
            _fill(filler)  # not a byte left: SQLite itself could not grow a file now
            assert shutil.disk_usage(tmpfs).free < 64 << 10
            assert _until(lambda: c.get("/readyz").status_code == 503)
            r = c.delete("/v1/steps/f0")
            assert r.status_code == 200 and r.json()["step_id"] == "f0", r.text
            r = c.delete("/v1/steps/f1")
            assert r.status_code == 200, r.text
            # compaction returns the pages: more than the reserve is free again, and the service is ready
            assert _until(lambda: shutil.disk_usage(tmpfs).free > 1 << 20, 20), shutil.disk_usage(tmpfs)
            assert _until(lambda: c.get("/readyz").status_code == 200, 20)
            assert {s["step_id"] for s in c.get("/v1/steps").json()["steps"]} == {"f2", "f3"}
    finally:
        srv.stop()
    assert "Traceback" not in srv.log_text()
