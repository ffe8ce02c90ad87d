"""A verification concluding while the renters of its node are stopped at zero balance, on real PostgreSQL with a
connection per thread. node_verify_conclude held the node's row FOR UPDATE and then, raising a cut renter's price
back, wanted the renter's billing profile; enforcement (balances_enforce) held that profile and stopped the renter's
instance on the node, whose stop job's foreign key to the node takes FOR KEY SHARE on its row, which FOR UPDATE
blocks. Each waited for the other and PostgreSQL aborted one ("deadlock detected": the stop at zero failed, or the
verification's result was lost). The node's row is now locked FOR NO KEY UPDATE (nothing changes its key): it still
serialises the node's writers and the bookings' FOR SHARE, and lets the inserts of the node's children through. And
the check takes its renters' billing profiles right after the node's row, before any of their instances, as
enforcement takes a profile before its instances (a second cycle, on the instance's row)."""
import threading
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.utils import timezone

from billing.models import BillingProfile
from billing.services.enforcement import balances_enforce
from billing.services.ledger import credit_grant, ledger_reverse
from marketplace.models import Gpu, Instance, Node
from marketplace.money import usd_to_micros
from marketplace.services.instances import pricing
from provisioning.models import Job, JobKind, VerificationRun
from provisioning.services.fleet_record import node_record_health
from provisioning.services.nodes import node_event
from provisioning.services.verification import node_verify_conclude
from tests.billing.helpers import node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _conclude(host, verdict: str, score: float | None, findings: list) -> VerificationRun:
    job = Job.objects.create(kind=JobKind.NODE_VERIFY, node=host, status="running",
                             deadline=timezone.now() + timedelta(days=1))
    return node_verify_conclude(job=job, verdict=verdict, score=score, inventory={}, findings=findings)


def _waiting_for_a_lock_or_done(thread: threading.Thread, seconds: float = 5) -> None:
    """Until a session of this database waits for a row lock, or `thread` has ended."""
    watcher = connections.create_connection("default")
    try:
        deadline = time.monotonic() + seconds
        with watcher.cursor() as cursor:
            while time.monotonic() < deadline and thread.is_alive():
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                               "AND datname = current_database()")
                if cursor.fetchone()[0]:
                    return
                time.sleep(0.05)
    finally:
        watcher.close()


def test_a_verification_raising_a_price_back_while_enforcement_stops_the_renter_does_not_deadlock(
        broker, monkeypatch):
    renter = UserFactory()
    booked_with, _ = credit_grant(user=renter, amount_micros=usd_to_micros(Decimal("3.00")), reason="test funds")
    host = node(price="1.500000", gpu_count=4)
    node_record_health(node_id=host.pk, ok=True)  # healthy: a listing check raises prices back
    cut = running(renter, host)
    billed = running(renter, host)  # at its full price: the renter burns money, so zero stops them
    card = Gpu.objects.filter(allocations__instance=cut).get()
    _conclude(host, "rejected", None, [{"severity": "reject", "code": "gpu_name", "message": "gpu_name measured",
                                        "gpu_index": card.index}])
    assert Instance.objects.get(pk=cut.pk).price_per_hour_micros == 0  # its card named: a full cut
    ledger_reverse(txn=booked_with, reason="credited by mistake")  # the balance is at zero

    holding, go = threading.Event(), threading.Event()
    real_lock = pricing.billing_profile_lock
    errors: dict[str, BaseException] = {}

    def lock_after_enforcement_holds_the_profile(**kwargs):
        holding.set()  # the verification holds the node's row here, and asks for the renter's profile next
        go.wait(10)
        return real_lock(**kwargs)

    monkeypatch.setattr(pricing, "billing_profile_lock", lock_after_enforcement_holds_the_profile)

    def verify():
        try:
            _conclude(host, "verified", 1.0, [])
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors["verify"] = exc
        finally:
            connection.close()

    def enforce():
        try:
            balances_enforce(now=timezone.now())
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors["enforce"] = exc
        finally:
            connection.close()

    v = threading.Thread(target=verify)
    e = threading.Thread(target=enforce)
    try:
        v.start()
        assert holding.wait(10)
        e.start()  # locks the profile, then stops the instances: their stop jobs name the node
        _waiting_for_a_lock_or_done(e)
        enforced_meanwhile = not e.is_alive()
        go.set()
        v.join(30)
        e.join(30)
    finally:
        go.set()
    assert not v.is_alive() and not e.is_alive(), "a transaction hung"
    assert not errors, {k: f"{type(v).__name__}: {v}" for k, v in errors.items()}
    # Enforcement waited for the check: the check takes its renters' profiles right after the node's row (the next
    # test's cycle), so the stop comes after it, not in a deadlock.
    assert not enforced_meanwhile
    # Both happened, in that order: the check was recorded and raised the cut price back, which at zero balance
    # gave the renter the raise's notice (billing.services.low_balance); enforcement then found it holding and
    # stopped nothing yet.
    assert set(Instance.objects.filter(pk__in=[cut.pk, billed.pk]).values_list("status", flat=True)) == {"running"}
    assert not Job.objects.filter(kind=JobKind.INSTANCE_STOP, instance_id__in=[cut.pk, billed.pk]).exists()
    assert BillingProfile.objects.get(user=renter).stop_not_before > timezone.now()
    assert VerificationRun.objects.filter(node=host).order_by("-pk").values_list("verdict", flat=True)[0] == "verified"
    assert Instance.objects.get(pk=cut.pk).price_per_hour_micros == 1_500_000


