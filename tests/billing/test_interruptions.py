"""Interruptions, service by service: a lost node or VM stops billing at the last healthy moment, the renter is
told and credited by the published rule (charged to the provider), and the instance resumes, restarts, fails or
is destroyed at once. The same flows over real SSH with a worker: tests/e2e/test_interruptions.py."""
from datetime import timedelta

import pytest
from django.core import mail

from billing.models import BillingEvent, EventKind, LedgerTransaction, TransactionKind
from billing.services.credits import credit_due
from billing.services.ledger import earnings_balance
from billing.services.metering import cost_for, usage_meter
from marketplace.models import Gpu, Instance, Interruption, Node
from marketplace.services import instances as svc
from notifications.models import Notification
from provisioning.models import Job, JobKind
from provisioning.services.fleet_record import node_record_health
from tests.billing.helpers import balance, fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def rented(clock):
    """A renter's running 2-GPU instance ($3/h) on a node last seen healthy now."""
    renter = UserFactory()
    fund(renter, "50")
    host = node(price="1.500000", gpu_count=4)
    node_record_health(node_id=host.pk, ok=True)
    instance = running(renter, host, num_gpus=2)
    return renter, Node.objects.get(pk=host.pk), instance


def _fail_checks(host, n, error="[Errno 111] Connection refused"):
    interrupted = []
    for _ in range(n):
        interrupted += node_record_health(node_id=host.pk, ok=False, error=error)
    return interrupted


def test_the_meter_bills_no_further_than_the_nodes_last_healthy_moment(rented, clock):
    renter, host, instance = rented
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=True)  # seen healthy at +60
    clock.advance(50)  # the node dies here; nobody knows yet
    usage_meter()
    instance.refresh_from_db()
    assert instance.billed_seconds == 60  # up to the last healthy probe, not to now (+110)
    assert instance.billed_until <= Node.objects.get(pk=host.pk).last_seen_at


def test_a_lost_node_interrupts_its_instances_and_stops_billing_at_the_last_healthy_probe(
        rented, clock, django_capture_on_commit_callbacks):
    renter, host, instance = rented
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=True)
    last_healthy = Node.objects.get(pk=host.pk).last_seen_at
    clock.advance(30)
    usage_meter()
    clock.advance(30)
    assert _fail_checks(host, 1) == []  # one missed check is not an interruption
    usage_meter()
    clock.advance(60)
    with django_capture_on_commit_callbacks(execute=True):
        assert _fail_checks(host, 1) == [instance.pk]  # the second in a row is
    instance.refresh_from_db()
    assert instance.status == "interrupted" and "Billing stopped at" in instance.status_message
    assert instance.billed_until <= last_healthy and instance.billed_seconds == 60
    interruption = Interruption.objects.get(instance=instance)
    assert interruption.cause == "node_lost" and interruption.started_at == last_healthy
    assert interruption.ended_at is None
    # Told at once, by event and email; credited the multiple of the price of the time lost so far.
    event = BillingEvent.objects.get(user=renter, kind=EventKind.INSTANCE_INTERRUPTED)
    assert mail.outbox and "interrupted" in mail.outbox[-1].subject  # e-mailed by notifications
    assert Notification.objects.get(user=renter, kind="instance_interrupted").body == event.message
    lost = int((clock.now - last_healthy).total_seconds())
    assert interruption.credited_micros == credit_due(price_per_hour_micros=3_000_000, lost_seconds=lost) > 0
    credit = LedgerTransaction.objects.get(kind=TransactionKind.SERVICE_CREDIT)
    assert {e.account.kind: e.amount_micros for e in credit.entries.select_related("account")} == {
        "customer_wallet": interruption.credited_micros, "provider_earnings": -interruption.credited_micros}
    # Nothing is billed while interrupted, however long it lasts.
    clock.advance(600)
    usage_meter()
    instance.refresh_from_db()
    assert instance.billed_seconds == 60
    assert not instance.usage_intervals.filter(ended_at__gt=last_healthy).exists()


