"""Starting a stopped instance while the meter bills the same renter (found by review). instance_start locked the
renter's wallet first (its funds check), then, in the same transaction, billed the stopped disk, whose posting
locks the provider's earnings and the platform's revenue account: lower ids than the wallet, so out of id order.
The tick, billing another instance of the renter, locks revenue, earnings, wallet in id order: each waited for the
other and PostgreSQL aborted the tick (its whole batch rolled back, that minute's storage meter and balance
enforcement skipped). Now the disk is billed first, in id order with the rest."""
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.utils import timezone

from billing.models import AccountKind
from billing.services import storage
from billing.services.ledger import platform_account
from billing.services.metering import usage_meter
from marketplace.models import Instance
from marketplace.services import instances as svc
from tests.billing.helpers import fund, node, running, stop
from tests.factories import UserFactory


@pytest.mark.django_db(transaction=True)
def test_starting_a_stopped_instance_while_the_meter_bills_the_renter_does_not_deadlock():
    platform_account(kind=AccountKind.PLATFORM_REVENUE)  # as in any live system: long before this renter's wallet
    renter = UserFactory()
    fund(renter, 100)
    y = running(renter, node())  # billed by the tick (fee > 0: the revenue account is in its lock set)
    x = stop(running(renter, node()))
    Instance.objects.filter(pk=x.pk).update(stopped_at=timezone.now() - timedelta(hours=1))  # an hour of disk to bill

    holding, go = threading.Event(), threading.Event()
    real_post = storage._post
    errors: dict[str, BaseException] = {}

    def post_after_the_tick_waits(**kwargs):
        holding.set()  # instance_start holds the wallet's lock (its funds check) here
        go.wait(10)
        return real_post(**kwargs)

    storage._post = post_after_the_tick_waits

    def start():
        try:
            svc.instance_start(instance=Instance.objects.get(pk=x.pk))
        except BaseException as exc:  # noqa: BLE001
            errors["start"] = exc
        finally:
            connection.close()

    def tick():
        try:
            usage_meter(now=timezone.now() + timedelta(seconds=120))
        except BaseException as exc:  # noqa: BLE001
            errors["tick"] = exc
        finally:
            connection.close()

    s = threading.Thread(target=start)
    t = threading.Thread(target=tick)
    try:
        s.start()
        assert holding.wait(10)
        t.start()
        watcher = connections.create_connection("default")
        try:
            deadline = time.monotonic() + 5
            with watcher.cursor() as cursor:
                while time.monotonic() < deadline:  # the tick waits for the wallet's lock
                    cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                   "AND datname = current_database()")
                    if cursor.fetchone()[0]:
                        break
                    time.sleep(0.05)
        finally:
            watcher.close()
        go.set()
        s.join(20)
        t.join(20)
    finally:
        go.set()
        storage._post = real_post
    assert not errors, {k: f"{type(v).__name__}: {v}" for k, v in errors.items()}
    assert Instance.objects.get(pk=x.pk).status == "starting"
    assert Instance.objects.get(pk=y.pk).billed_seconds > 0