def test_the_node_lock_still_waits_for_a_booking_in_flight_and_no_longer_for_a_row_naming_the_node(broker):
    """What FOR NO KEY UPDATE keeps and what it lets go: a booking in flight holds the node's row FOR SHARE (its
    provider's change, its verification wait for it), while an insert naming the node (its FOR KEY SHARE) does not
    wait for the node's lock holder."""
    host = node()
    other = connections.create_connection("default")
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:  # a booking in flight (allocation._lock_node_for_booking)
            cursor.execute("SELECT id FROM marketplace_node WHERE id = %s FOR SHARE", [host.pk])
        with pytest.raises(OperationalError, match="lock timeout"), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '300ms'")
            Node.objects.select_for_update(no_key=True).get(pk=host.pk)
        other.rollback()
        with other.cursor() as cursor:  # a verification holding the node (node_verify_conclude's lock)
            cursor.execute("SELECT id FROM marketplace_node WHERE id = %s FOR NO KEY UPDATE", [host.pk])
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '300ms'")
            node_event(node=host, kind="a_row_naming_the_node", message="inserted while the node is locked")
        other.rollback()
    finally:
        other.close()


def test_a_check_that_cuts_a_renter_while_enforcement_stops_them_does_not_deadlock(broker, monkeypatch):
    """A second cycle, on the instance's row (found by review): a check scoring the node lower cuts each renter's
    price (the instance's lock), and its price-back pass then asks for the renter's billing profile; enforcement
    holds that profile and stops the instance. The check now takes its renters' profiles first, as enforcement
    does: enforcement waits for the check, and both complete."""
    renter = UserFactory()
    booked_with, _ = credit_grant(user=renter, amount_micros=usd_to_micros(Decimal("3.00")), reason="test funds")
    host = node(price="1.500000", gpu_count=4)
    Node.objects.filter(pk=host.pk).update(score=1.0)
    node_record_health(node_id=host.pk, ok=True)
    instance = running(renter, host)
    ledger_reverse(txn=booked_with, reason="credited by mistake")  # at zero: enforcement stops them

    holding, go = threading.Event(), threading.Event()
    real_lock = pricing.billing_profile_lock
    errors: dict[str, BaseException] = {}

    def pause_before_the_profile(**kwargs):
        holding.set()  # the check has cut the instance (its row locked) and asks for the renter's profile
        go.wait(10)
        return real_lock(**kwargs)

    monkeypatch.setattr(pricing, "billing_profile_lock", pause_before_the_profile)

    def run(name, work):
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors[name] = exc
        finally:
            connection.close()

    degraded = [{"severity": "degrade", "code": "bf16_tflops", "message": "half the datasheet's BF16"}]
    v = threading.Thread(target=run, args=("verify", lambda: _conclude(host, "degraded", 0.5, degraded)))
    e = threading.Thread(target=run, args=("enforce", lambda: balances_enforce(now=timezone.now())))
    try:
        v.start()
        assert holding.wait(10)
        e.start()
        _waiting_for_a_lock_or_done(e)
        go.set()
        v.join(30)
        e.join(30)
    finally:
        go.set()
    assert not v.is_alive() and not e.is_alive(), "a transaction hung"
    assert not errors, {k: f"{type(v).__name__}: {v}" for k, v in errors.items()}
    stopped = Instance.objects.get(pk=instance.pk)
    assert stopped.status == "stopping" and stopped.price_per_hour_micros == 750_000  # cut, then stopped at zero