def test_the_node_coming_back_with_the_vm_resumes_billing_and_credits_the_whole_time_lost(rented, clock):
    renter, host, instance = rented
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=True)
    last_healthy = clock.now
    clock.advance(60)
    _fail_checks(host, 3)  # offline now
    assert Node.objects.get(pk=host.pk).state == "offline"
    provider_before = earnings_balance(user_id=host.provider_id)
    clock.advance(600)
    resumed_at = clock.now
    assert svc.instance_resume(instance_id=instance.pk) is not None
    instance.refresh_from_db()
    assert instance.status == "running" and instance.started_at == resumed_at
    interruption = Interruption.objects.get(instance=instance)
    assert interruption.outcome == "resumed" and interruption.ended_at == resumed_at
    lost = int((resumed_at - last_healthy).total_seconds())
    assert interruption.credited_seconds == lost
    assert interruption.credited_micros == 3_000_000 * lost // 3600  # the published multiple is 1
    assert earnings_balance(user_id=host.provider_id) < provider_before
    resumed = BillingEvent.objects.get(user=renter, kind=EventKind.INSTANCE_RESUMED)
    assert "out of reach for 11 min 00 s" in resumed.message and "credited $0.55 for it" in resumed.message
    assert resumed.data["credited"] == "0.550000"  # the data stays exact
    # Billing restarts from the resume, not from before the interruption.
    node_record_health(node_id=host.pk, ok=True)
    clock.advance(120)
    node_record_health(node_id=host.pk, ok=True)
    usage_meter()
    instance.refresh_from_db()
    assert instance.billed_seconds == 60 + 120
    assert instance.cost_micros == cost_for(3_000_000, 180)


def test_the_credit_is_capped_per_interruption_and_posted_once(rented, clock, settings):
    settings.INTERRUPTION_CREDIT_MAX_S = 3600
    settings.INTERRUPTION_CREDIT_MULTIPLE = "2"
    renter, host, instance = rented
    _fail_checks(host, 2)
    clock.advance(hours=30)
    svc.instance_resume(instance_id=instance.pk)
    interruption = Interruption.objects.get(instance=instance)
    assert interruption.credited_seconds == 3600 and interruption.credited_micros == 2 * 3_000_000
    before = balance(renter)
    from billing.services.credits import interruption_credit

    assert interruption_credit(interruption_id=interruption.pk, until=clock.now).amount_micros == 0
    assert balance(renter) == before


def test_the_vm_stopping_on_a_healthy_node_interrupts_only_that_instance(rented, clock):
    renter, host, instance = rented
    other_renter = UserFactory()
    fund(other_renter, "10")
    other = running(other_renter, host, num_gpus=1)
    clock.advance(30)
    probed = clock.now
    clock.advance(1)
    vms = {instance.vm_id: "stopped", other.vm_id: "running"}
    assert node_record_health(node_id=host.pk, ok=True, vms=vms, probed_at=probed) == [instance.pk]
    instance.refresh_from_db()
    other.refresh_from_db()
    assert instance.status == "interrupted" and other.status == "running"
    assert Interruption.objects.get(instance=instance).cause == "vm_lost"
    # The node answering again, VM stopped: started again on the same GPUs (a job), billing when it runs.
    assert svc.instance_restart_interrupted(instance_id=instance.pk).status == "starting"
    assert Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_START).exists()
    assert Interruption.objects.get(instance=instance).outcome == "restarted"


def test_an_instance_that_started_after_the_probe_is_not_judged_by_it(rented, clock):
    _, host, instance = rented
    probed = instance.started_at - timedelta(seconds=5)
    assert node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=probed) == []
    instance.refresh_from_db()
    assert instance.status == "running"


