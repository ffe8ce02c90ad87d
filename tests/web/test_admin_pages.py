"""The operators' panel: the dashboard on the admin index, list filters and actions, readable reasons."""
from datetime import timedelta
from html.parser import HTMLParser

import pytest
from django.utils import timezone

from marketplace.models import Gpu, GpuStatus, Node, NodeState, Verdict
from provisioning.models import Job, NodeEvent, VerificationRun
from tests.factories import make_listed_node, make_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import fund, logged_in
from tests.web.test_provider_pages import FIGURES, FINDINGS

pytestmark = pytest.mark.django_db


@pytest.fixture
def ops(operator):
    return logged_in(operator)


@pytest.fixture
def fleet(renter, stranger):
    listed = make_listed_node(stranger, name="fra-a100", gpu_model="a100-80gb-sxm", gpu_count=4)
    book(renter, listed, num_gpus=3)
    make_listed_node(stranger, name="ams-a6000", gpu_model="rtx-a6000", gpu_count=8)
    rejected = make_node(stranger, name="fake-a100", gpu_model="a100-80gb-sxm", gpu_count=2,
                         state=NodeState.REJECTED, verdict=Verdict.REJECTED)
    Node.objects.filter(pk=rejected.pk).update(
        last_error="Rejected: GPU 0 has 84 streaming multiprocessors; a A100 80GB SXM has 108.")
    VerificationRun.objects.create(node=rejected, verdict="rejected", findings=FINDINGS, figures=FIGURES, score=0)
    stuck = Job.objects.create(kind="node_verify", node=rejected, status="running", step="benchmarking GPU 0",
                               deadline=timezone.now() - timedelta(minutes=5))
    NodeEvent.objects.create(node=rejected, level="critical", kind="host_key_changed", message="key changed")
    return {"listed": listed, "rejected": rejected, "stuck": stuck}


def test_only_staff_reach_the_dashboard(client, web):
    assert client.get("/admin/").status_code == 302
    assert web.get("/admin/").status_code == 302  # a renter is not staff


def test_dashboard_shows_fleet_figures_and_charts(ops, fleet):
    page = ops.get("/admin/").content.decode()
    assert "Fleet" in page and page.count('<svg class="chart"') == 2
    assert "Nodes by state" in page and "GPUs by model" in page
    # The stacked chart's description: the rejected node's idle GPUs are not "free" (no renter can book them).
    assert "A100 80GB SXM: 3 rented, 1 free, 0 split into MIG slices, 2 not offered, 0 unavailable" in page
    assert 'id="gpus-free">9<' in page and 'id="gpus-not-offered">2<' in page
    assert ">3</span><span class=\"fleet-label\">GPUs rented" in page
    assert "fake-a100" in page and "84 streaming multiprocessors" in page  # rejected nodes and why
    assert f"/admin/provisioning/job/{fleet['stuck'].pk}/change/" in page and "benchmarking GPU 0" in page
    assert "key changed" in page
    assert "Everything by model" in page and "/admin/marketplace/node/" in page  # the app list stays


def test_stuck_jobs_filter(ops, fleet):
    Job.objects.create(kind="node_verify", node=fleet["listed"], status="running",
                       deadline=timezone.now() + timedelta(minutes=5))
    page = ops.get("/admin/provisioning/job/?stuck=yes").content.decode()
    assert f"/admin/provisioning/job/{fleet['stuck'].pk}/change/" in page
    assert page.count("/change/") == 1


def test_operator_finds_a_rejected_node_and_its_reasons(ops, fleet):
    listing = ops.get("/admin/marketplace/node/?verdict__exact=rejected").content.decode()
    assert "fake-a100" in listing and "fra-a100" not in listing
    page = ops.get(f"/admin/marketplace/node/{fleet['rejected'].pk}/change/").content.decode()
    assert "84 streaming multiprocessors" in page and "<code>bf16_low</code>" in page and "GPU 1 reaches" in page
    # Stored before the articles were mended, said right in the findings (the raw last_error field keeps its text).
    assert "an A100 80GB SXM has 108" in page and "the 312 a A100" not in page and "the 312 an A100" in page
    assert "ssh_private_key" not in page and "PRIVATE KEY" not in page
    run = VerificationRun.objects.get(node=fleet["rejected"])
    detail = ops.get(f"/admin/provisioning/verificationrun/{run.pk}/change/").content.decode()
    assert "<code>sm_count</code>" in detail
    # what the platform measured itself (FIGURES' challenge: an A6000's speed, the memory held), readable
    assert "What the platform measured itself" in detail or "what the platform measured itself" in detail
    assert "<tr><th>GPU 0</th><td>127.3</td><td>41 %</td><td>right</td><td>0.097 s</td><td>yes</td></tr>" in detail
    assert "Memory proof: 76.0 GiB per GPU, re-read due within 0.176 s" in detail


