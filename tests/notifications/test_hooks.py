"""Each event is told where it really happens, once: credits posted and reversed, payouts, instance and node
transitions. (Low balance: tests/billing/test_balances.py.)"""
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.services.ledger import credit_grant, ledger_reverse
from marketplace.models import NodeState
from notifications.models import Notification
from provisioning.models import Job, JobKind
from provisioning.services.fleet_record import node_record_health
from provisioning.services.nodes import OFFLINE_AFTER_FAILED_CHECKS
from provisioning.services.verification import node_verify_conclude
from tests.billing.helpers import fund, node, run, running, stop
from tests.factories import UserFactory, make_node

pytestmark = pytest.mark.django_db


def _told(user, kind=None):
    rows = Notification.objects.filter(user=user).order_by("pk")
    if kind:
        rows = rows.filter(kind=kind)
    return list(rows.values_list("kind", flat=True))


def test_a_credit_and_its_reversal_are_told_once_in_the_customers_words(owner):
    operator = UserFactory(is_staff=True)
    txn, _ = credit_grant(user=owner, amount_micros=5_000_000, reason="internal: ticket 42, angry customer",
                          customer_note="Sorry for the outage on Monday.", created_by=operator,
                          idempotency_key="ops-1")
    credit_grant(user=owner, amount_micros=5_000_000, reason="again", idempotency_key="ops-1")  # the same credit
    ledger_reverse(txn=txn, reason="internal: wrong customer", created_by=operator)
    ledger_reverse(txn=txn, reason="internal: twice")
    assert _told(owner) == ["credit_posted", "credit_reversed"]
    posted, reversed_ = Notification.objects.filter(user=owner).order_by("pk")
    assert posted.title == "$5.00 was credited to your balance"
    assert "Sorry for the outage on Monday." in posted.body and "ticket 42" not in posted.body
    assert "taken back" in reversed_.body and "wrong customer" not in reversed_.body
    assert reversed_.payload["reverses"] == txn.pk
    assert _told(operator) == []


def test_instances_tell_their_renter_when_running_stopped_and_failed():
    renter = UserFactory()
    fund(renter, "50")
    instance = running(renter, node("1.000000"))
    stop(instance)
    from marketplace.services import instances as svc

    svc.instance_start(instance=instance)
    run(instance)  # running again: a second "running", keyed by when it started
    svc.instance_mark_failed(instance_id=instance.pk, message="the VM vanished")
    svc.instance_mark_failed(instance_id=instance.pk, message="again")
    assert _told(renter)[1:] == ["instance_running", "instance_stopped", "instance_running", "instance_failed"]
    failed = Notification.objects.get(user=renter, kind="instance_failed")
    assert failed.title == f"Instance {instance.pk} failed" and "the VM vanished" in failed.body


def test_an_interruption_is_told_once_with_its_credit(settings):
    renter = UserFactory()
    fund(renter, "50")
    host = node("1.000000")
    instance = running(renter, host)
    for _ in range(max(OFFLINE_AFTER_FAILED_CHECKS, settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS) + 1):
        node_record_health(node_id=host.pk, ok=False, error="timed out")
    told = Notification.objects.get(user=renter, kind="instance_interrupted")
    assert str(instance.pk) in told.title and "credited" in told.body
    assert _told(host.provider, "node_offline") == ["node_offline"]  # once, however many checks fail


def test_a_node_going_offline_again_later_is_told_again():
    host = make_node(state=NodeState.ACTIVE, verdict="verified")
    for _ in range(OFFLINE_AFTER_FAILED_CHECKS):
        node_record_health(node_id=host.pk, ok=False, error="no route")
    node_record_health(node_id=host.pk, ok=True)
    for _ in range(OFFLINE_AFTER_FAILED_CHECKS):
        node_record_health(node_id=host.pk, ok=False, error="no route")
    assert _told(host.provider) == ["node_offline", "node_offline"]


@pytest.mark.parametrize("verdict, kind", [("rejected", "node_rejected"), ("degraded", "node_degraded")])
def test_a_new_verdict_of_rejected_or_degraded_is_told_to_the_provider(verdict, kind):
    host = make_node(state=NodeState.ACTIVE, verdict="verified")
    severity = "reject" if verdict == "rejected" else "degrade"
    for _ in range(2):  # the same verdict on the next check is not news
        job = Job.objects.create(kind=JobKind.NODE_VERIFY, node=host, status="running",
                                 deadline=timezone.now() + timedelta(days=1))
        node_verify_conclude(job=job, verdict=verdict, score=0.5, inventory={}, findings=[
            {"severity": severity, "code": "bf16_slow", "message": "BF16 measured 50 % of the datasheet",
             "gpu_index": 0}])
    assert _told(host.provider) == [kind]
    told = Notification.objects.get(user=host.provider)
    assert "BF16 measured" in told.body and told.payload["verdict"] == verdict
