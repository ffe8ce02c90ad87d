"""Pages say what the services hold: the low-balance warning on every page that shows an instance, the funds check's
burn rate in the page's own words, an instance's real state and whether it is billed, a rejected or offline
server's GPUs as not offered, and the operators' dashboard counting only bookable GPUs as free."""
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import BillingProfile
from marketplace.models import Instance, InstanceStatus, Node, NodeState, Verdict
from marketplace.models.nodes import OFFERABLE
from marketplace.selectors import node_not_offered_reason
from marketplace.services import instances as svc
from provisioning.models import Job, NodeEvent, VerificationRun
from tests.factories import make_listed_node, make_node
from tests.marketplace.renting_helpers import book, ed25519_key, run
from tests.web.conftest import fund, logged_in
from tests.web.test_provider_pages import FIGURES, FINDINGS

pytestmark = pytest.mark.django_db


def _instance_pages(client, instance) -> dict[str, str]:
    return {url: client.get(url).content.decode()
            for url in ("/instances/", f"/instances/{instance.pk}/", f"/instances/{instance.pk}/live/",
                        "/account/balance/")}


# ------------------------------------------------------------------------------ low balance (B)

def test_every_page_that_shows_an_instance_warns_when_the_balance_runs_low(web, renter, settings):
    settings.BILLING_LOW_BALANCE_WARNING_S = 3600
    fund(renter, 3)
    instance = run(book(renter, make_listed_node(gpu_model="a100-80gb-sxm", price="2.000000", gpu_count=2)))
    # $3.00 at $2.00/h: 1 h 30 min, above the warning time
    for url, page in _instance_pages(web, instance).items():
        assert "Low balance." not in page, url
    run(book(renter, make_listed_node(gpu_model="a100-80gb-sxm", price="2.000000", gpu_count=2)))
    for url, page in _instance_pages(web, instance).items():  # $3.00 at $4.00/h: 45 minutes
        assert "Low balance." in page, url
        assert "45 min" in page and "$4.00 per hour" in page, url
    # One place computes it: the warning follows billing.selectors.balance_status.
    settings.BILLING_LOW_BALANCE_WARNING_S = 1800
    for url, page in _instance_pages(web, instance).items():
        assert "Low balance." not in page, url


def test_a_depleted_balance_is_said_on_the_instance_pages_too(web, renter):
    fund(renter, 5)
    instance = run(book(renter, make_listed_node(price="1.000000")))
    BillingProfile.objects.update_or_create(user=renter, defaults={"depleted_at": timezone.now()})
    for url, page in _instance_pages(web, instance).items():
        assert "Your balance ran out" in page, url
        if url != "/account/balance/":
            assert 'href="/account/balance/"' in page, url


# ----------------------------------------------------------------------------- funds check (A)

def test_the_rent_page_counts_what_already_runs_and_the_refusal_names_no_api(web, renter, settings):
    settings.BILLING_REQUIRE_FUNDS = True
    fund(renter, 5)
    a100 = make_listed_node(gpu_model="a100-80gb-sxm", price="1.500000", gpu_count=4)
    h100 = make_listed_node(gpu_model="h100-sxm", price="2.250000", gpu_count=2)
    book(renter, a100, num_gpus=2)  # $3.00/h
    page = web.get(f"/offers/{h100.pk}/rent/").content.decode()
    assert 'id="burn-rate">$3.00 per hour<' in page and "Top up first" in page
    assert '<span data-funds="missing">$0.25</span> more' in page
    r = web.post(f"/offers/{h100.pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1",
                                              "ssh_public_key": ed25519_key(), "request_token": "t1"})
    page = r.content.decode()
    assert r.status_code == 400 and not Instance.objects.filter(node=h100).exists()
    assert "your running and starting instances and your storage cost $3.00 per hour, $5.25 with this one" in page
    assert "top up at least $0.25" in page and "/api/v1/" not in page


