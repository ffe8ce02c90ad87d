"""A provider's request for a node's verification (POST /api/v1/nodes/{id}/verify/, the Verify button) waits
NODE_VERIFY_COOLDOWN_S after the node's last check that ended with a verdict: each check costs the platform CPU and
SSH work, and a degraded or rejected card must not be re-judged on demand until a lucky draw passes. A check that
ended without a verdict (unreachable, the key refused) starts none; an open check is still answered (202); the
operators' Re-verify and the platform's own checks are not bound by it. Before, every request queued a new check."""
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from marketplace.models import Node, NodeState, Verdict
from provisioning.models import Job, JobKind, JobStatus, NodeEvent
from provisioning.services import verification
from provisioning.services.maintenance import nodes_reverify_due
from provisioning.services.reliability import node_inventory_changed
from provisioning.services.runner import job_begin
from provisioning.services.verification import (
    VerifyCooldown,
    node_verify_conclude,
    node_verify_cooldown,
    node_verify_failed,
    node_verify_request,
)
from provisioning.ssh_errors import AuthFailed, NodeUnreachable
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.renting_helpers import sent_jobs_fixture  # noqa: F401 (the sent_jobs fixture)

pytestmark = pytest.mark.django_db

COOLDOWN_S = 900


@pytest.fixture(autouse=True)
def _cooldown(settings):
    settings.NODE_VERIFY_COOLDOWN_S = COOLDOWN_S


def _verify_url(node: Node) -> str:
    return f"/api/v1/nodes/{node.pk}/verify/"


def _judged(node: Node, verdict: str) -> Job:
    """The node's open verification (queued by whoever) runs and ends with `verdict`, as node_verify_run ends it."""
    job = job_begin(job_id=node.jobs.get(kind=JobKind.NODE_VERIFY, status__in=("queued", "running")).pk)
    node_verify_conclude(job=job, verdict=verdict, findings=[], inventory={}, figures={}, score=1.0)
    job.refresh_from_db()
    assert job.status == JobStatus.SUCCEEDED and job.verification.verdict == verdict
    return job


def _failed(node: Node, error) -> Job:
    job = job_begin(job_id=node.jobs.get(kind=JobKind.NODE_VERIFY, status__in=("queued", "running")).pk)
    node_verify_failed(job=job, error=error)
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    return job


def _ended_ago(job: Job, seconds: float) -> None:
    """The check ended `seconds` ago (its times moved back: no sleeping)."""
    at = timezone.now() - timedelta(seconds=seconds)
    Job.objects.filter(pk=job.pk).update(created_at=at - timedelta(minutes=2), started_at=at - timedelta(minutes=2),
                                         finished_at=at)


def _verify_jobs(node: Node) -> int:
    return Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY).count()


@pytest.mark.parametrize("verdict", [Verdict.VERIFIED, Verdict.REJECTED, Verdict.DEGRADED])
def test_asking_again_within_the_cooldown_after_a_verdict_is_a_429_naming_the_node_and_the_times(
        client_for, verdict):
    provider = UserFactory()
    api = client_for(provider)
    node = make_listed_node(provider, gpu_count=1)
    assert api.post(_verify_url(node)).status_code == 202  # the provider's own request
    job = _judged(node, verdict)
    _ended_ago(job, 60)
    job.refresh_from_db()
    r = api.post(_verify_url(node))
    assert r.status_code == 429, r.content
    body = r.json()
    assert body["code"] == "verify_cooldown" and body["node"] == node.pk and body["verdict"] == verdict
    again = job.finished_at + timedelta(seconds=COOLDOWN_S)
    assert body["last_verified_at"] == job.finished_at.isoformat() and body["verify_again_at"] == again.isoformat()
    assert f"Node {node.pk} was last verified at {job.finished_at:%Y-%m-%d %H:%M:%S} UTC" in body["detail"]
    assert f"from {again:%Y-%m-%d %H:%M:%S} UTC, in 14 minutes" in body["detail"]
    assert 839 <= int(r["Retry-After"]) <= 840
    assert _verify_jobs(node) == 1  # nothing queued
    node.refresh_from_db()
    assert node.state != NodeState.VERIFYING


