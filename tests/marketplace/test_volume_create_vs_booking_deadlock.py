"""A renter creating a volume on one node while booking an instance on another, with funds required (the default),
on real PostgreSQL with a connection per thread. The volume's create locked the renter's user row FOR UPDATE (one
create of theirs at a time), then their wallet for the funds check; the booking locks the wallet with its node, then
inserts the instance, whose foreign key to the renter takes FOR KEY SHARE on that user row, which FOR UPDATE
blocks. Each waited for the other and PostgreSQL aborted one ("deadlock detected"). The create now locks the row FOR
NO KEY UPDATE: two creates of one renter still run one after the other, and the booking's insert goes through."""
import threading
import time
from decimal import Decimal

import pytest
from django.db import connection, connections

from billing.services.ledger import credit_grant
from marketplace.models import Instance, Volume
from marketplace.money import usd_to_micros
from marketplace.services import volumes as volume_svc
from tests.billing.helpers import book, node
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


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


def test_creating_a_volume_while_booking_on_another_node_does_not_deadlock(settings, monkeypatch):
    settings.BILLING_REQUIRE_FUNDS = True
    renter = UserFactory()
    credit_grant(user=renter, amount_micros=usd_to_micros(Decimal("100")), reason="test funds")
    for_the_volume, for_the_instance = node(), node()

    holding, go = threading.Event(), threading.Event()
    real_funds_for = volume_svc.funds_for
    errors: dict[str, BaseException] = {}
    made: dict[str, object] = {}

    def funds_after_the_booking_holds_the_wallet(**kwargs):
        holding.set()  # the create holds the node's row and the renter's here, and asks for the wallet next
        go.wait(10)
        return real_funds_for(**kwargs)

    monkeypatch.setattr(volume_svc, "funds_for", funds_after_the_booking_holds_the_wallet)

    def create_volume():
        try:
            made["volume"] = volume_svc.volume_create(owner=renter, node_id=for_the_volume.pk, size_gb=10)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors["volume"] = exc
        finally:
            connection.close()

    def book_instance():
        try:
            made["instance"] = book(renter, for_the_instance)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors["booking"] = exc
        finally:
            connection.close()

    v = threading.Thread(target=create_volume)
    b = threading.Thread(target=book_instance)
    try:
        v.start()
        assert holding.wait(10)
        b.start()  # locks the wallet with its node, then inserts the instance naming the renter
        _waiting_for_a_lock_or_done(b)
        booked_meanwhile = not b.is_alive()
        go.set()
        v.join(30)
        b.join(30)
    finally:
        go.set()
    assert not v.is_alive() and not b.is_alive(), "a transaction hung"
    assert not errors, {k: f"{type(v).__name__}: {v}" for k, v in errors.items()}
    assert booked_meanwhile  # the booking went through while the create held the renter's row
    assert Volume.objects.filter(owner=renter, node=for_the_volume).count() == 1
    assert Instance.objects.filter(renter=renter, node=for_the_instance).count() == 1
