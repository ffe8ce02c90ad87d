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

from billing.models import Entry, LedgerTransaction, Payout, Refund, TopUp
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
    "billing.view_payout": ["1 payout pending", "$42.50", "key does not have the required permissions"],
    "billing.view_refund": ["1 refund pending", "$15.00", "Outcome unknown: no answer"],
    "billing.view_topup": ["1 top-up not known charged or not", "$7.00", "pi_waiting"],
}
WAITING = ("billing.view_payout", "billing.view_refund", "billing.view_topup")


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
    _money_waiting_on_stripe(UserFactory(), since=timezone.now() - timedelta(hours=2))


def _money_waiting_on_stripe(provider: User, since, payout_usd_micros=42_500_000) -> None:
    """A payout whose transfer lookup Stripe refuses, a refund whose answer was lost, a top-up still processing:
    each past the follow-up's delay."""
    from billing.models import AccountKind, Payout, Refund, TopUp
    from billing.services.ledger import ledger_post, platform_account, user_account
    from billing.services.top_ups import top_up_credit

    txn, _ = ledger_post(idempotency_key=f"payout:{provider.pk}:test", kind="payout", lines=[
        (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), -payout_usd_micros),
        (platform_account(kind=AccountKind.PAYOUT_CLEARING), payout_usd_micros)])
    Payout.objects.create(provider=provider, period_start=since.date(), period_end=since.date(), attempts=1,
                          amount_micros=payout_usd_micros, destination="acct_1Test", transaction=txn, created_at=since,
                          failure_message="The provided key does not have the required permissions for this endpoint.")
    renter = UserFactory()
    paid = TopUp.objects.create(user=renter, amount_micros=40_000_000, status="processing", payment_intent_id="pi_paid")
    assert top_up_credit(top_up_id=paid.pk, payment_intent_id="pi_paid", amount_micros=40_000_000)
    Refund.objects.create(top_up=paid, amount_micros=15_000_000, reason="asked", created_by=UserFactory(),
                          created_at=since, failure_message="Outcome unknown: no answer")
    TopUp.objects.create(user=renter, amount_micros=7_000_000, status="processing", payment_intent_id="pi_waiting",
                         created_at=since)


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
                                         LedgerTransaction, Payout, Refund, TopUp)]
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


def test_money_waiting_on_stripe_is_shown_only_past_the_follow_ups_delay_and_linked_to_its_rows(fleet):
    """A payout whose transfer lookup Stripe keeps refusing stayed pending with nothing to tell an operator but a
    warning in the worker's log every minute: the dashboard lists what still waits on Stripe, and why."""
    page = dashboard(staff(*WAITING))
    payout, refund, top_up = Payout.objects.get(), Refund.objects.get(status="pending"), TopUp.objects.get(
        status="processing")
    assert "Money waiting on Stripe" in page
    for url in (f"/admin/billing/payout/{payout.pk}/change/", f"/admin/billing/refund/{refund.pk}/change/",
                f"/admin/billing/topup/{top_up.pk}/change/",
                "/admin/billing/payout/?status__exact=pending&amp;held=no"):
        assert url in page
    # The top-ups' link opens the waiting ones only (its filter is the dashboard's rule).
    assert "/admin/billing/topup/?stripe=waiting" in page
    listed = logged_in(staff(*WAITING)).get("/admin/billing/topup/?stripe=waiting").content.decode()
    assert "pi_waiting" in listed and "pi_paid" not in listed
    # Younger than the follow-up's delay: its answer may still come; nothing to look into yet.
    for model in (Payout, Refund, TopUp):
        model.objects.update(created_at=timezone.now())
    page = dashboard(staff(*WAITING))
    assert "Money waiting on Stripe" not in page and "1 payout pending" not in page


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