@pytest.mark.parametrize("verdict", [Verdict.VERIFIED, Verdict.REJECTED])
def test_once_the_cooldown_is_over_the_provider_may_ask_again(api, verdict):
    node = make_listed_node(api.user, gpu_count=1)
    api.post(_verify_url(node))
    job = _judged(node, verdict)
    _ended_ago(job, COOLDOWN_S - 5)
    r = api.post(_verify_url(node))
    assert r.status_code == 429 and 1 <= int(r["Retry-After"]) <= 5
    _ended_ago(job, COOLDOWN_S + 1)
    r = api.post(_verify_url(node))
    assert r.status_code == 202, r.content
    assert r.json()["current_job"]["kind"] == "node_verify" and _verify_jobs(node) == 2


def test_a_cooldown_of_zero_turns_it_off(api, settings):
    settings.NODE_VERIFY_COOLDOWN_S = 0
    node = make_listed_node(api.user, gpu_count=1)
    api.post(_verify_url(node))
    _judged(node, Verdict.VERIFIED)
    assert api.post(_verify_url(node)).status_code == 202


def test_the_first_verification_of_a_new_node_waits_for_nothing(api):
    node = make_node(api.user, gpu_count=1)
    r = api.post(_verify_url(node))
    assert r.status_code == 202 and r.json()["state"] == "verifying"


@pytest.mark.parametrize("error", [NodeUnreachable("Cannot reach 10.0.0.1:22"),
                                   AuthFailed("The node refused the platform's key")],
                         ids=["unreachable", "auth-failed"])
def test_a_check_that_ended_without_a_verdict_starts_no_cooldown(api, error):
    """Unreachable, or the key refused: the provider fixes the address or key and asks again at once. (A listed node
    whose key is refused is recorded as a rejection, node_at_fault; its job failed: no verdict of a check.)"""
    pending, listed = make_node(api.user, gpu_count=1), make_listed_node(api.user, gpu_count=1)
    for node in (pending, listed):
        assert api.post(_verify_url(node)).status_code == 202
        _failed(node, error)
        r = api.post(_verify_url(node))
        assert r.status_code == 202, r.content
        assert _verify_jobs(node) == 2


def test_a_failed_check_after_a_verdict_neither_starts_nor_ends_its_cooldown(api):
    node = make_listed_node(api.user, gpu_count=1)
    api.post(_verify_url(node))
    judged = _judged(node, Verdict.REJECTED)
    _ended_ago(judged, 600)
    node_verify_request(node=Node.objects.get(pk=node.pk), reason="scheduled re-verification")
    _failed(node, NodeUnreachable("Cannot reach 10.0.0.1:22"))  # ended just now, without a verdict
    r = api.post(_verify_url(node))
    assert r.status_code == 429 and 299 <= int(r["Retry-After"]) <= 300  # still from the rejection


def test_while_a_check_runs_it_is_answered_not_refused(api):
    """The open check is returned (202), whatever the cooldown: the same one, nothing queued."""
    node = make_listed_node(api.user, gpu_count=1)
    api.post(_verify_url(node))
    _ended_ago(_judged(node, Verdict.VERIFIED), 60)
    open_job = node_verify_request(node=Node.objects.get(pk=node.pk), reason="scheduled re-verification")
    r = api.post(_verify_url(node))
    assert r.status_code == 202 and r.json()["current_job"]["id"] == open_job.pk
    job_begin(job_id=open_job.pk)
    r = api.post(_verify_url(node))
    assert r.status_code == 202 and r.json()["current_job"]["id"] == open_job.pk
    assert _verify_jobs(node) == 2


def test_a_running_spot_check_is_still_a_409(api):
    node = make_listed_node(api.user, gpu_count=1)
    api.post(_verify_url(node))
    _ended_ago(_judged(node, Verdict.VERIFIED), 60)
    Job.objects.create(kind=JobKind.NODE_SPOT_CHECK, node=node, status=JobStatus.RUNNING,
                       deadline=timezone.now() + timedelta(minutes=5))
    r = api.post(_verify_url(node))
    assert r.status_code == 409 and "spot check" in r.json()["detail"]