@pytest.mark.parametrize("change", ["stop", "destroy"])
def test_a_change_asked_while_the_node_is_silent_bills_only_to_its_last_healthy_moment(rented, clock, change):
    """In the checks before an interruption, a stop or destroy billed up to the request: time the node was not
    answering, which the meter and the interruption never bill. While the node answers, it bills to the moment."""
    renter, host, instance = rented
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=True)
    last_healthy = Node.objects.get(pk=host.pk).last_seen_at
    clock.advance(90)
    assert _fail_checks(host, 1) == []  # silent, not yet interrupted
    clock.advance(20)
    getattr(svc, f"instance_{change}")(instance=Instance.objects.get(pk=instance.pk))
    instance.refresh_from_db()
    assert instance.billed_seconds == 60 and instance.billed_until == last_healthy
    assert balance(renter) == 50_000_000 - cost_for(3_000_000, 60)

    node_record_health(node_id=host.pk, ok=True)  # answering again (a silent node takes no booking)
    other = running(renter, host, num_gpus=1)  # on the same node: billed to the moment
    clock.advance(45)
    svc.instance_stop(instance=Instance.objects.get(pk=other.pk))
    assert Instance.objects.get(pk=other.pk).billed_seconds == 45


def test_destroying_an_interrupted_instance_ends_it_at_once_and_keeps_its_gpus_until_clean_up(rented, clock, sent_jobs):
    renter, host, instance = rented
    _fail_checks(host, 2)
    clock.advance(120)
    svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    instance.refresh_from_db()
    assert instance.status == "destroyed" and "removed when it answers again" in instance.status_message
    assert all(kind != "instance_destroy" for _, kind in sent_jobs)  # no job could reach the node
    assert Interruption.objects.get(instance=instance).outcome == "destroyed"
    assert Gpu.objects.filter(node=host, status="rented").count() == 2  # its VM may still use them
    assert sorted(svc.instance_cleanup_done(instance_id=instance.pk)) == [0, 1]
    assert Gpu.objects.filter(node=host, status="rented").count() == 0


def test_a_stopped_instance_on_an_offline_node_is_destroyed_at_once(rented, clock):
    renter, host, instance = rented
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    _fail_checks(host, 3)
    svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    assert Instance.objects.get(pk=instance.pk).status == "destroyed"


def test_a_failed_recovery_ends_the_interruption_and_tells_the_renter_why(rented, clock):
    renter, host, instance = rented
    _fail_checks(host, 2)
    clock.advance(300)
    svc.instance_mark_failed(instance_id=instance.pk, message="Its server answered again, but the VM was gone.")
    instance.refresh_from_db()
    assert instance.status == "failed" and "credited" in instance.status_message
    assert Interruption.objects.get(instance=instance).outcome == "failed"
    lost = BillingEvent.objects.get(user=renter, kind=EventKind.INSTANCE_LOST)
    assert "VM was gone" in lost.message
    assert Gpu.objects.filter(node=host, status="rented").count() == 0


def test_verbs_on_an_interrupted_instance_are_refused_with_what_to_do(rented, clock, client_for):
    renter, host, instance = rented
    _fail_checks(host, 2)
    api = client_for(renter)
    r = api.post(f"/api/v1/instances/{instance.pk}/stop/")
    assert r.status_code == 409 and "resumes by itself" in r.json()["detail"]
    body = api.get(f"/api/v1/instances/{instance.pk}/").json()
    assert body["status"] == "interrupted"


def test_the_terms_endpoint_publishes_the_rule(client):
    r = client.get("/api/v1/billing/terms/")
    assert r.status_code == 200
    rule = r.json()["interruptions"]
    assert rule["credit_multiple"] == "1" and rule["credit_max_seconds"] == 86400
    assert rule["detected_after_failed_health_checks"] == 2 and rule["charged_to"] == "provider_earnings"
    worse = r.json()["hardware_found_worse"]
    assert "never above" in worse["price_back"] and worse["tolerance"] == "0.05"


