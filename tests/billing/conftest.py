"""Billing test fixtures: a real localstripe, a fake clock, jobs recorded instead of sent, and the ledger's
invariants asserted after every test that touched the database."""
from datetime import UTC, datetime, timedelta

import pytest
from celery import current_app

import notifications.tasks  # noqa: F401 (registers the tasks that no_task_queue runs)
from tests.billing.invariants import assert_billing_invariants
from tests.localstripe import WEBHOOK_SECRET


def _uses_db(request) -> bool:
    return bool(
        request.node.get_closest_marker("django_db")
        or {"db", "transactional_db", "live_server", "django_db_reset_sequences"} & set(request.fixturenames)
    )


@pytest.fixture(autouse=True)
def ledger_invariants(request):
    """After every billing test: the ledger balances, caches match, usage is contiguous and exact."""
    if not _uses_db(request):
        yield
        return
    transactional = {"transactional_db", "live_server"} & set(request.fixturenames)
    request.getfixturevalue("transactional_db" if transactional else "db")
    yield
    assert_billing_invariants()


@pytest.fixture(autouse=True)
def billing_settings(settings):
    settings.BILLING_REQUIRE_FUNDS = True
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    settings.STRIPE_MAX_NETWORK_RETRIES = 0
    settings.STRIPE_TIMEOUT_S = 5
    settings.PLATFORM_FEE_PERCENT = 15
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    # Nothing here may reach the real Stripe: tests that talk to Stripe use the `stripe` fixture.
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"
    settings.STRIPE_CONNECT_API_BASE = ""
    return settings


@pytest.fixture(autouse=True, name="sent_jobs")
def sent_jobs_fixture(monkeypatch):
    """Provisioning jobs handed to Celery on commit; recorded instead of sent (no worker runs here)."""
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    return sent


@pytest.fixture(autouse=True)
def no_task_queue(monkeypatch):
    """Billing tasks queued on commit (automatic top-ups) are recorded too; notifications' (e-mails, webhooks) are
    run at once, as the worker would, so that the e-mails they send land in Django's outbox."""
    queued = []

    def send(name, *args, task_id=None):
        queued.append((name.rsplit(".", 1)[-1], args))
        if name.startswith("notifications.tasks."):
            current_app.tasks[name].apply(args=args)

    monkeypatch.setattr("core.dispatch.send", send)
    return queued


class Clock:
    """timezone.now() under the test's control; advance() moves it."""

    def __init__(self, start: datetime):
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float = 0, **kwargs) -> datetime:
        self.now += timedelta(seconds=seconds, **kwargs)
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock(datetime(2026, 3, 2, 12, 0, 0, 250_000, tzinfo=UTC))  # a Monday, with a fraction of a second
    monkeypatch.setattr("django.utils.timezone.now", c)
    return c


# localstripe and stripe_webhooks: tests/localstripe.py (shared with tests/web), through tests/conftest.py.


@pytest.fixture
def refund_operator_api(operator_api):
    """A staff account's API client with the permission the refunds need (the admin's Refund action asks the same)."""
    from django.contrib.auth.models import Permission

    operator_api.user.user_permissions.add(Permission.objects.get(content_type__app_label="billing",
                                                                  codename="add_refund"))
    return operator_api
