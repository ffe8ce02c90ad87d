"""config/settings/test.py under pytest-xdist: each worker process gets its own Redis databases, and the processes a
worker starts (its Celery workers, which inherit its environment) keep the ones they are given."""
import json

import pytest

from tests.test_settings import ROOT, run_python

SHOW = ["-c", "import json, os; import config.settings.test as s; "
              "print(json.dumps([s.CELERY_BROKER_URL, s.CACHE_URL, os.environ.get('TEST_XDIST_REDIS_FOR')]))"]
BASE = {"CELERY_BROKER_URL": "redis://127.0.0.1:6379/14", "CACHE_URL": "redis://:pw@127.0.0.1:6379/15?x=1"}


def settings_of(env, tmp_path):
    result = run_python(SHOW, {**BASE, **env}, tmp_path)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("worker", "expected"),
    [
        (None, ["redis://127.0.0.1:6379/14", "redis://:pw@127.0.0.1:6379/15?x=1", None]),  # no xdist
        ("gw0", ["redis://127.0.0.1:6379/14", "redis://:pw@127.0.0.1:6379/15?x=1", None]),
        ("gw1", ["redis://127.0.0.1:6379/10", "redis://:pw@127.0.0.1:6379/11?x=1", "gw1"]),
        ("gw2", ["redis://127.0.0.1:6379/4", "redis://:pw@127.0.0.1:6379/5?x=1", "gw2"]),
    ],
)
def test_each_xdist_worker_has_its_own_redis_databases(tmp_path, worker, expected):
    env = {"TEST_XDIST_REDIS_DBS": "10,11,4,5", **({"PYTEST_XDIST_WORKER": worker} if worker else {})}
    assert settings_of(env, tmp_path) == expected


def test_a_process_started_by_a_worker_keeps_the_broker_it_is_given(tmp_path):
    """A Celery worker started by gw1 inherits PYTEST_XDIST_WORKER and the marker: a broker URL the test chose (a
    private Redis) is not moved to gw1's database."""
    env = {"PYTEST_XDIST_WORKER": "gw1", "TEST_XDIST_REDIS_FOR": "gw1", "TEST_XDIST_REDIS_DBS": "10,11",
           "CELERY_BROKER_URL": "redis://127.0.0.1:41234/0"}
    assert settings_of(env, tmp_path)[0] == "redis://127.0.0.1:41234/0"


def test_a_worker_without_databases_is_refused_by_name(tmp_path):
    result = run_python(SHOW, {**BASE, "PYTEST_XDIST_WORKER": "gw2", "TEST_XDIST_REDIS_DBS": "10,11"}, tmp_path)
    assert result.returncode != 0
    assert "pytest-xdist worker gw2 has no Redis databases: TEST_XDIST_REDIS_DBS" in result.stderr


def test_the_default_gives_each_of_make_tests_workers_databases_of_its_own(tmp_path):
    """`make test` runs seven workers (PYTEST_XDIST in the Makefile): with no TEST_XDIST_REDIS_DBS each gets its own
    broker and cache databases (before, gw3 and gw4 had none and the run stopped at collection), none of them the
    README's demo's (0 and 1)."""
    import re
    workers = int(re.search(r"^PYTEST_XDIST \?= -n (\d+)", (ROOT / "Makefile").read_text(), re.M).group(1))
    seen = [settings_of({"PYTEST_XDIST_WORKER": f"gw{n}"}, tmp_path)[:2] for n in range(workers)]
    databases = [url.split("?")[0].rsplit("/", 1)[1] for pair in seen for url in pair]
    assert workers >= 5 and len(set(databases)) == 2 * workers and not {"0", "1"} & set(databases)