def test_operators_and_the_platforms_own_checks_are_not_bound(api, operator_api, client_for):
    node = make_listed_node(api.user, gpu_count=1)
    api.post(_verify_url(node))
    _ended_ago(_judged(node, Verdict.REJECTED), 60)
    assert api.post(_verify_url(node)).status_code == 429
    # An operator's request by the API (another provider's node) ...
    assert operator_api.post(_verify_url(node)).status_code == 202
    _ended_ago(_judged(node, Verdict.REJECTED), 60)
    # ... the admin's Re-verify action ...
    admin = UserFactory(is_staff=True, is_superuser=True)
    ops = Client()
    ops.force_login(admin)
    assert ops.post("/admin/marketplace/node/", {"action": "reverify_nodes", "_selected_action": [node.pk]}
                    ).status_code == 302
    assert node.jobs.filter(kind=JobKind.NODE_VERIFY, status="queued").exists()
    _ended_ago(_judged(node, Verdict.VERIFIED), 60)
    # ... and the schedule's re-verification (maintenance.nodes_reverify_due), its time come.
    Node.objects.filter(pk=node.pk).update(next_check_at=timezone.now() - timedelta(seconds=1))
    assert nodes_reverify_due()["queued"] == 1
    assert _verify_jobs(node) == 4
    # The service itself: only the provider's request is bound (by_provider), never one with a reason alone.
    _ended_ago(_judged(node, Verdict.VERIFIED), 60)
    node = Node.objects.get(pk=node.pk)
    with pytest.raises(VerifyCooldown):
        node_verify_request(node=node, reason="asked by hand", by_provider=True)
    assert node_verify_request(node=node, reason="the GPU inventory changed").kind == JobKind.NODE_VERIFY


def test_the_verify_button_says_when_it_may_be_pressed_and_a_post_says_why_not():
    provider = UserFactory()
    web = Client()
    web.force_login(provider)
    node = make_listed_node(provider, gpu_count=1)
    r = web.post(f"/nodes/{node.pk}/verify/", follow=True)
    assert r.status_code == 200 and "Verification queued" in r.content.decode()
    job = _judged(node, Verdict.REJECTED)
    _ended_ago(job, 60)
    job.refresh_from_db()
    again = job.finished_at + timedelta(seconds=COOLDOWN_S)
    Job.objects.filter(pk=job.pk).update(finished_at=job.finished_at.replace(second=20))  # not on the minute
    job.refresh_from_db()
    again = job.finished_at + timedelta(seconds=COOLDOWN_S)
    shown = again.replace(second=0, microsecond=0) + timedelta(minutes=1)  # rounded up, never down
    page = web.get(f"/nodes/{node.pk}/").content.decode()
    assert f'action="/nodes/{node.pk}/verify/"' not in page  # no form to post: the button is disabled
    assert ('<button type="button" disabled aria-describedby="verify-cooldown">'
            f"Verify again from {shown:%H:%M} UTC</button>") in page  # its label says from when, not "Verify now"
    assert f"Verify again from {shown:%Y-%m-%d %H:%M} UTC" in page and "at most once every 15 minutes" in page
    # A click at the minute shown is not refused; a minute sooner (the time rounded down) would have been.
    assert node_verify_cooldown(node, now=shown) is None
    assert node_verify_cooldown(node, now=shown - timedelta(minutes=1)) is not None
    # A POST anyway (a page left open): the page again, saying when, nothing queued.
    r = web.post(f"/nodes/{node.pk}/verify/", follow=True)
    text = r.content.decode()
    assert r.status_code == 200 and f"Node {node.pk} was last verified at" in text
    assert f"{again:%Y-%m-%d %H:%M:%S} UTC" in text and _verify_jobs(node) == 1
    _ended_ago(job, COOLDOWN_S + 1)
    page = web.get(f"/nodes/{node.pk}/").content.decode()
    assert f'action="/nodes/{node.pk}/verify/"' in page and "verify-cooldown" not in page
    assert web.post(f"/nodes/{node.pk}/verify/").status_code == 302 and _verify_jobs(node) == 2


# ------------------------------------------------------------------ the provider's changes that start a check

def _inventory(node: Node) -> None:
    Node.objects.filter(pk=node.pk).update(inventory={"gpus": [{"index": 0, "uuid": "GPU-a", "power_limit_w": 300}]})


def _queued(node: Node) -> list[str]:
    return [j.log[0]["message"] for j in Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY, status="queued")]


