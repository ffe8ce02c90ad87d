"""Storage billing: volumes while they exist and stopped instances' disks, per second at the node's published
disk price, in balanced ledger transactions; the low-balance warning and the grace period count them."""
import pytest
from django.core import mail
from django.db.models import Sum

from billing.models import AccountKind, BillingEvent, Entry, LedgerTransaction, TransactionKind
from billing.services.ledger import earnings_balance
from billing.services.storage import storage_cost, storage_meter
from billing.tasks import usage_meter_tick
from marketplace.models import Image, Instance, Volume
from marketplace.models.host import SECONDS_PER_MONTH
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from provisioning.models import Job
from tests.billing.helpers import ED25519, balance, book, fund, node, run, running, start, stop, worker_done
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def tick(django_capture_on_commit_callbacks):
    def run_tick():
        with django_capture_on_commit_callbacks(execute=True):
            usage_meter_tick()
    return run_tick


def _volume(owner, on, size_gb=100) -> Volume:
    volume = volume_svc.volume_create(owner=owner, node_id=on.pk, size_gb=size_gb)
    return volume_svc.volume_mark_available(volume_id=volume.pk)


def _storage_entries(user, kind):
    return list(Entry.objects.filter(transaction__kind=TransactionKind.STORAGE, account__user=user,
                                     account__kind=kind).values_list("amount_micros", flat=True))


def test_a_volume_is_billed_per_second_at_its_nodes_disk_price_and_the_provider_earns_minus_the_fee(
        clock, user, tick):
    provider = UserFactory()
    on = node(provider=provider)
    on.disk_price_per_gb_month_micros = 250_000  # USD 0.25 per GB-month
    on.save()
    fund(user, "10")
    volume = _volume(user, on, size_gb=100)
    on.disk_price_per_gb_month_micros = 900_000  # a later price change does not reach the volume
    on.save()
    before = balance(user)
    clock.advance(3600)
    tick()
    clock.advance(1800)
    tick()
    volume.refresh_from_db()
    cost = 100 * 250_000 * 5400 // SECONDS_PER_MONTH  # floor over the whole 90 minutes (cumulative rounding)
    assert volume.billed_seconds == 5400 and volume.cost_micros == cost == 52_083
    assert before - balance(user) == cost
    fee = cost * 1500 // 10_000
    assert earnings_balance(user_id=provider.pk) == cost - fee
    for txn in LedgerTransaction.objects.filter(kind=TransactionKind.STORAGE):
        assert sum(txn.entries.values_list("amount_micros", flat=True)) == 0


def test_deleting_a_volume_ends_its_billing_at_the_request(clock, user, tick):
    fund(user, "10")
    on = node()
    volume = _volume(user, on, size_gb=10)
    clock.advance(600)
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    assert Job.objects.filter(volume=volume, kind="volume_delete", status="queued").exists()
    charged = balance(user)
    clock.advance(7200)
    tick()
    volume.refresh_from_db()
    assert volume.state == "deleting" and volume.billed_seconds == 600
    assert balance(user) == charged
    # The node refused (a VM still mounts it there): it exists, so it is billed again, from the refusal on, not
    # across the time the renter was told billing had stopped (r46c).
    volume_svc.volume_delete_refused(volume_id=volume.pk, message="in use")
    tick()
    volume.refresh_from_db()
    assert volume.state == "available" and volume.billed_seconds == 600
    clock.advance(60)
    tick()
    volume.refresh_from_db()
    assert volume.billed_seconds == 660


def test_a_failed_volume_costs_nothing(clock, user, tick):
    fund(user, "10")
    volume = volume_svc.volume_create(owner=user, node_id=node().pk, size_gb=10)
    volume_svc.volume_mark_failed(volume_id=volume.pk, message="no room")
    clock.advance(3600)
    tick()
    assert not LedgerTransaction.objects.filter(kind=TransactionKind.STORAGE).exists()


def test_a_stopped_instances_disk_is_billed_until_it_starts_again(clock, user, tick):
    fund(user, "20")
    on = node("1.000000")
    on.disk_price_per_gb_month_micros = 300_000
    on.save()
    instance = running(user, on)
    assert instance.disk_price_per_gb_month_micros == 300_000
    clock.advance(60)
    instance = stop(instance)
    clock.advance(1000)
    tick()
    clock.advance(234)  # the start closes the disk's billing at its moment, not the next tick
    instance = start(instance)
    instance.refresh_from_db()
    assert instance.disk_billed_seconds == 1234
    assert instance.disk_cost_micros == instance.disk_gb * 300_000 * 1234 // SECONDS_PER_MONTH > 0
    charged = sum(_storage_entries(user, AccountKind.CUSTOMER_WALLET))
    assert -charged == instance.disk_cost_micros
    clock.advance(3600)  # running: GPU time, no disk charge
    tick()
    instance.refresh_from_db()
    assert instance.disk_billed_seconds == 1234


