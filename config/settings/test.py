"""The test suite: the real PostgreSQL and Redis of this machine, never SQLite."""
import os
from urllib.parse import urlsplit

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpumarket")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/14")
os.environ.setdefault("CACHE_URL", "redis://127.0.0.1:6379/15")
# pytest-xdist (`make test` runs `pytest -n`): each worker process has its own test database (pytest-django adds
# _gwN to its name) and must have its own Redis databases too, since the tests flush them (the cache before every
# test, the broker when the suite's Celery worker starts). gw0 keeps the two above; gwN (N >= 1) takes the Nth
# pair (broker, cache) of TEST_XDIST_REDIS_DBS. Done once per worker and written to the environment, so that the
# processes the tests start (Celery workers, which inherit it) keep what they are given. Databases 0 and 1 stay the
# README's `make demo` (broker 0, cache 1), so a demo beside the suite shares nothing with it.
_xdist_worker = os.environ.get("PYTEST_XDIST_WORKER") or "gw0"
if _xdist_worker != "gw0" and os.environ.get("TEST_XDIST_REDIS_FOR") != _xdist_worker:
    _n = int(_xdist_worker.removeprefix("gw"))
    _dbs = os.environ.get("TEST_XDIST_REDIS_DBS", "12,13,10,11,8,9,6,7,4,5,2,3").split(",")
    if len(_dbs) < 2 * _n:
        raise RuntimeError(f"pytest-xdist worker {_xdist_worker} has no Redis databases: TEST_XDIST_REDIS_DBS "
                           f"lists {len(_dbs) // 2} pairs (broker,cache) for the workers after gw0")
    for _name, _db in (("CELERY_BROKER_URL", _dbs[2 * _n - 2]), ("CACHE_URL", _dbs[2 * _n - 1])):
        os.environ[_name] = urlsplit(os.environ[_name])._replace(path="/" + _db.strip()).geturl()
    os.environ["TEST_XDIST_REDIS_FOR"] = _xdist_worker
# Retries of unreachable nodes, shortened so that fault tests end in seconds.
os.environ.setdefault("NODE_TASK_RETRY_BACKOFF_S", "0.5,0.5,0.5")
os.environ.setdefault("NODE_CONNECT_BACKOFF_S", "0.2")
os.environ.setdefault("STRIPE_MAX_NETWORK_RETRIES", "0")
# The renting tests book without a balance; tests/billing turns the funds check on.
os.environ.setdefault("BILLING_REQUIRE_FUNDS", "0")
# Webhook endpoints in the tests are local HTTP servers; their retries come after a second.
os.environ.setdefault("NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK", "1")
# The tests' GPU servers are sim nodes (sshd on loopback with the sim agent).
os.environ.setdefault("SIM_NODES_ALLOWED", "1")
# Nodes on loopback (those sshds), and in 10.0.0.0/8, where tests/factories.py registers the nodes no test's sshd
# is behind (a connection to one fails as an unreachable server's). The refusals have their own tests, which set
# it empty.
os.environ.setdefault("NODE_ADDRESS_ALLOWED_NETWORKS", "127.0.0.0/8,::1/128,10.0.0.0/8")
# Fixtures register dozens of servers for one provider that never see a first contact; the cap's own tests
# (tests/marketplace/test_round54_node_registration.py) set NODE_PENDING_MAX themselves.
os.environ.setdefault("NODE_PENDING_MAX", "1000")
os.environ.setdefault("NOTIFICATIONS_WEBHOOK_BACKOFF_S", "0.5")
os.environ.setdefault("NOTIFICATIONS_WEBHOOK_TIMEOUT_S", "3")
# Lost workers noticed in seconds, not the production minute: the worker-kill tests wait for exactly this.
os.environ.setdefault("JOB_HEARTBEAT_INTERVAL_S", "2")
os.environ.setdefault("JOB_HEARTBEAT_STALE_S", "10")
os.environ.setdefault("JOB_DISPATCH_INTERVAL_S", "3")
os.environ.setdefault("BENCHMARK_QUICK", "1")  # the benchmark's quick mode (sim nodes answer at once anyway)
# Jobs are sent on commit in the request's thread, so that a test sees the row's send fields at once; the
# sender thread and the relay have their own tests (tests/provisioning/test_job_outbox.py, test_job_relay.py).
os.environ.setdefault("JOB_SEND_IN_BACKGROUND", "0")
os.environ.setdefault("JOB_RELAY", "0")

from .base import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # speed only; tests only
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
STORAGES["staticfiles"] = {  # noqa: F405
    "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
}
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # noqa: F405 (whitenoise warns when it is missing)