def test_node_and_instance_actions_are_there(ops, fleet):
    nodes = ops.get("/admin/marketplace/node/").content.decode()
    for action in ("reverify_nodes", "set_maintenance", "unlist", "accept_new_host_key"):
        assert f'value="{action}"' in nodes
    instances = ops.get("/admin/marketplace/instance/").content.decode()
    for action in ("force_stop", "force_destroy"):
        assert f'value="{action}"' in instances


def test_reverify_action_queues_a_check(ops, fleet):
    node = fleet["listed"]
    r = ops.post("/admin/marketplace/node/", {"action": "reverify_nodes", "_selected_action": [node.pk]})
    assert r.status_code == 302
    assert Job.objects.filter(node=node, kind="node_verify", status="queued").exists()


def test_unlist_action_goes_through_the_node_service(ops, fleet):
    listed, retired = fleet["listed"], make_listed_node(fleet["listed"].provider, name="old", gpu_count=1)
    Node.objects.filter(pk=retired.pk).update(state=NodeState.RETIRED)  # node_update refuses to change it
    r = ops.post("/admin/marketplace/node/", {"action": "unlist", "_selected_action": [listed.pk, retired.pk]},
                 follow=True)
    assert [str(m) for m in r.context["messages"]] == [
        "1 node(s) unlisted.", "old: The node is retired and cannot be changed."]
    listed.refresh_from_db()
    retired.refresh_from_db()
    assert listed.listed is False and retired.listed is True


def test_job_log_is_readable(ops, fleet):
    Job.objects.filter(pk=fleet["stuck"].pk).update(log=[{"at": "2026-01-01T00:00:00", "message": "connecting"}])
    page = ops.get(f"/admin/provisioning/job/{fleet['stuck'].pk}/change/").content.decode()
    assert "<code>2026-01-01T00:00:00</code> connecting" in page


def _usage_txn(key, renter, provider, amount, fee, at):
    from billing.models import AccountKind
    from billing.services.ledger import ledger_post, platform_account, user_account

    txn, _ = ledger_post(idempotency_key=key, kind="usage", at=at, lines=[
        (user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET), -amount),
        (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), amount - fee),
        (platform_account(kind=AccountKind.PLATFORM_REVENUE), fee)])
    return txn


def test_revenue_between_sums_usage_and_fees_from_the_ledger_net_of_reversals(renter, stranger):
    from datetime import UTC, datetime

    from billing.selectors import revenue_between
    from billing.services.ledger import credit_grant, ledger_reverse

    march = datetime(2026, 3, 1, tzinfo=UTC)
    _usage_txn("u1", renter, stranger, 10_000_000, 1_500_000, march - timedelta(seconds=1))  # February
    _usage_txn("u2", renter, stranger, 2_000_000, 300_000, march)
    wrong = _usage_txn("u3", renter, stranger, 4_000_000, 600_000, march + timedelta(days=3))
    ledger_reverse(txn=wrong, reason="charged by mistake")  # posted now, i.e. after March: not in March
    credit_grant(user=renter, amount_micros=50_000_000, reason="not revenue")
    april = datetime(2026, 4, 1, tzinfo=UTC)
    assert revenue_between(start=march, end=april) == {"charged_micros": 6_000_000, "fee_micros": 900_000}
    assert revenue_between(start=march - timedelta(days=1), end=march) == {"charged_micros": 10_000_000,
                                                                            "fee_micros": 1_500_000}
    assert revenue_between(start=march, end=timezone.now() + timedelta(seconds=1)) == {
        "charged_micros": 2_000_000, "fee_micros": 300_000}  # March, less the reversal posted since


def test_the_dashboard_shows_revenue_today_and_this_month_from_the_ledger(ops, renter, stranger):
    _usage_txn("today", renter, stranger, 12_340_000, 1_851_000, timezone.now() - timedelta(microseconds=1))
    page = ops.get("/admin/").content.decode()
    revenue = page.split('id="revenue-h"')[1].split("</div>")[0]
    assert "Charged to renters" in revenue and revenue.count("$12.34") == 2 and revenue.count("$1.85") == 2  # $1.851


def test_the_dashboard_counts_gpus_split_into_mig_slices(ops):
    """A GPU in status `mig` once made the operators' dashboard answer 500 (a column it did not know)."""
    from operations.dashboard import PARTS, fleet_figures
    from tests.marketplace.mig_helpers import SEVEN, make_mig_node

    make_mig_node({0: SEVEN}, gpu_count=2)  # GPU 0 split, GPU 1 whole and free
    assert (fleet_figures(PARTS)["gpus"]["mig"], fleet_figures(PARTS)["gpus"]["free"]) == (1, 1)
    page = ops.get("/admin/")
    assert page.status_code == 200 and "split into MIG slices" in page.content.decode()


# ------------------------------------------------------------------ change forms: what a browser would send