def test_storage_counts_in_the_low_balance_warning_and_the_grace_period_deletes_unmounted_volumes(
        clock, user, tick, settings):
    settings.BILLING_LOW_BALANCE_WARNING_S = 3600
    settings.BILLING_GRACE_PERIOD_S = 2 * 86400
    settings.BILLING_DESTROY_WARNING_S = 86400
    on = node()
    on.disk_price_per_gb_month_micros = 1_000_000  # $1 per GB-month
    on.save()
    fund(user, "0.10")
    settings.BILLING_REQUIRE_FUNDS = False  # made when the balance held its hour (the funds check's rule)
    volume = _volume(user, on, size_gb=1000)  # $1000 a month: about $1.39 an hour, so $0.10 lasts ~4 minutes
    settings.BILLING_REQUIRE_FUNDS = True
    tick()
    low = BillingEvent.objects.get(user=user, kind="low_balance")
    # Said for a renter whose storage alone is billed (before: only "running instances are stopped").
    assert "2 days later stopped instances and volumes are deleted" in low.message
    clock.advance(600)
    tick()
    assert balance(user) <= 0
    clock.advance(86400 + 60)
    tick()
    warning = BillingEvent.objects.filter(user=user, kind="destroy_warning").get()
    assert volume.name in warning.message
    clock.advance(86400)
    tick()
    volume.refresh_from_db()
    assert volume.state == "deleting"
    assert Job.objects.filter(volume=volume, kind="volume_delete").exists()
    assert any("deleted" in m.body for m in mail.outbox)


def test_a_volume_an_instance_mounts_is_not_deleted_with_it_at_the_end_of_the_grace_period(clock, user, tick,
                                                                                           settings):
    settings.BILLING_GRACE_PERIOD_S = 86400
    fund(user, "1.00")
    on = node("1.000000")
    on.disk_price_per_gb_month_micros = 0  # the $1.00 is the GPU hour alone (storage counts in the funds check)
    on.save(update_fields=["disk_price_per_gb_month_micros"])
    volume = _volume(user, on, size_gb=10)
    instance, _ = svc.instance_create(renter=user, node_id=on.pk, num_gpus=1, image=Image.objects.get(
        slug="pytorch-2-5"), ssh_public_keys=[ED25519], volumes=[{"volume": volume.pk, "mount": "/data"}])
    instance = run(instance)
    clock.advance(3601)
    tick()  # at zero: stopped
    svc.instance_mark_stopped(instance_id=instance.pk)
    tick()  # the destroy warning (due at once: it comes a whole grace period before here), naming both
    clock.advance(86400 + 60)
    tick()
    instance.refresh_from_db()
    volume.refresh_from_db()
    # The instance is destroyed; the volume it mounts is not deleted while that instance is not gone.
    assert instance.status == "destroying" and volume.state == "available"


def test_a_stopped_disk_or_a_volume_removed_during_an_outage_is_not_billed_for_it(clock, user, tick):
    """The meter bills storage up to the node's last healthy moment; a destroy or a deletion asked for while the
    node is away closes there too, not at the request (before: the outage's hour billed at the destroy)."""
    fund(user, "20")
    on = node("1.000000")
    on.disk_price_per_gb_month_micros = 300_000
    on.save()
    instance = stop(running(user, on))
    volume = _volume(user, on, size_gb=10)
    clock.advance(600)
    on.last_seen_at = clock.now  # its last healthy answer; then an hour of silence
    on.state, on.health_failures = "offline", 60
    on.save(update_fields=["last_seen_at", "state", "health_failures"])
    clock.advance(3600)
    tick()
    instance.refresh_from_db()
    volume.refresh_from_db()
    assert instance.disk_billed_seconds == 600 and volume.billed_seconds == 600  # the meter, as before
    svc.instance_destroy(instance=instance)
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    instance.refresh_from_db()
    volume.refresh_from_db()
    assert instance.disk_billed_seconds == 600 and volume.billed_seconds == 600
    assert instance.disk_cost_micros == instance.disk_gb * 300_000 * 600 // SECONDS_PER_MONTH


