"""Review r54 (ops, MEDIUM-3): each of the dashboard's cards linked to a list that showed other rows than it counted.
"GPUs free to book" counts free GPUs of offerable nodes and linked to every free GPU (offline, rejected, retired
nodes' too); "nodes rejected" counts those not retired and linked to all; the "in 24 h" and "in 7 days" cards linked
to every failure ever made (and the node's failed verifications to failures of every kind); "money waiting on
Stripe" counts rows past the follow-up's delay and linked to the younger ones too. Now each link carries its count's
rule (admin list filters, as `stuck`, `stripe` and `held` were), so the list shows what the card counts."""
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import AccountKind, Payout, TopUp
from billing.services.ledger import ledger_post, platform_account, user_account
from marketplace.models import Gpu, GpuStatus, NodeState, Verdict
from operations.dashboard import fleet_figures
from provisioning.models import Job, JobFault, JobKind, JobStatus, VerificationRun
from tests.factories import UserFactory, make_node
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def _listed(url: str) -> int:
    ops = logged_in(UserFactory(is_staff=True, is_superuser=True))
    response = ops.get(url)
    assert response.status_code == 200, url
    return response.context["cl"].result_count


def test_rejected_and_degraded_counts_match_their_links():
    make_node(state=NodeState.ACTIVE, verdict=Verdict.REJECTED, name="live-rejected")
    make_node(state=NodeState.RETIRED, verdict=Verdict.REJECTED, name="retired-rejected")
    make_node(state=NodeState.ACTIVE, verdict=Verdict.DEGRADED, name="live-degraded")
    make_node(state=NodeState.RETIRED, verdict=Verdict.DEGRADED, name="retired-degraded")
    figures = fleet_figures({"nodes"})
    assert (figures["rejected_count"], _listed(figures["rejected_url"])) == (1, 1)
    assert (figures["degraded_count"], _listed(figures["degraded_url"])) == (1, 1)


def test_free_gpus_count_matches_its_link():
    make_node(state=NodeState.ACTIVE, verdict=Verdict.VERIFIED, gpu_count=2, name="bookable")
    make_node(state=NodeState.OFFLINE, verdict=Verdict.VERIFIED, gpu_count=4, name="offline")  # idle, not bookable
    make_node(state=NodeState.RETIRED, verdict=Verdict.VERIFIED, gpu_count=1, name="retired")
    Gpu.objects.update(status=GpuStatus.FREE)
    figures = fleet_figures({"gpus"})
    assert (figures["gpus"]["free"], _listed(figures["gpus_free_url"])) == (2, 2)
    ops = logged_in(UserFactory(is_staff=True, is_superuser=True))
    page = ops.get("/admin/").content.decode().replace("&amp;", "&")
    assert f'href="{figures["gpus_free_url"]}"' in page and "?status__exact=free" not in page


def _failed(node, fault: str, kind: str = JobKind.NODE_VERIFY, ago: timedelta = timedelta(minutes=5)) -> Job:
    at = timezone.now() - ago
    return Job.objects.create(node=node, kind=kind, status=JobStatus.FAILED, fault=fault, error="failed",
                              created_at=at, finished_at=at, deadline=at)


def test_the_24_hour_job_cards_link_to_that_window_and_kind():
    node = make_node()
    _failed(node, JobFault.NODE)
    _failed(node, JobFault.NODE, kind=JobKind.NODE_SPOT_CHECK)  # the node's, not a verification
    _failed(node, JobFault.NODE, ago=timedelta(days=2))
    _failed(node, JobFault.PLATFORM)
    _failed(node, JobFault.PLATFORM, ago=timedelta(days=3))
    figures = fleet_figures({"jobs"})
    assert (figures["failed_verify_jobs_day"], _listed(figures["failed_jobs_url"])) == (1, 1)
    assert (figures["platform_failed_jobs_day"], _listed(figures["platform_failed_jobs_url"])) == (1, 1)


def test_the_7_day_rejected_runs_card_links_to_that_window():
    node = make_node()
    VerificationRun.objects.create(node=node, verdict=Verdict.REJECTED)
    old = VerificationRun.objects.create(node=node, verdict=Verdict.REJECTED)
    VerificationRun.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=8))
    figures = fleet_figures({"runs"})
    assert (figures["rejected_runs_week"], _listed(figures["rejected_runs_url"])) == (1, 1)
    ops = logged_in(UserFactory(is_staff=True, is_superuser=True))
    assert f'href="{figures["rejected_runs_url"]}"' in ops.get("/admin/").content.decode().replace("&amp;", "&")


def _payout(provider, ago: timedelta, week: int) -> Payout:
    since = timezone.now() - ago
    txn, _ = ledger_post(idempotency_key=f"payout:{provider.pk}:{ago}", kind="payout", lines=[
        (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), -1_000_000),
        (platform_account(kind=AccountKind.PAYOUT_CLEARING), 1_000_000)])
    return Payout.objects.create(provider=provider, period_start=since.date() - timedelta(days=7 * week),
                                 period_end=since.date(), amount_micros=1_000_000, destination="acct_1Test",
                                 transaction=txn, created_at=since)


def test_the_waiting_on_stripe_links_list_only_what_is_past_the_follow_ups_delay():
    provider = UserFactory()
    _payout(provider, timedelta(hours=2), week=1)
    _payout(provider, timedelta(seconds=5), week=2)  # inside the delay: not counted, so not listed
    for ago in (timedelta(hours=2), timedelta(seconds=5)):
        top_up = TopUp.objects.create(user=provider, amount_micros=5_000_000, status="processing")
        TopUp.objects.filter(pk=top_up.pk).update(created_at=timezone.now() - ago)
    waiting = {w["part"]: w for w in fleet_figures({"payouts", "top_ups"})["waiting"]}
    assert (waiting["payouts"]["count"], _listed(waiting["payouts"]["url"])) == (1, 1)
    assert (waiting["top_ups"]["count"], _listed(waiting["top_ups"]["url"])) == (1, 1)