class _FormParser(HTMLParser):
    """The name/value pairs a browser sends for a form (inputs, checked boxes, selected options, textareas)."""

    def __init__(self, form_id):
        super().__init__()
        self.form_id, self.inside, self.data = form_id, False, []
        self._select = self._textarea = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form" and a.get("id") == self.form_id:
            self.inside = True
        if not self.inside:
            return
        if tag == "input" and a.get("name") and a.get("type") not in ("submit", "button", "file"):
            if a.get("type") in ("checkbox", "radio") and "checked" not in a:
                return
            self.data.append((a["name"], a.get("value", "on" if a.get("type") == "checkbox" else "")))
        elif tag == "select" and a.get("name"):
            self._select = a["name"]
        elif tag == "option" and self._select and "selected" in a:
            self.data.append((self._select, a.get("value", "")))
        elif tag == "textarea" and a.get("name"):
            self._textarea = [a["name"], ""]

    def handle_data(self, data):
        if self._textarea is not None:
            self._textarea[1] += data

    def handle_endtag(self, tag):
        if tag == "form" and self.inside:
            self.inside = False
        elif tag == "select":
            self._select = None
        elif tag == "textarea" and self._textarea is not None:
            self.data.append(tuple(self._textarea))
            self._textarea = None


def change_form(client, url, form_id) -> dict:
    page = client.get(url)
    assert page.status_code == 200
    parser = _FormParser(form_id)
    parser.feed(page.content.decode())
    data: dict = {"_save": ["Save"]}
    for name, value in parser.data:
        data.setdefault(name, []).append(value)
    return data


def test_the_user_change_form_refuses_an_address_that_differs_only_in_case(ops, renter, stranger):
    """Only the add form lower-cased and checked the address (found by review): Renter@Example.com was saved next
    to renter@example.com, a second account for one mailbox."""
    url = f"/admin/marketplace/user/{stranger.pk}/change/"
    data = change_form(ops, url, "user_form")
    data["email"] = ["Renter@Example.com"]
    r = ops.post(url, data)
    assert r.status_code == 200 and "An account has this address already." in r.content.decode()
    stranger.refresh_from_db()
    assert stranger.email == "stranger@example.com"
    data["email"] = ["New.Address@Example.COM"]
    assert ops.post(url, data).status_code == 302
    stranger.refresh_from_db()
    assert stranger.email == "new.address@example.com" and stranger.email_verified_at is None
    data["email"] = ["new.address@example.com"]  # its own address again: not another account's
    assert ops.post(url, data).status_code == 302


def test_the_node_change_form_cannot_relist_a_retired_node(ops, stranger):
    """The form saved name, place, price and `listed` past node_update, which refuses a retired node: it relisted
    one (found by review). They are read-only; the actions call the service."""
    node = make_listed_node(stranger, name="gone", gpu_count=1)
    Node.objects.filter(pk=node.pk).update(state=NodeState.RETIRED, listed=False)
    url = f"/admin/marketplace/node/{node.pk}/change/"
    data = change_form(ops, url, "node_form")
    data.update(listed=["on"], price_per_gpu_hour_micros=["9000000"], name=["renamed"])
    ops.post(url, data)
    node.refresh_from_db()
    assert (node.listed, node.price_per_gpu_hour_micros, node.name) == (False, 1_500_000, "gone")


@pytest.mark.parametrize("page", ["gpu", "node"])
def test_an_operator_cannot_mark_a_whole_free_gpu_as_split_into_mig_slices(ops, stranger, page):
    """`mig` means its node's check proved slices on it (provisioning.services.mig); set by hand, the GPU had no
    slices and was never booked whole again (found by review). Free and unavailable are the operator's choice."""
    node = make_listed_node(stranger, name="n-gpu", gpu_count=1)
    gpu = Gpu.objects.get(node=node)
    url, form_id, field = ((f"/admin/marketplace/gpu/{gpu.pk}/change/", "gpu_form", "status") if page == "gpu" else
                           (f"/admin/marketplace/node/{node.pk}/change/", "node_form", "gpus-0-status"))
    data = change_form(ops, url, form_id)
    for status in (GpuStatus.MIG, GpuStatus.RENTED):
        ops.post(url, {**data, field: [status]})
        gpu.refresh_from_db()
        assert gpu.status == GpuStatus.FREE, status
    assert ops.post(url, {**data, field: [GpuStatus.UNAVAILABLE]}).status_code == 302
    gpu.refresh_from_db()
    assert gpu.status == GpuStatus.UNAVAILABLE


def test_a_rented_gpus_status_is_shown_not_editable(ops, renter, stranger):
    fund(renter)
    node = make_listed_node(stranger, name="n-rented", gpu_count=1)
    book(renter, node)
    gpu = Gpu.objects.get(node=node)
    assert gpu.status == GpuStatus.RENTED
    url = f"/admin/marketplace/gpu/{gpu.pk}/change/"
    data = change_form(ops, url, "gpu_form")
    assert ops.post(url, {**data, "status": [GpuStatus.FREE]}).status_code == 302
    gpu.refresh_from_db()
    assert gpu.status == GpuStatus.RENTED
    node_url = f"/admin/marketplace/node/{node.pk}/change/"
    assert ops.post(node_url, {**change_form(ops, node_url, "node_form"), "gpus-0-status": ["free"]}).status_code == 302
    gpu.refresh_from_db()
    assert gpu.status == GpuStatus.RENTED
