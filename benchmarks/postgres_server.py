"""A throwaway PostgreSQL server for the shared store (`planner_service.store.postgres`): replica tests and benchmarks.

    with PostgresServer(find_binaries()) as server:     # initdb + pg_ctl in a temporary folder
        url = server.url                                 # postgresql://harts@127.0.0.1:<port>/harts

It runs `initdb` and `pg_ctl` from the Debian package (`apt-get install postgresql`) on a free
loopback port, with trust authentication for the `harts` user. PostgreSQL refuses to run as root:
as root the server runs as the package's `postgres` user (or `nobody`).
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["PostgresServer", "find_binaries"]


def find_binaries() -> Path | None:
    """The folder holding initdb and pg_ctl (PATH first, then Debian's versioned folders)."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(f"{folder}/pg_ctl") and os.path.exists(f"{folder}/initdb"):
            return Path(folder)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """initdb + pg_ctl start in a temporary folder; `url` is the connection URL of database `harts`.

    Args:
        bin_dir: folder of initdb and pg_ctl.
    """

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="harts-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.url = f"postgresql://harts@127.0.0.1:{self.port}/harts"
        self._user = None
        if os.geteuid() == 0:
            name = "postgres" if _user_exists("postgres") else "nobody"
            self._user = name
            os.chown(self.root, pwd.getpwnam(name).pw_uid, pwd.getpwnam(name).pw_gid)

    def _run(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin_dir / args[0]), *args[1:]], capture_output=True, text=True,
                              timeout=timeout, user=self._user, cwd=self.root)

    def start(self) -> "PostgresServer":
        out = self._run("initdb", "-D", str(self.data), "-U", "harts", "--auth=trust", "-E", "UTF8", "--no-sync")
        if out.returncode:
            raise RuntimeError(f"initdb failed:\n{out.stdout}\n{out.stderr}")
        # fsync off: a test server (durability across replicas is what the tests check, not power loss)
        self.resume()
        import psycopg  # optional: the PostgreSQL driver comes with the planner extra only

        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(f"postgresql://harts@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
                    conn.execute("CREATE DATABASE harts")
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def pause(self) -> None:
        """Stop the server, keeping its data (`resume` starts it again on the same port)."""
        out = self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", timeout=60)
        if out.returncode:
            raise RuntimeError(f"pg_ctl stop failed:\n{out.stdout}\n{out.stderr}")

    def resume(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
        out = self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "server.log"), "-w", "start")
        if out.returncode:
            raise RuntimeError(f"pg_ctl start failed:\n{out.stdout}\n{out.stderr}\n{self.log_text()}")

    def log_text(self) -> str:
        try:
            return (self.root / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop", timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "PostgresServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
