"""The test suite: the real PostgreSQL and Redis of this machine, never SQLite."""
import os

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpumarket")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/14")
os.environ.setdefault("CACHE_URL", "redis://127.0.0.1:6379/15")
# Retries of unreachable nodes, shortened so that fault tests end in seconds.
os.environ.setdefault("NODE_TASK_RETRY_BACKOFF_S", "0.5,0.5,0.5")
os.environ.setdefault("NODE_CONNECT_BACKOFF_S", "0.2")
os.environ.setdefault("STRIPE_MAX_NETWORK_RETRIES", "0")
# The renting tests book without a balance; tests/billing turns the funds check on.
os.environ.setdefault("BILLING_REQUIRE_FUNDS", "0")
# Webhook endpoints in the tests are local HTTP servers; their retries come after a second.
os.environ.setdefault("NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK", "1")
os.environ.setdefault("NOTIFICATIONS_WEBHOOK_BACKOFF_S", "0.5")
os.environ.setdefault("NOTIFICATIONS_WEBHOOK_TIMEOUT_S", "3")
# Lost workers noticed in seconds, not the production minute: the worker-kill tests wait for exactly this.
os.environ.setdefault("JOB_HEARTBEAT_INTERVAL_S", "2")
os.environ.setdefault("JOB_HEARTBEAT_STALE_S", "10")
os.environ.setdefault("JOB_DISPATCH_INTERVAL_S", "3")
os.environ.setdefault("BENCHMARK_QUICK", "1")  # the benchmark's quick mode (sim nodes answer at once anyway)
# Jobs are sent on commit in the request's thread, so that a test sees the row's send fields at once; the
# sender thread has its own tests (tests/provisioning/test_job_outbox.py).
os.environ.setdefault("JOB_SEND_IN_BACKGROUND", "0")

from .base import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # speed only; tests only
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
STORAGES["staticfiles"] = {  # noqa: F405
    "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
}
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # noqa: F405 (whitenoise warns when it is missing)