def _recheck(host, verdict, score, code="bf16_slow", gpu_index=0):
    from datetime import timedelta as td

    from provisioning.services.verification import node_verify_conclude

    job = Job.objects.create(kind=JobKind.NODE_VERIFY, node=host, status="running",
                             deadline=host.created_at + td(days=1))
    severity = "reject" if verdict == "rejected" else "degrade"
    node_verify_conclude(job=job, verdict=verdict, score=score, inventory={},
                         findings=[{"severity": severity, "code": code, "message": f"{code} measured",
                                           "gpu_index": gpu_index}])


def test_hardware_found_worse_while_rented_cuts_the_price_from_the_check_on(rented, clock):
    renter, host, instance = rented
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=True)
    _recheck(host, "degraded", 0.6)  # 60 % of the score it had (1.0)
    instance.refresh_from_db()
    assert instance.price_per_hour_micros == 1_800_000 and instance.price_per_gpu_hour_micros == 900_000
    assert instance.billed_seconds == 60 and instance.rate_base_cost_micros == 50_000
    event = BillingEvent.objects.get(user=renter, kind=EventKind.PRICE_CUT)
    assert "$1.80" in event.message and "bf16_slow" in event.message
    clock.advance(120)
    node_record_health(node_id=host.pk, ok=True)
    usage_meter()
    instance.refresh_from_db()
    assert instance.cost_micros == 50_000 + 1_800_000 * 120 // 3600  # the old price, then the new one
    # Noise within the published tolerance changes nothing; the node's listing price is the provider's.
    _recheck(host, "degraded", 0.58)
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 1_800_000
    assert Node.objects.get(pk=host.pk).price_per_gpu_hour_micros == 1_500_000


def test_a_rejection_without_a_score_while_rented_makes_the_instance_free(rented, clock):
    renter, host, instance = rented
    _recheck(host, "rejected", None, code="gpu_identity_mismatch")
    instance.refresh_from_db()
    assert instance.status == "running" and instance.price_per_hour_micros == 0
    assert "failed its latest benchmark check" in instance.status_message


def _funded():
    user = UserFactory()
    fund(user, "50")
    return user


def _gpu_indices(instance):
    return sorted(Gpu.objects.filter(allocations__instance=instance, allocations__released_at__isnull=True)
                  .values_list("index", flat=True))


def test_a_rejection_naming_one_gpu_frees_only_the_instance_holding_it(rented, clock):
    renter, host, instance = rented
    other = running(_funded(), host, num_gpus=1)
    named = _gpu_indices(other)[0]
    assert named not in _gpu_indices(instance)
    _recheck(host, "rejected", None, code="gpu_name", gpu_index=named)
    assert Instance.objects.get(pk=other.pk).price_per_hour_micros == 0
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 3_000_000  # its cards were not named
    assert not BillingEvent.objects.filter(user=renter, kind=EventKind.PRICE_CUT).exists()


def test_a_rejection_about_the_whole_server_frees_every_renter(rented, clock):
    renter, host, instance = rented
    other = running(_funded(), host, num_gpus=1)
    _recheck(host, "rejected", None, code="verification_failed", gpu_index=None)
    assert {i.price_per_hour_micros for i in Instance.objects.filter(pk__in=[instance.pk, other.pk])} == {0}


def test_a_card_missing_from_a_recheck_cuts_no_renters_price(rented, clock):
    """Found walking the demo: a card fallen off the bus made the re-check reject the node for its GPU count, and
    that rejection cut every renter of the node to $0/h for good, the one whose card came back included. The card's
    holder is the GPU-loss rule's (interrupted, credited, unbilled while it is gone); the others lost nothing."""
    renter, host, instance = rented
    other = running(_funded(), host, num_gpus=1)
    _recheck(host, "rejected", None, code="gpu_count", gpu_index=None)
    assert Node.objects.get(pk=host.pk).verdict == "rejected"
    prices = dict(Instance.objects.filter(pk__in=[instance.pk, other.pk]).values_list("pk", "price_per_hour_micros"))
    assert prices == {instance.pk: 3_000_000, other.pk: 1_500_000}
    assert not BillingEvent.objects.filter(kind=EventKind.PRICE_CUT).exists()


