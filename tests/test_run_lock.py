"""tests/run_lock.py: a second test run on the same PostgreSQL and Redis waits for the first, and says for whom."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import run_lock

ROOT = Path(__file__).resolve().parent.parent
HOLD = ("import sys, time; from tests.run_lock import acquire; "
        "h = acquire(sys.argv[1], wait_s=0, say=print); print('held', flush=True); time.sleep(float(sys.argv[2]))")


def holder(path, seconds):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(seconds)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_is_told_whom_it_waits_for_and_stops_after_its_wait(tmp_path):
    path, said = tmp_path / "run.lock", []
    proc = holder(path, 60)
    try:
        with pytest.raises(run_lock.RunLockTimeout) as refused:
            run_lock.acquire(str(path), wait_s=0.5, say=said.append)
    finally:
        proc.kill()
        proc.wait()
    assert f"pid {proc.pid}" in str(refused.value)
    assert "TEST_RUN_LOCK_WAIT_S" in str(refused.value)
    assert len(said) == 1 and said[0].startswith("waiting for another test run") and f"pid {proc.pid}" in said[0]


def test_a_waiting_run_goes_on_once_the_first_ends(tmp_path):
    path, said = tmp_path / "run.lock", []
    proc = holder(path, 1)
    handle = run_lock.acquire(str(path), wait_s=30, say=said.append)
    try:
        assert proc.wait(timeout=5) == 0
        assert said and f"pid {proc.pid}" in said[0]
        assert path.read_text().startswith(f"pid {os.getpid()},")  # the new holder's name, the old one's gone
    finally:
        handle.close()


def test_a_killed_run_does_not_block_the_next(tmp_path):
    path = tmp_path / "run.lock"
    proc = holder(path, 60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    said = []
    run_lock.acquire(str(path), wait_s=5, say=said.append).close()
    assert said == []


def test_runs_against_other_servers_do_not_wait_for_each_other(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # two shells with different TMPDIRs still share the lock
    db = {"HOST": "127.0.0.1", "PORT": "5432"}
    same = run_lock.lock_path(db, "redis://127.0.0.1:6379/14")
    assert same.startswith("/tmp/gpumarket-test-run-")
    assert run_lock.lock_path(dict(db), "redis://127.0.0.1:6379/12") == same  # another database, the same server
    assert run_lock.lock_path(db, "redis://127.0.0.1:41234/0") != same
    assert run_lock.lock_path({"HOST": "127.0.0.1", "PORT": "55432"}, "redis://127.0.0.1:6379/14") != same


def test_this_suite_holds_the_lock_so_a_second_pytest_is_turned_away_by_name():
    """The hook in tests/conftest.py is what takes the lock: a pytest started now, on the same servers, is refused
    (after a 1-second wait) with the holder named, and runs no test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TEST_XDIST"))}
    env["TEST_RUN_LOCK_WAIT_S"] = "1"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             f"{__file__}::test_runs_against_other_servers_do_not_wait_for_each_other"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "another test run uses the same PostgreSQL and Redis (pid " in result.stderr
    assert "passed" not in result.stdout


def test_collecting_does_not_wait_for_the_run_that_holds_the_lock():
    """`make test` collects beside mypy to warm pytest's caches (the Makefile's PYTEST_WARM): collecting creates
    nothing on the servers, so it goes on while this suite holds the lock, and lists the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TEST_XDIST"))}
    env["TEST_RUN_LOCK_WAIT_S"] = "1"
    target = f"{__file__}::test_runs_against_other_servers_do_not_wait_for_each_other"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             "--collect-only", target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == pytest.ExitCode.OK, result.stdout + result.stderr
    assert "another test run" not in result.stderr and "1 test collected" in result.stdout


def test_a_wait_that_is_not_a_number_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("TEST_RUN_LOCK_WAIT_S", "soon")
    with pytest.raises(run_lock.RunLockTimeout, match="TEST_RUN_LOCK_WAIT_S must be a number of seconds, not 'soon'"):
        run_lock.wait_s_from_environment()