def test_a_refused_start_counts_the_others_and_names_no_api(web, renter, settings):
    settings.BILLING_REQUIRE_FUNDS = True
    fund(renter, 3)
    on = make_listed_node(price="1.500000", gpu_count=4)
    on.disk_price_per_gb_month_micros = 0  # the stopped disk, storage, would count in the funds check too
    on.save(update_fields=["disk_price_per_gb_month_micros"])
    stopped = run(book(renter, on))
    web.post(f"/instances/{stopped.pk}/stop/")
    svc.instance_mark_stopped(instance_id=stopped.pk)
    book(renter, on, num_gpus=2)  # $3.00/h: the $3.00 cover it, not a $1.50 more
    page = web.post(f"/instances/{stopped.pk}/start/", follow=True).content.decode()
    assert "Not enough balance" in page and "$4.50 with this one" in page and "/api/v1/" not in page
    stopped.refresh_from_db()
    assert stopped.status == "stopped"


# ---------------------------------------------------------------------------- instance state (C)

def test_an_instance_page_shows_the_models_state_and_bills_only_while_running(web, renter):
    fund(renter, 20)
    instance = run(book(renter, make_listed_node(price="1.200000")))
    page = web.get(f"/instances/{instance.pk}/").content.decode()
    assert 'data-billing="running"' in page and "rising" in page and 'data-tone="ok"' in page
    for status in InstanceStatus:
        if status == InstanceStatus.RUNNING:
            continue
        Instance.objects.filter(pk=instance.pk).update(status=status, status_message=f"What happened: {status}")
        for url in (f"/instances/{instance.pk}/", f"/instances/{instance.pk}/live/"):
            page = web.get(url).content.decode()
            assert 'id="instance-status"><span class="badge' in page and status.label in page, (status, url)
            assert f"What happened: {status}" in page, (status, url)
            assert 'data-billing="not-billed"' in page and "rising" not in page, (status, url)
            assert "ssh -p" not in page, (status, url)
        listing = web.get("/instances/?show=all").content.decode()
        assert status.label in listing and f'data-status="{status}"' in listing


def test_an_interrupted_instance_is_not_shown_running_nor_billed(web, renter):
    interrupted = getattr(InstanceStatus, "INTERRUPTED", None)
    if interrupted is None:
        pytest.skip("no interrupted state in this tree")
    fund(renter, 20)
    instance = run(book(renter, make_listed_node(price="1.200000")))
    Instance.objects.filter(pk=instance.pk).update(status=interrupted,
                                                   status_message="Interrupted: its server stopped answering.")
    page = web.get(f"/instances/{instance.pk}/live/").content.decode()
    assert interrupted.label in page and "its server stopped answering" in page
    assert 'data-tone="bad"' in page and 'data-billing="not-billed"' in page and "ssh -p" not in page
    assert re.search(r'id="instance-status"><span class="badge bad">', page)
    assert f'action="/instances/{instance.pk}/destroy/"' in page
    assert f'action="/instances/{instance.pk}/stop/"' not in page


# ------------------------------------------------------------------------------ servers (C)

@pytest.fixture
def provider(renter):
    return renter


@pytest.fixture
def rejected(provider):
    node = make_node(provider, name="fake-a100", gpu_model="a100-80gb-sxm", gpu_count=2,
                     state=NodeState.REJECTED, verdict=Verdict.REJECTED)
    job = Job.objects.create(kind="node_verify", node=node, status="succeeded", step="done",
                             finished_at=timezone.now(), deadline=timezone.now() + timedelta(hours=1))
    VerificationRun.objects.create(node=node, job=job, verdict="rejected", findings=FINDINGS, figures=FIGURES,
                                   score=0.0)
    return node