def test_a_statement_counts_storage_as_storage_not_as_credits(clock, user, tick, client_for):
    """Storage charges were summed under "credits and corrections" (found by review): the sums were right, the
    label was not. Now the month has a storage total and its lines, and the closing balance adds up."""
    on = node()
    on.disk_price_per_gb_month_micros = 250_000
    on.save()
    fund(user, "10")
    _volume(user, on, size_gb=100)
    clock.advance(3600)
    tick()
    api = client_for(user)
    month = f"{clock.now:%Y-%m}"
    statement = api.get(f"/api/v1/billing/statements/{month}/").json()
    charged = 100 * 250_000 * 3600 // SECONDS_PER_MONTH
    assert statement["storage"] == f"{charged / 1e6:.6f}" and statement["adjustments"] == "10.000000"  # the fund
    assert [line["kind"] for line in statement["storage_lines"]] == ["storage"]
    # Each line is what was charged, as the storage total and the usage lines say it (it was the signed entry).
    assert statement["storage_lines"][0]["amount"] == statement["storage"]
    assert [line["kind"] for line in statement["adjustment_lines"]] == ["credit"]
    opening, adjustments, closing = (int(round(float(statement[k]) * 1e6))
                                     for k in ("opening_balance", "adjustments", "closing_balance"))
    assert closing == opening + adjustments - charged == balance(user)
    (summary,) = api.get("/api/v1/billing/statements/").json()
    assert summary["storage"] == statement["storage"] and summary["closing_balance"] == statement["closing_balance"]


def _run_reporting(instance, disk_gb: int):
    """requested/starting → running, the node answering that the VM has a `disk_gb` GB disk."""
    instance.refresh_from_db()
    if instance.status in ("requested", "provisioning"):
        svc.instance_mark_provisioning(instance_id=instance.pk)
    instance = svc.instance_mark_running(instance_id=instance.pk, ssh_host="10.0.0.1", ssh_port=40001,
                                         ssh_user="root", vm={"disk_gb": disk_gb})
    worker_done(instance)
    return instance


def _disk_paid(user, instance) -> int:
    return -(Entry.objects.filter(transaction__kind=TransactionKind.STORAGE, account__user=user,
                                  transaction__memo__startswith=f"Instance {instance.pk}'s disk")
             .aggregate(t=Sum("amount_micros"))["t"] or 0)


@pytest.mark.parametrize("reported_gb", [60000, 5])
def test_a_stopped_disk_is_billed_at_the_booked_size_whatever_size_its_node_reports(clock, user, reported_gb):
    """The node (the provider's) answered a start with another disk size, which became the billed one over the
    disk's whole stopped past (found by review: 60000 GB reported after ten days stopped at 50 GB charged about
    $2,000 for the next stopped second; a smaller size gave a negative amount, not posted, yet added to the row)."""
    on = node("1.000000")
    on.disk_price_per_gb_month_micros = 100_000
    on.save()
    fund(user, "500")
    instance = book(user, on)
    booked = instance.disk_gb
    instance = stop(_run_reporting(instance, booked))
    clock.advance(hours=24 * 10)  # ten days stopped at the booked size
    storage_meter()
    svc.instance_start(instance=instance)
    instance = stop(_run_reporting(instance, reported_gb))
    assert Instance.objects.get(pk=instance.pk).disk_gb == booked
    clock.advance(60)
    before = balance(user)
    storage_meter()
    instance.refresh_from_db()
    assert instance.disk_gb == booked
    assert before - balance(user) <= storage_cost(size_gb=booked, price_per_gb_month_micros=100_000, seconds=61) + 1
    assert instance.disk_cost_micros == storage_cost(size_gb=booked, price_per_gb_month_micros=100_000,
                                                     seconds=instance.disk_billed_seconds)
    assert instance.disk_cost_micros == _disk_paid(user, instance) > 0


def test_a_volume_deleted_while_its_node_is_healthy_is_billed_up_to_the_request(clock, user):
    """GPU time closes at the request while the node answers (node_billable_until); storage closed at the last
    health check even on a healthy node, so each deletion, start or destroy dropped up to a health interval
    (found by review)."""
    on = node()
    on.disk_price_per_gb_month_micros = 1_000_000
    on.last_seen_at = clock.now
    on.health_failures = 0
    on.save()
    fund(user, "50")
    volume = _volume(user, on, size_gb=1000)
    clock.advance(60)
    on.last_seen_at = clock.now  # a health check passes every minute
    on.save(update_fields=["last_seen_at"])
    clock.advance(45)  # the renter deletes the volume 45 s after the last (healthy) check
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    volume.refresh_from_db()
    assert volume.billed_seconds == 105


def test_a_stopped_disk_started_while_its_node_is_healthy_is_billed_up_to_the_start(clock, user):
    fund(user, "20")
    on = node("1.000000")
    on.disk_price_per_gb_month_micros = 300_000
    on.last_seen_at = clock.now
    on.save()
    instance = stop(running(user, on))
    clock.advance(50)
    on.last_seen_at = clock.now
    on.save(update_fields=["last_seen_at"])
    clock.advance(40)
    svc.instance_start(instance=instance)
    instance.refresh_from_db()
    assert instance.disk_billed_seconds == 90
