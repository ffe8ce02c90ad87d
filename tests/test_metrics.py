"""GET /metrics (core/metrics.py, operations/metrics.py): who may read it, what it reports, what it costs."""
import os
import socket
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from billing.models import StripeEvent, StripeEventStatus
from billing.services.webhooks import stripe_event_process
from core import metrics
from marketplace.models import Instance, NodeState
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services.nodes import node_health_probe
from tests.billing.helpers import book, running
from tests.factories import UserFactory, make_listed_node, make_node

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "metrics-token-for-tests-0123456789"  # noqa: S105


@pytest.fixture(autouse=True)
def token(settings):
    settings.METRICS_TOKEN = TOKEN
    return TOKEN


@pytest.fixture(autouse=True)
def no_task_queue(monkeypatch):
    """Bookings queue their provisioning job on commit: recorded, not sent (no worker here)."""
    monkeypatch.setattr("core.dispatch.send", lambda name, *args, task_id=None: None)


def scrape(client=None, token=TOKEN):
    client = client or Client()
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    return response.content.decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(text: str, name: str, **labels) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


# ------------------------------------------------------------------------------------------- access


@pytest.mark.django_db
def test_anonymous_and_ordinary_users_get_a_404():
    assert Client().get("/metrics").status_code == 404
    user = Client()
    user.force_login(UserFactory())
    assert user.get("/metrics").status_code == 404


@pytest.mark.django_db
def test_a_wrong_or_unaccepted_bearer_token_gets_a_401(settings):
    answer = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer not-the-token")
    assert answer.status_code == 401 and answer["WWW-Authenticate"].startswith("Bearer")
    settings.METRICS_TOKEN = ""  # no token configured: no bearer token is accepted, staff sessions still are
    assert Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 401
    staff = Client()
    staff.force_login(UserFactory(is_staff=True, is_superuser=True))  # the view permissions of what it counts
    scrape(staff, token=None)


@pytest.mark.django_db
def test_the_token_or_a_staff_session_reads_the_page():
    assert "gpumarket_nodes" in scrape()
    staff = Client()
    staff.force_login(UserFactory(is_staff=True, is_superuser=True))  # the view permissions of what it counts
    assert "gpumarket_nodes" in scrape(staff, token=None)
    assert Client().post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405


# ------------------------------------------------------------------------------------------ content


@pytest.mark.django_db
def test_nodes_jobs_meter_lag_and_failed_webhooks_are_reported():
    make_listed_node(UserFactory())
    make_listed_node(UserFactory())
    offline = make_node(UserFactory(), state=NodeState.OFFLINE)
    renter = UserFactory()
    node = make_listed_node(UserFactory())
    instance = running(renter, node)
    # Running for 10 minutes, billed until 90 s ago: the oldest running time not metered is 90 s old.
    Instance.objects.filter(pk=instance.pk).update(started_at=timezone.now() - timedelta(seconds=600),
                                                   billed_until=timezone.now() - timedelta(seconds=90))
    old_job = Job.objects.create(kind=JobKind.NODE_VERIFY, node=offline, deadline=timezone.now() + timedelta(hours=1),
                                 created_at=timezone.now() - timedelta(seconds=300))
    Job.objects.create(kind=JobKind.NODE_VERIFY, node=make_node(UserFactory()), status=JobStatus.SUCCEEDED,
                       finished_at=timezone.now(), deadline=timezone.now())
    failing = StripeEvent.objects.create(event_id=f"evt_{uuid.uuid4().hex}", type="payment_intent.succeeded",
                                         payload={"data": {"object": "not an object"}})
    failures_before = value(scrape(), "gpumarket_webhook_failures_total", type="payment_intent.succeeded") or 0
    assert stripe_event_process(event_id=failing.pk).status == StripeEventStatus.FAILED

    text = scrape()
    assert value(text, "gpumarket_nodes", state="active") == 3
    assert value(text, "gpumarket_nodes", state="offline") == 1
    assert value(text, "gpumarket_nodes", state="rejected") == 0  # every state, zeros included
    assert value(text, "gpumarket_instances_running") == 1
    assert 90 <= value(text, "gpumarket_meter_lag_seconds") < 150
    assert value(text, "gpumarket_jobs_open", kind="node_verify", status="queued") == 1  # finished jobs: not
    assert 300 <= value(text, "gpumarket_jobs_open_oldest_age_seconds", kind="node_verify", status="queued") < 400
    assert value(text, "gpumarket_stripe_events_unprocessed", status="failed") == 1
    assert value(text, "gpumarket_webhook_failures_total", type="payment_intent.succeeded") == failures_before + 1
    assert value(text, "gpumarket_scrape_error", collector="platform") == 0
    old_job.delete()