def test_a_rejected_servers_page_says_the_check_rejected_it_and_offers_no_gpu(web, rejected):
    for url in (f"/nodes/{rejected.pk}/", f"/nodes/{rejected.pk}/live/"):
        page = web.get(url).content.decode()
        assert "Last job: verify node" not in page, url
        assert "Last check: the benchmark check ran" in page and 'id="last-verdict">REJECTED<' in page, url
        assert 'href="#verdict-h">why, and what to do</a>' in page, url  # the reasons: said once, further down
        assert "Not offered to renters" in page and "rejected by the benchmark check" in page, url
    page = web.get(f"/nodes/{rejected.pk}/").content.decode()
    assert page.count("84 streaming multiprocessors") == 1 and 'id="verdict-h"' in page
    gpus = page.split('id="gpus-h"')[1].split("</section>")[0]
    assert ">free<" not in gpus and gpus.count("not offered") == 2
    listing = web.get("/nodes/").content.decode()
    assert "Benchmark check ran:" in listing and "not offered: the server was rejected" in listing
    assert "Verify node:" not in listing


@pytest.mark.parametrize(("state", "verdict", "listed", "why"), [
    (NodeState.OFFLINE, Verdict.VERIFIED, True, "offline"),
    (NodeState.QUARANTINED, Verdict.VERIFIED, True, "quarantined"),
    (NodeState.PENDING, Verdict.UNVERIFIED, True, "not been verified"),
    (NodeState.MAINTENANCE, Verdict.VERIFIED, True, "maintenance"),
    (NodeState.ACTIVE, Verdict.REJECTED, True, "rejected"),  # failed a re-check while rented: stays active
    (NodeState.ACTIVE, Verdict.VERIFIED, False, "not listed"),
    (NodeState.ACTIVE, Verdict.VERIFIED, True, ""),
])
def test_gpus_are_free_only_on_a_bookable_server(web, provider, state, verdict, listed, why):
    node = make_node(provider, gpu_count=2, state=state, verdict=verdict, listed=listed)
    assert node_not_offered_reason(node) == "" if not why else why in node_not_offered_reason(node)
    assert (node_not_offered_reason(node) == "") == Node.objects.filter(OFFERABLE, pk=node.pk).exists()
    gpus = web.get(f"/nodes/{node.pk}/").content.decode().split('id="gpus-h"')[1].split("</section>")[0]
    listing = web.get("/nodes/").content.decode()
    if why:
        assert ">free<" not in gpus and "not offered" in gpus and why in gpus
        assert "not offered:" in listing
    else:
        assert gpus.count(">free<") == 2 and "not offered" not in gpus and "not offered:" not in listing


# ------------------------------------------------------------------------------ dashboard (C)

def test_the_dashboard_counts_only_bookable_gpus_free_and_lists_offline_nodes_as_critical(operator, renter):
    make_listed_node(name="ok-a6000", gpu_model="rtx-a6000", gpu_count=4)
    make_node(name="fake-a6000", gpu_model="rtx-a6000", gpu_count=2, state=NodeState.REJECTED,
              verdict=Verdict.REJECTED)
    gone = make_node(name="gone-a6000", gpu_model="rtx-a6000", gpu_count=3, state=NodeState.OFFLINE,
                     verdict=Verdict.VERIFIED)
    Node.objects.filter(pk=gone.pk).update(last_error="connection refused")
    NodeEvent.objects.create(node=gone, level=NodeEvent.Level.WARNING, kind="offline",
                             message="3 health checks failed in a row: connection refused")
    page = logged_in(operator).get("/admin/").content.decode()
    assert 'id="gpus-free">4<' in page and 'id="gpus-not-offered">5<' in page
    assert "RTX A6000: 0 rented, 4 free, 0 split into MIG slices, 5 not offered, 0 unavailable" in page
    critical = page.split("Critical events (7 days)")[1].split("</div>")[0]
    assert "gone-a6000" in critical and "Offline now" in critical and "connection refused" in critical
    assert "3 health checks failed in a row" in critical
    assert ">1</span><span class=\"fleet-label\">nodes offline" in page
