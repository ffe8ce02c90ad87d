"""core.locks: one lock for singleton jobs, a PostgreSQL advisory lock on a connection of its own (and a file
lock on other databases), checked from a second connection as another process would see it."""
import threading

import pytest
from django.db import connection, connections

from core import locks
from core.locks import advisory_lock, file_lock, lock_key
from provisioning.services.maintenance import singleton


def held_elsewhere(name: str) -> bool:
    """Whether another session (a second connection: another worker) finds `name` taken."""
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [lock_key(name)])
            got = cursor.fetchone()[0]
            if got:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [lock_key(name)])
        return not got
    finally:
        other.close()


def in_thread(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join(10)
    return result[0]


def test_the_key_is_a_stable_signed_64_bit_hash_of_the_name():
    assert lock_key("nodes_health_check") == lock_key("nodes_health_check")
    assert lock_key("a") != lock_key("b")
    for name in ("a", "b", "singleton:nodes_reconcile", "billing.usage_meter", "é" * 300):
        assert -(2**63) <= lock_key(name) < 2**63
    assert lock_key("billing.usage_meter") == 487794153883850367  # the same in every process and release


@pytest.mark.django_db
def test_a_second_connection_does_not_acquire_while_the_first_holds_and_does_after():
    with advisory_lock("job-a") as first:
        assert first is True
        assert held_elsewhere("job-a")
        assert in_thread(lambda: _try("job-a")) is False  # another worker's attempt
        with advisory_lock("job-a") as again:  # the same process, another block: its own session too
            assert again is False
        with advisory_lock("job-b") as other_name:
            assert other_name is True
    assert not held_elsewhere("job-a")
    assert in_thread(lambda: _try("job-a")) is True


def _try(name):
    try:
        with advisory_lock(name) as acquired:
            return acquired
    finally:
        connection.close()


@pytest.mark.django_db
def test_the_lock_is_released_when_the_block_raises():
    with pytest.raises(RuntimeError), advisory_lock("job-c") as acquired:
        assert acquired
        raise RuntimeError("the job crashed")
    assert not held_elsewhere("job-c")


@pytest.mark.django_db(transaction=True)
def test_the_lock_outlives_the_callers_own_connection_being_closed():
    """A long loop may close its connection (close_old_connections, CONN_MAX_AGE): the lock must stay held."""
    with advisory_lock("job-d") as acquired:
        assert acquired
        connection.close()
        assert held_elsewhere("job-d")
    assert not held_elsewhere("job-d")


@pytest.mark.django_db(transaction=True)
def test_a_holder_whose_connection_dies_leaves_no_lock_behind():
    """A worker killed mid-job: PostgreSQL ends its session, and with it the lock (no TTL to wait out)."""
    seen = {}

    def holder():
        with advisory_lock("job-e") as acquired:
            seen["acquired"] = acquired
            with connection.cursor() as cursor:  # find the lock's own backend and kill it, as a SIGKILL would
                cursor.execute("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = %s"
                               " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                               [lock_key("job-e") & 0xFFFF_FFFF])
                pids = [row[0] for row in cursor.fetchall()]
                for pid in pids:
                    # Without a timeout it only sends SIGTERM and returns before the backend has exited (CI once
                    # found the lock still held); with one it waits until the backend is gone (PostgreSQL 14+).
                    cursor.execute("SELECT pg_terminate_backend(%s, 10000)", [pid])
                    seen["terminated"] = cursor.fetchone()[0]
            seen["pids"] = pids
            seen["held_after_kill"] = held_elsewhere("job-e")
        connection.close()

    thread = threading.Thread(target=holder)
    thread.start()
    thread.join(20)
    assert seen["acquired"] and len(seen["pids"]) == 1 and seen["terminated"] is True
    assert seen["held_after_kill"] is False
    with advisory_lock("job-e") as acquired:
        assert acquired


@pytest.mark.django_db
def test_singleton_jobs_use_it():
    with singleton("nodes_reconcile", ttl=600) as first:
        assert first and held_elsewhere("singleton:nodes_reconcile")
        with singleton("nodes_reconcile", ttl=600) as second:
            assert second is False
    assert not held_elsewhere("singleton:nodes_reconcile")


def test_without_postgresql_a_file_lock_stands_in(settings, tmp_path, monkeypatch):
    settings.VAR_DIR = tmp_path
    with file_lock("nodes_health_check") as first:
        assert first is True
        with file_lock("nodes_health_check") as second:
            assert second is False
        with file_lock("nodes_reconcile") as other:
            assert other is True
    with file_lock("nodes_health_check") as again:
        assert again is True
    assert list((tmp_path / "locks").iterdir())
    # advisory_lock picks it on a database that has no advisory locks (the SQLite first run).
    monkeypatch.setattr(locks, "connections", {"default": type("Db", (), {"vendor": "sqlite"})()})
    with advisory_lock("x") as outer, advisory_lock("x") as inner:
        assert (outer, inner) == (True, False)
