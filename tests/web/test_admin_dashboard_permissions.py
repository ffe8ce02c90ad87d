"""The operators' dashboard (/admin/) and the metrics page show each part only to the holders of the view permission
of the records it is made of: found by review, any staff account, with no permission at all, read the platform's
revenue, providers' e-mail addresses and rejected and offline nodes' error text on the dashboard."""
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import Entry, LedgerTransaction
from marketplace.models import Gpu, Instance, Node, NodeState, User, Verdict
from provisioning.models import Job, NodeEvent, VerificationRun
from tests.factories import UserFactory, make_listed_node, make_node
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import _usage_txn

pytestmark = pytest.mark.django_db

PROVIDER = "secret-provider@example.com"
# What each part shows, found on the page only by the holders of its permission.
SHOWN_BY = {
    "billing.view_ledgertransaction": ["Charged to renters", "$12.34"],
    "marketplace.view_node": [PROVIDER, "SM count wrong on GPU 0", "stopped answering at 03:00", "nodes offline",
                              "Nodes by state"],
    "marketplace.view_gpu": ["GPUs free to book", "GPUs by model"],
    "marketplace.view_instance": ["instances running"],
    "provisioning.view_job": ["benchmarking GPU 0", "stuck jobs", "jobs failed by the platform"],
    "provisioning.view_nodeevent": ["host key changed on the node"],
    "provisioning.view_verificationrun": ["rejections in 7 days"],
}


@pytest.fixture
def fleet():
    provider = UserFactory(email=PROVIDER)
    rejected = make_node(provider, name="fake-a100", gpu_count=2, state=NodeState.REJECTED,
                         verdict=Verdict.REJECTED)
    offline = make_listed_node(provider, name="gone-a100", gpu_count=1)
    Node.objects.filter(pk=rejected.pk).update(last_error="SM count wrong on GPU 0")
    Node.objects.filter(pk=offline.pk).update(state=NodeState.OFFLINE, last_error="stopped answering at 03:00")
    VerificationRun.objects.create(node=rejected, verdict="rejected", findings=[], figures={}, score=0)
    Job.objects.create(kind="node_verify", node=rejected, status="running", step="benchmarking GPU 0",
                       deadline=timezone.now() - timedelta(minutes=5))
    NodeEvent.objects.create(node=rejected, level="critical", kind="host_key_changed",
                             message="host key changed on the node")
    _usage_txn("today", UserFactory(), provider, 12_340_000, 1_851_000, timezone.now() - timedelta(microseconds=1))


def staff(*perms: str) -> User:
    user = UserFactory(is_staff=True)
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app, codename=codename))
    return User.objects.get(pk=user.pk)


def dashboard(user: User) -> str:
    response = logged_in(user).get("/admin/")
    assert response.status_code == 200
    return response.content.decode()


def test_a_staff_account_without_permissions_reads_none_of_the_fleet_and_nothing_is_computed(fleet):
    client = logged_in(staff())
    with CaptureQueriesContext(connection) as queries:
        page = client.get("/admin/").content.decode()
    for marker in sum(SHOWN_BY.values(), []):
        assert marker not in page, f"a staff account with no permission reads {marker!r}"
    tables = [m._meta.db_table for m in (Node, Gpu, Instance, Job, NodeEvent, VerificationRun, Entry,
                                         LedgerTransaction)]
    read = [q["sql"] for q in queries.captured_queries if any(f'"{t}"' in q["sql"] for t in tables)]
    assert read == [], "the dashboard computed figures it does not show"
    assert "may view none of the fleet's records" in page


@pytest.mark.parametrize("perm", list(SHOWN_BY))
def test_each_part_is_shown_to_the_holders_of_its_view_permission_only(fleet, perm):
    page = dashboard(staff(perm))
    for marker in SHOWN_BY[perm]:
        assert marker in page, f"{perm} does not show {marker!r}"
    for other, markers in SHOWN_BY.items():
        if other != perm:
            for marker in markers:
                assert marker not in page, f"{perm} alone shows {marker!r} (needs {other})"


def test_a_part_not_shown_is_not_computed(fleet):
    """Only the ledger: no query on nodes, jobs or events."""
    client = logged_in(staff("billing.view_ledgertransaction"))
    with CaptureQueriesContext(connection) as queries:
        client.get("/admin/")
    tables = [m._meta.db_table for m in (Node, Gpu, Instance, Job, NodeEvent, VerificationRun)]
    assert [q["sql"] for q in queries.captured_queries if any(f'"{t}"' in q["sql"] for t in tables)] == []


def test_a_superuser_reads_every_part(fleet):
    page = dashboard(UserFactory(is_staff=True, is_superuser=True))
    for marker in sum(SHOWN_BY.values(), []):
        assert marker in page


METRICS_PERMISSIONS = ["marketplace.view_node", "marketplace.view_instance", "provisioning.view_job",
                       "billing.view_stripeevent"]


def test_the_metrics_page_needs_the_view_permissions_of_what_it_counts(settings):
    """The same cause on /metrics: nodes by state, open jobs, Stripe events were read by any staff session."""
    settings.METRICS_TOKEN = ""
    refused = logged_in(staff(*METRICS_PERMISSIONS[:-1])).get("/metrics")
    assert refused.status_code == 403
    assert "billing.view_stripeevent" in refused.content.decode()  # names what is missing
    assert "gpumarket_nodes" not in refused.content.decode()
    assert logged_in(staff()).get("/metrics").status_code == 403
    allowed = logged_in(staff(*METRICS_PERMISSIONS)).get("/metrics")
    assert allowed.status_code == 200 and "gpumarket_nodes" in allowed.content.decode()
    assert Client().get("/metrics").status_code == 404  # no session, no token: as before