def test_hardware_measured_better_again_raises_the_price_back_from_that_check_on(rented, clock):
    """Before, a cut was for good: a throttled card fixed, the renters paid the cut price for the rest of their
    rental. A check that measures the node as it was booked gives the provider its price back, from then on."""
    renter, host, instance = rented
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=True)
    _recheck(host, "degraded", 0.6)
    clock.advance(120)
    node_record_health(node_id=host.pk, ok=True)
    _recheck(host, "verified", 1.0)
    instance.refresh_from_db()
    assert instance.price_per_hour_micros == 3_000_000 and instance.price_per_gpu_hour_micros == 1_500_000
    assert instance.price_before_cut_per_gpu_hour_micros is None and instance.score_before_cut is None
    assert instance.billed_seconds == 180 and instance.cost_micros == 50_000 + 1_800_000 * 120 // 3600
    event = BillingEvent.objects.get(user=renter, kind=EventKind.PRICE_RAISED_BACK)
    assert "$3.00/h instead of $1.80/h" in event.message and "full price again" in event.message
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=True)
    usage_meter()
    instance.refresh_from_db()
    assert instance.cost_micros == 50_000 + 60_000 + 3_000_000 * 60 // 3600  # the booked price again


def test_the_price_follows_the_score_back_up_but_not_noise_nor_above_the_price_before_the_cut(rented, clock):
    renter, host, instance = rented
    _recheck(host, "degraded", 0.5)
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 1_500_000
    _recheck(host, "degraded", 0.8)  # 80 % of the score it was booked at
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 2_400_000
    _recheck(host, "degraded", 0.82)  # within the tolerance of what it pays: noise
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 2_400_000
    _recheck(host, "verified", 0.97)  # within the tolerance of the score before the cut: in full
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 3_000_000
    _recheck(host, "verified", 1.3)  # never above
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 3_000_000
    assert BillingEvent.objects.filter(user=renter, kind=EventKind.PRICE_RAISED_BACK).count() == 2


def test_a_rejections_full_cut_ends_when_the_node_passes_again_even_unmeasured(rented, clock):
    renter, host, instance = rented
    _recheck(host, "rejected", None, code="gpu_name", gpu_index=_gpu_indices(instance)[0])
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 0
    _recheck(host, "degraded", None)  # every GPU rented: nothing measured, but it passes again
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 3_000_000
    # A score cut is not undone by a check that measured nothing.
    _recheck(host, "degraded", 0.6)
    _recheck(host, "verified", None)
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 1_800_000


def test_after_a_rejection_the_next_measured_check_cuts_every_renter_alike(rented, clock):
    """Review: the rejection cut only the renter it named, and the next check, compared with the rejection's
    score, cut no one: the other renter paid in full for hardware measured at half speed."""
    renter, host, instance = rented
    other = running(_funded(), host, num_gpus=1)
    _recheck(host, "verified", 1.0)
    _recheck(host, "rejected", None, code="gpu_name", gpu_index=_gpu_indices(other)[0])
    _recheck(host, "degraded", 0.5)
    prices = dict(Instance.objects.filter(pk__in=[instance.pk, other.pk]).values_list("pk", "price_per_hour_micros"))
    assert prices == {instance.pk: 1_500_000, other.pk: 750_000}


def test_an_unmeasured_pass_ends_a_rejections_cut_but_not_a_score_cut_before_it(rented, clock):
    """Review: a score cut to 60 %, then a rejection's to nothing, then a pass that measured nothing: the price
    came back in full, where the last measure earns 60 %."""
    renter, host, instance = rented
    _recheck(host, "verified", 1.0)
    _recheck(host, "degraded", 0.6)
    _recheck(host, "rejected", None, code="gpu_name", gpu_index=_gpu_indices(instance)[0])
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 0
    _recheck(host, "verified", None)
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 1_800_000


