"""Metering: per-second charges at the booking's price snapshot, cumulative rounding, the final interval of
each run, idempotency under repeats, concurrency and crashes, and both ways of running the tick."""
import threading
from decimal import Decimal

import pytest
from django.db import connection, connections, transaction

from billing.models import Account, AccountKind, LedgerTransaction, UsageInterval
from billing.services import metering
from billing.services.metering import cost_for, fee_for, usage_meter
from marketplace.models import Instance, Node
from marketplace.services import instances as svc
from tests.billing.helpers import balance, book, fund, node, run, running, start, stop
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PRICE = "1.234567"  # per GPU-hour: 342.935277… µ$ a second, so every tick rounds


def _revenue() -> int:
    revenue = Account.objects.filter(kind=AccountKind.PLATFORM_REVENUE)
    return revenue.values_list("balance_micros", flat=True).first() or 0


def _earnings(user) -> int:
    return (Account.objects.filter(kind=AccountKind.PROVIDER_EARNINGS, user=user)
            .values_list("balance_micros", flat=True).first() or 0)


def test_a_tick_charges_whole_seconds_at_the_snapshot_price_and_splits_the_fee(clock):
    renter, provider = UserFactory(), UserFactory()
    fund(renter, "100")
    instance = running(renter, node(PRICE, provider=provider), num_gpus=2)
    assert instance.platform_fee_bps == 1500 and instance.price_per_hour_micros == 2_469_134
    clock.advance(61.7)
    result = usage_meter()
    assert (result.instances, result.intervals) == (1, 1)
    interval = UsageInterval.objects.get()
    assert interval.seconds == 61 and interval.started_at == instance.started_at
    cost = cost_for(2_469_134, 61)
    assert interval.amount_micros == cost == 41_838
    assert interval.fee_micros == fee_for(cost, 1500) == 6_275
    assert balance(renter) == 100_000_000 - cost
    assert _earnings(provider) == cost - 6_275
    assert _revenue() == 6_275


@pytest.mark.parametrize("set_based", [True, False])
def test_totals_do_not_depend_on_how_often_the_meter_runs(clock, set_based):
    renter = UserFactory()
    fund(renter, "1000")
    on = node(PRICE)
    every_second, every_minute, once = (running(renter, on) for _ in range(3))
    # The meter sees only every_second, and every_minute too each 60th second: the others are hidden (as
    # "stopping") from the first tick to the last, and every_minute shown for its ticks only.
    hidden = Instance.objects.filter(pk__in=[every_minute.pk, once.pk])
    hidden.update(status="stopping")
    for second in range(1, 300):
        clock.advance(1)
        if second % 60 == 0:
            Instance.objects.filter(pk=every_minute.pk).update(status="running")
        usage_meter(set_based=set_based)
        if second % 60 == 0:
            Instance.objects.filter(pk=every_minute.pk).update(status="stopping")
    hidden.update(status="running")
    clock.advance(1)
    usage_meter(set_based=set_based)
    totals = {i.pk: (i.billed_seconds, i.cost_micros) for i in Instance.objects.all()}
    assert totals[every_second.pk] == totals[every_minute.pk] == totals[once.pk] == (300, cost_for(1_234_567, 300))
    assert UsageInterval.objects.filter(instance=every_second).count() == 300
    assert UsageInterval.objects.filter(instance=once).count() == 1


def test_the_set_based_tick_and_the_per_instance_tick_agree(clock):
    renter = UserFactory()
    fund(renter, "1000")
    on = node(PRICE, gpu_count=8)
    instances = [running(renter, on, n) for n in (1, 2, 3)]
    clock.advance(0.4)
    run(instances[0])  # an address update: not a new run
    clock.advance(95.3)
    usage_meter(set_based=True)
    after_sql = {i.pk: (i.billed_until, i.billed_seconds, i.cost_micros) for i in Instance.objects.all()}
    clock.advance(30)
    usage_meter(set_based=False)
    clock.advance(30)
    usage_meter(set_based=True)
    for instance in Instance.objects.all():
        assert after_sql[instance.pk][1] == 95
        assert instance.billed_seconds == 155
        assert instance.cost_micros == cost_for(instance.price_per_hour_micros, 155)
    keys = set(LedgerTransaction.objects.values_list("idempotency_key", flat=True))
    for interval in UsageInterval.objects.all():
        assert metering.usage_key(interval.instance_id, interval.started_at) in keys


