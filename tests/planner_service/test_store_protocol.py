"""The store interface (`store.protocol.Store`) and the fault state machine both stores share
(`store.faults.FaultState`), and the layering of the service's packages."""
from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from planner_service.errors import StorageError
from planner_service.store import Store, open_store
from planner_service.store.faults import FaultState, Health
from planner_service.store.postgres import PostgresStore
from planner_service.store.sqlite import SQLiteStore

ROOT = Path(__file__).resolve().parents[2]


def _methods() -> dict[str, inspect.Signature]:
    """The Protocol's methods and their signatures."""
    return {name: inspect.signature(value) for name, value in vars(Store).items()
            if not name.startswith("_") and inspect.isfunction(value)}


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    """A store of each kind: SQLite in a temporary folder; PostgreSQL at a port nobody listens on
    (it opens faulted: the interface is there all the same)."""
    s = SQLiteStore(tmp_path / "p.db") if request.param == "sqlite" else PostgresStore("postgresql://127.0.0.1:9/none")
    yield s
    s.close()


def test_both_stores_implement_the_protocol_with_its_signatures(store):
    assert isinstance(store, Store)
    for name, sig in _methods().items():
        got = inspect.signature(getattr(type(store), name))
        assert got.parameters == sig.parameters, f"{type(store).__name__}.{name}{got} against {sig}"
    for name in ("fault", "short_of_space"):
        assert isinstance(getattr(type(store), name), property), f"{name} is read-only"
    for name, kind in (("path", str), ("shared", bool), ("min_free_bytes", int)):
        assert isinstance(getattr(store, name), kind), name


def test_open_store_answers_a_store(tmp_path):
    opened = open_store(str(tmp_path / "p.db"))
    try:
        assert isinstance(opened, SQLiteStore) and opened.fault is None
    finally:
        opened.close()


def _machine():
    told = []
    faults = FaultState(is_fault=lambda exc: isinstance(exc, OSError), describe=lambda exc, doing: f"{exc} {doing}")
    faults.on_change = told.append
    return faults, told


def test_fault_state_machine_refuses_writes_until_ready_again():
    faults, told = _machine()
    assert faults.health is Health.READY
    faults.check_write()
    with pytest.raises(StorageError, match="disk on fire while writing"):
        with faults.translating("while writing"):
            raise OSError("disk on fire")
    assert faults.health is Health.FAULTED and told == ["disk on fire while writing"]
    with pytest.raises(StorageError):
        faults.check_write(frees=True)  # a fault that is not only space refuses deletions too
    with pytest.raises(KeyError):
        with faults.translating("reading"):
            raise KeyError("a bug, not the storage")  # propagates unchanged
    faults.set(None)
    assert faults.health is Health.READY and told[-1] is None
    faults.check_write()


def test_short_of_space_lets_writes_that_free_space_through():
    faults, told = _machine()
    faults.set("disk full", space=True)
    assert faults.health is Health.SHORT_OF_SPACE and faults.short_of_space
    faults.check_write(frees=True)
    with pytest.raises(StorageError, match="disk full"):
        faults.check_write()
    err = faults.fail("too full for the plan", space=True, need=123)
    assert err.need == 123 and told == ["disk full", "too full for the plan"]


def test_lost_stays_until_a_restart():
    faults, told = _machine()
    faults.lose("the file was replaced")
    assert faults.health is Health.READY  # entered at the next check
    with pytest.raises(StorageError, match="replaced"):
        faults.check_lost()
    assert faults.health is Health.LOST and told == ["the file was replaced"]
    with pytest.raises(StorageError):
        faults.check_lost()  # every check again: nothing clears it


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


#: (package prefix, what it must not import): domain below transport, stores below the core
_LAYERS = [
    ("planner_service.core", ("planner_service.transport", "planner_service.server", "fastapi", "starlette", "grpc",
                              "grpc_health", "uvicorn", "pydantic", "h11")),
    ("planner_service.store", ("planner_service.core", "planner_service.transport", "planner_service.server")),
    ("planner_service.topology", ("planner_service.core", "planner_service.transport", "pydantic", "fastapi")),
    ("planner_service.transport", ("planner_service.server",)),
]


def test_the_core_knows_no_transport_and_the_stores_no_core():
    ig = _import_graph()
    graph = ig.scan(ROOT)
    bad = [imp.where() for imp in graph.imports for source, banned in _LAYERS
           if (imp.source == source or imp.source.startswith(source + "."))
           and any(imp.target == b or imp.target.startswith(b + ".") for b in banned)]
    assert not bad, "\n".join(bad)