def test_no_raise_while_the_nodes_health_checks_fail(rented, clock):
    """Review: raised while the node's checks failed, the new price reached back to its last healthy moment (the
    meter catches the gap up at the price of the moment). The next check that lists it raises it."""
    renter, host, instance = rented
    _recheck(host, "rejected", None, code="gpu_name", gpu_index=_gpu_indices(instance)[0])
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=False, error="[Errno 111] Connection refused")
    _recheck(host, "verified", 1.0)
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 0
    node_record_health(node_id=host.pk, ok=True)
    _recheck(host, "verified", 1.0)
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 3_000_000


def test_a_finding_names_the_renter_of_the_card_not_of_the_index_it_moved_to(rented, clock):
    """Review: a card gone, nvidia-smi numbers the others anew: GPU 1 of the inventory is the card of the row at
    index 2. The finding's renter is found by the card's UUID, as held before the inventory was stored; a MIG
    slice's own finding is about a free slice and names no renter."""
    from provisioning.services.verification import gpu_holders_by_uuid, renters_concerned

    renter, host, instance = rented
    for gpu in Gpu.objects.filter(node=host):
        Gpu.objects.filter(pk=gpu.pk).update(uuid=f"GPU-{gpu.index}")
    other = running(_funded(), host, num_gpus=1)
    theirs = f"GPU-{_gpu_indices(other)[0]}"
    holders = gpu_holders_by_uuid(host)
    assert holders[theirs] == {other.pk}
    inventory = {"gpus": [{"index": 0, "uuid": "GPU-0"}, {"index": 1, "uuid": theirs}]}
    finding = {"severity": "reject", "code": "gpu_name", "message": "x", "gpu_index": 1}
    assert renters_concerned(host, [finding], inventory, holders) == {other.pk}
    assert renters_concerned(host, [{**finding, "code": "mig_slice_memory", "gpu_index": 0}], inventory,
                             holders) == set()


def test_operators_see_interruptions_and_their_credits_in_the_admin(rented, clock, client):
    renter, host, instance = rented
    _fail_checks(host, 2)
    clock.advance(600)
    svc.instance_resume(instance_id=instance.pk)
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    page = client.get("/admin/marketplace/interruption/")
    assert page.status_code == 200
    assert b"The node stopped answering health checks" in page.content and b"0.50" in page.content
    detail = client.get(f"/admin/marketplace/instance/{instance.pk}/change/")
    assert detail.status_code == 200 and b"Resumed: the VM was intact" in detail.content


def test_a_price_cut_while_the_node_fails_its_checks_bills_no_further_than_its_last_healthy_moment(rented, clock):
    """A re-check's price cut closes the usage so far at the old price. It closed it at the moment of the cut, even
    while the node's latest health check had failed: the time since its last healthy probe was billed, and the
    interruption that followed could not take it back (billing stops at the last healthy moment, never before
    what was billed). Now it closes where the meter would (node_billable_until)."""
    renter, host, instance = rented
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=True)
    last_healthy = Node.objects.get(pk=host.pk).last_seen_at
    clock.advance(60)
    assert _fail_checks(host, 1) == []
    clock.advance(30)
    assert svc.instance_price_cut(instance_id=instance.pk, ratio=0.5, reason="lower score") is not None
    instance.refresh_from_db()
    assert instance.billed_until <= last_healthy and instance.billed_seconds == 60
    assert instance.price_per_hour_micros == 1_500_000
    clock.advance(30)
    assert _fail_checks(host, 1) == [instance.pk]
    instance.refresh_from_db()
    assert instance.billed_seconds == 60  # the outage was never billed, at either price
    assert Interruption.objects.get(instance=instance).started_at == last_healthy