def test_running_the_tick_twice_adds_nothing(clock):
    renter = UserFactory()
    fund(renter, "100")
    running(renter, node(PRICE))
    clock.advance(90)
    assert usage_meter().intervals == 1
    assert usage_meter().intervals == 0
    assert usage_meter(set_based=False).intervals == 0
    clock.advance(0.9)  # not a whole second more
    assert usage_meter().intervals == 0
    assert UsageInterval.objects.count() == 1 and LedgerTransaction.objects.filter(kind="usage").count() == 1


def test_stop_restart_destroy_and_failure_close_the_last_interval_and_stop_the_clock(clock):
    renter = UserFactory()
    fund(renter, "100")
    on = node(PRICE, gpu_count=4)
    a, b, c, d = (running(renter, on) for _ in range(4))
    clock.advance(30.6)
    svc.instance_stop(instance=a)
    svc.instance_restart(instance=b)
    svc.instance_destroy(instance=c)
    svc.instance_mark_failed(instance_id=d.pk, message="the node is gone")
    for instance in (a, b, c, d):
        instance.refresh_from_db()
        assert instance.billed_seconds == 30 and instance.cost_micros == cost_for(1_234_567, 30)
    clock.advance(300)
    usage_meter()  # none of them is running: nothing more
    assert UsageInterval.objects.count() == 4
    svc.instance_mark_stopped(instance_id=a.pk)
    clock.advance(10)
    run(b)  # the restart finished: billing resumes from now, not from the restart
    clock.advance(20.5)
    usage_meter()
    b.refresh_from_db()
    assert b.billed_seconds == 50
    last = b.usage_intervals.order_by("started_at").last()
    assert last.started_at == b.started_at and last.seconds == 20


def test_a_failed_provisioning_bills_nothing(clock):
    renter = UserFactory()
    fund(renter, "100")
    instance = book(renter, node(PRICE))
    svc.instance_mark_provisioning(instance_id=instance.pk)
    clock.advance(600)
    usage_meter()
    svc.instance_mark_failed(instance_id=instance.pk, message="the image did not pull")
    assert not UsageInterval.objects.exists()
    assert balance(renter) == 100_000_000


def test_stopped_instances_are_not_charged_and_a_new_run_is_billed_from_its_start(clock):
    renter = UserFactory()
    fund(renter, "100")
    instance = running(renter, node(PRICE))
    clock.advance(100)
    stop(instance)
    clock.advance(3600)  # stopped for an hour: no GPU time; its disk is billed apart (billing.services.storage)
    usage_meter()
    instance = start(instance)
    clock.advance(50)
    usage_meter()
    instance.refresh_from_db()
    assert instance.billed_seconds == 150
    assert instance.cost_micros == cost_for(1_234_567, 150)
    starts = list(instance.usage_intervals.order_by("started_at").values_list("started_at", "seconds"))
    assert starts[-1] == (instance.started_at, 50)


def test_a_price_or_fee_change_after_booking_changes_nothing_booked(clock, settings):
    renter = UserFactory()
    fund(renter, "100")
    on = node("2.000000")
    running(renter, on)
    Node.objects.filter(pk=on.pk).update(price_per_gpu_hour_micros=9_000_000)
    settings.PLATFORM_FEE_PERCENT = Decimal("40")
    clock.advance(3600)
    usage_meter()
    interval = UsageInterval.objects.get()
    assert interval.amount_micros == 2_000_000 and interval.fee_micros == 300_000
    assert interval.price_per_hour_micros == 2_000_000 and interval.platform_fee_bps == 1500
    newer = running(renter, on)
    assert newer.price_per_hour_micros == 9_000_000 and newer.platform_fee_bps == 4000


def test_cost_so_far_includes_the_seconds_not_metered_yet(clock, api):
    fund(api.user, "100")
    instance = running(api.user, node("3.600000"))  # 1000 µ$ a second
    clock.advance(42.9)
    body = api.get(f"/api/v1/instances/{instance.pk}/").json()
    assert body["cost_so_far"] == "0.042000" and body["platform_fee_percent"] == "15.00"
    usage_meter()
    clock.advance(8)
    assert api.get(f"/api/v1/instances/{instance.pk}/").json()["cost_so_far"] == "0.050000"
    svc.instance_stop(instance=instance)
    clock.advance(1000)
    assert api.get(f"/api/v1/instances/{instance.pk}/").json()["cost_so_far"] == "0.050000"