@pytest.mark.django_db
def test_the_meter_tick_age_comes_from_the_last_tick():
    metrics.record_meter_tick(at=timezone.now().timestamp() - 42)
    assert 42 <= value(scrape(), "gpumarket_meter_last_tick_age_seconds") < 60
    assert value(scrape(), "gpumarket_meter_lag_seconds") == 0  # nothing runs


@pytest.mark.django_db
def test_ssh_probes_and_bookings_are_observed_where_they_happen():
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nobody listens there: the probe fails at once
    node = make_node(UserFactory(), address="127.0.0.1", ssh_port=port)
    before = scrape()
    probes = value(before, "gpumarket_ssh_probe_seconds_count", outcome="failed") or 0
    bookings = value(before, "gpumarket_booking_seconds_count") or 0

    assert not node_health_probe(node).ok
    book(UserFactory(), make_listed_node(UserFactory()))

    after = scrape()
    assert value(after, "gpumarket_ssh_probe_seconds_count", outcome="failed") == probes + 1
    assert value(after, "gpumarket_booking_seconds_count") == bookings + 1


@pytest.mark.django_db
def test_queue_depth_is_the_length_of_each_queue_in_redis(settings):
    prefix = f"test-metrics-{uuid.uuid4().hex[:8]}:"
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS, "global_keyprefix": prefix}
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    try:
        client.lpush(f"{prefix}money", "a", "b", "c")
        client.lpush(f"{prefix}ssh\x06\x163", "d")  # a message at another priority step of the same queue
        text = scrape()
    finally:
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
    assert value(text, "gpumarket_queue_depth", queue="money") == 3
    assert value(text, "gpumarket_queue_depth", queue="ssh") == 1
    assert value(text, "gpumarket_queue_depth", queue="fleet") == 0


@pytest.mark.django_db
def test_a_failing_collector_is_reported_and_the_rest_still_served(monkeypatch):
    class Broken:
        def collect(self):
            raise RuntimeError("the database went away")

    monkeypatch.setitem(metrics._scrape_collectors, "broken", Broken())
    text = scrape()
    assert value(text, "gpumarket_scrape_error", collector="broken") == 1
    assert value(text, "gpumarket_scrape_error", collector="platform") == 0
    assert "gpumarket_nodes" in text


@pytest.mark.django_db
def test_the_page_costs_the_same_queries_with_more_rows():
    def queries():
        with CaptureQueriesContext(connection) as captured:
            scrape()
        return len(captured)

    make_listed_node(UserFactory())
    few = queries()
    renter = UserFactory()
    for _ in range(5):
        node = make_listed_node(UserFactory())
        running(renter, node)
        make_node(UserFactory(), state=NodeState.OFFLINE)
    assert queries() == few
    assert few <= 6  # the session/user lookups are not made for a bearer token: 4 aggregates, maybe a savepoint


# -------------------------------------------------------------------------------- multiprocess mode


def test_multiprocess_mode_adds_up_every_process_of_the_host(tmp_path):
    """Two processes observe, a third (as a gunicorn worker answering /metrics would) reports their sum."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "config.settings.test"}
    observe = ("import django; django.setup(); from core import metrics; "
               "metrics.BOOKING_SECONDS.observe(0.02); metrics.SSH_PROBE_SECONDS.labels(outcome='ok').observe(0.3)")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", observe], cwd=ROOT, env=env, check=True, timeout=60)
    files = sorted(p.name for p in tmp_path.glob("*.db"))
    assert files and all(f"{socket.gethostname()}-" in name for name in files), files  # host-pid: one per process
    report = subprocess.run([sys.executable, "-c", "import django; django.setup(); from core import metrics; "
                             "import sys; sys.stdout.write(metrics.exposition().decode())"],
                            cwd=ROOT, env=env, check=True, timeout=60, capture_output=True, text=True).stdout
    assert value(report, "gpumarket_booking_seconds_count") == 2
    assert value(report, "gpumarket_ssh_probe_seconds_count", outcome="ok") == 2
    assert value(report, "gpumarket_ssh_probe_seconds_sum", outcome="ok") == pytest.approx(0.6)