@pytest.mark.parametrize("verdict", [Verdict.VERIFIED, Verdict.DEGRADED])
def test_an_inventory_change_within_the_cooldown_is_checked_at_its_end_not_at_once(api, verdict):
    """`nvidia-smi -pl X` and back: the agent's fingerprint changes (power limit, MIG, ECC, driver) at the
    provider's will. Before, each change queued a verification at once: a fresh verdict per flip, the re-roll the
    cooldown stops. Now the check is due at the cooldown's end, said once, and the beat queues it then."""
    node = make_listed_node(api.user, gpu_count=1)
    api.post(_verify_url(node))
    job = _judged(node, verdict)
    _ended_ago(job, 60)
    job.refresh_from_db()
    _inventory(node)
    again = job.finished_at + timedelta(seconds=COOLDOWN_S)
    assert node_inventory_changed(node_id=node.pk, reported_hash="power limit 250 W") is True
    assert _queued(node) == [] and _verify_jobs(node) == 1  # nothing queued now
    node.refresh_from_db()
    assert node.next_check_at == again
    assert (node.state, node.verdict, node.listed) == (NodeState.ACTIVE, verdict, True)  # as it was
    event = NodeEvent.objects.get(node=node, kind="inventory_changed")
    assert f"its check is due at {again:%Y-%m-%d %H:%M:%S} UTC" in event.message, event.message
    # The health checks meanwhile (every minute, the power limit flipped back and again): no more events, no check.
    assert node_inventory_changed(node_id=node.pk, reported_hash="power limit 300 W") is False
    assert NodeEvent.objects.filter(node=node, kind="inventory_changed").count() == 1 and _queued(node) == []
    # The beat, its clock moved: nothing before the cooldown's end, the check at it.
    assert nodes_reverify_due(now=again - timedelta(seconds=1))["queued"] == 0 and _queued(node) == []
    assert nodes_reverify_due(now=again)["queued"] == 1
    assert _queued(node) == ["queued: scheduled re-verification"]


def test_an_inventory_change_outside_the_cooldown_is_checked_at_once(api):
    node = make_listed_node(api.user, gpu_count=1)
    api.post(_verify_url(node))
    _ended_ago(_judged(node, Verdict.VERIFIED), COOLDOWN_S + 1)
    _inventory(node)
    assert node_inventory_changed(node_id=node.pk, reported_hash="power limit 250 W") is True
    assert _queued(node) == ["queued: the GPU inventory changed"]
    assert "verifying it again" in NodeEvent.objects.get(node=node, kind="inventory_changed").message


def test_a_mig_layout_changed_during_a_check_is_checked_again_at_the_cooldowns_end(api):
    """The provider re-declares a layout during each check: before, each was a new check at once."""
    node = make_listed_node(api.user, gpu_count=1)
    api.post(_verify_url(node))
    job = _judged(node, Verdict.VERIFIED)  # ended just now: its verdict starts the cooldown
    again = job.finished_at + timedelta(seconds=COOLDOWN_S)
    verification._reverify_new_layout(Node.objects.get(pk=node.pk), [0])
    assert _queued(node) == []
    node.refresh_from_db()
    assert node.next_check_at == again
    event = NodeEvent.objects.get(node=node, kind="mig_layout_changed_during_check")
    assert f"a new check judges the layout declared now, due at {again:%Y-%m-%d %H:%M:%S} UTC" in event.message
    assert nodes_reverify_due(now=again - timedelta(seconds=1))["queued"] == 0
    assert nodes_reverify_due(now=again)["queued"] == 1
    assert _queued(node) == ["queued: scheduled re-verification"]
    # Outside the cooldown (both checks' verdicts longer ago than it): at once, as before.
    _ended_ago(job, COOLDOWN_S + 2)
    _ended_ago(_judged(node, Verdict.VERIFIED), COOLDOWN_S + 1)
    verification._reverify_new_layout(Node.objects.get(pk=node.pk), [0])
    assert _queued(node) == ["queued: the MIG layout changed during the check"]


def test_a_mig_layout_changed_during_a_check_that_rejected_the_node_says_when_to_ask(api):
    """A rejected node (no renters) is not queued by the beat: its provider asks, from the cooldown's end."""
    node = make_listed_node(api.user, gpu_count=1)
    api.post(_verify_url(node))
    job = _judged(node, Verdict.REJECTED)
    node.refresh_from_db()
    assert node.state == NodeState.REJECTED
    verification._reverify_new_layout(node, [0])
    assert _queued(node) == []
    shown = node_verify_cooldown(node).available_minute
    event = NodeEvent.objects.get(node=node, kind="mig_layout_changed_during_check")
    assert f"when its provider asks for it (Verify), from {shown:%Y-%m-%d %H:%M} UTC" in event.message
    assert shown >= job.finished_at + timedelta(seconds=COOLDOWN_S)