def test_a_crash_inside_a_tick_writes_nothing_and_the_next_tick_bills_every_second(clock, monkeypatch):
    renter = UserFactory()
    fund(renter, "100")
    on = node(PRICE)
    instances = [running(renter, on) for _ in range(3)]
    clock.advance(70)
    statements = metering._statements(metering._POST)
    crash_at = next(i for i, s in enumerate(statements) if "INSERT INTO" in s and "usageinterval" in s)

    def crashing(sql):
        out = statements[:crash_at] + ["SELECT 1/0"]
        return out if sql is metering._POST else metering_statements(sql)

    metering_statements = metering._statements
    with monkeypatch.context() as patch, pytest.raises(Exception, match="division by zero"):
        patch.setattr(metering, "_statements", crashing)
        usage_meter()
    assert not UsageInterval.objects.exists() and not LedgerTransaction.objects.filter(kind="usage").exists()
    assert balance(renter) == 100_000_000
    clock.advance(10)
    usage_meter()
    for instance in instances:
        instance.refresh_from_db()
        assert instance.billed_seconds == 80


def test_a_crash_in_the_final_interval_leaves_the_instance_running_and_unbilled(clock, monkeypatch):
    renter = UserFactory()
    fund(renter, "100")
    instance = running(renter, node(PRICE))
    clock.advance(30)

    def boom(**kwargs):
        raise RuntimeError("crash between the ledger and the interval")

    with monkeypatch.context() as patch, pytest.raises(RuntimeError):
        patch.setattr("billing.models.UsageInterval.objects.create", boom)
        svc.instance_stop(instance=instance)
    instance.refresh_from_db()
    assert instance.status == "running" and instance.billed_seconds == 0
    assert not LedgerTransaction.objects.filter(kind="usage").exists()
    svc.instance_stop(instance=instance)
    instance.refresh_from_db()
    assert instance.status == "stopping" and instance.billed_seconds == 30


def test_a_tick_skips_when_another_holds_the_lock(clock):
    renter = UserFactory()
    fund(renter, "100")
    running(renter, node(PRICE))
    clock.advance(60)
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [metering.ADVISORY_LOCK_KEY])
            assert usage_meter().skipped
            cursor.execute("SELECT pg_advisory_unlock(%s)", [metering.ADVISORY_LOCK_KEY])
    finally:
        other.close()
    assert usage_meter().intervals == 1


@pytest.mark.django_db(transaction=True)
def test_two_workers_at_once_charge_each_second_once(clock):
    renter = UserFactory()
    fund(renter, "1000")
    on = node(PRICE, gpu_count=8)
    instances = [running(renter, on) for _ in range(8)]
    clock.advance(120)
    barrier = threading.Barrier(4)
    errors = []

    def worker(set_based):
        try:
            barrier.wait(5)
            usage_meter(set_based=set_based)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(sb,)) for sb in (True, True, False, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    for instance in instances:
        instance.refresh_from_db()
        assert instance.billed_seconds == 120
    assert UsageInterval.objects.count() == 8


@pytest.mark.django_db(transaction=True)
def test_a_stop_during_a_tick_neither_loses_nor_doubles_seconds(clock):
    """The tick skips the row a stop holds (SKIP LOCKED); the stop's final interval bills it."""
    renter = UserFactory()
    fund(renter, "1000")
    on = node(PRICE, gpu_count=8)
    held, free = running(renter, on), running(renter, on)
    clock.advance(45)
    locked, release = threading.Event(), threading.Event()

    def stopper():
        try:
            with transaction.atomic():
                Instance.objects.select_for_update().get(pk=held.pk)
                locked.set()
                release.wait(10)
                svc.instance_stop(instance=held)
        finally:
            connection.close()

    t = threading.Thread(target=stopper)
    t.start()
    locked.wait(5)
    result = usage_meter()
    release.set()
    t.join(10)
    assert result.instances == 1
    for instance in (held, free):
        instance.refresh_from_db()
        assert instance.billed_seconds == 45
