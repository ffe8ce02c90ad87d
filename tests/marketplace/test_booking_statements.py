"""A booking's statements (marketplace/services/instances/allocation.py): the node's share lock and the wallet's lock
in one round trip, node first; the committed burn rate, the instance, its GPUs and its job in another; with volumes,
the wallet after them. The lock order is what keeps bookings free of deadlocks with each other and with the meter."""
import threading
import time

import psycopg
import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from billing.models import Account, AccountKind
from marketplace.models import GpuAllocation, Image, Instance, Volume
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from marketplace.services.instances.allocation import _lock_node_for_booking
from provisioning.models import Job
from tests.billing.helpers import ED25519, fund
from tests.factories import UserFactory, make_listed_node

from .renting_helpers import sent_jobs_fixture  # noqa: F401 (the fixture)

pytestmark = pytest.mark.django_db


def _other_connection() -> psycopg.Connection:
    return psycopg.connect(**connection.get_connection_params(), autocommit=False)


def _locked_elsewhere(sql: str, params: list) -> bool:
    """Whether a third connection finds the row locked (NOWAIT): what the blocked booking holds so far."""
    with _other_connection() as probe:
        try:
            probe.execute(sql, params)
        except psycopg.errors.LockNotAvailable:
            return True
        finally:
            probe.rollback()
    return False


def _wallet(user) -> Account:
    return Account.objects.get(kind=AccountKind.CUSTOMER_WALLET, user=user)


def _read_in_thread(node_id: int, renter_id: int) -> tuple[threading.Thread, dict]:
    """_lock_node_for_booking with the wallet, in a transaction of its own that ends when `out['release']` is set."""
    out: dict = {"release": threading.Event()}

    def run():
        try:
            with transaction.atomic():
                node = _lock_node_for_booking(node_id, count_gpus=True, wallet_of=renter_id)
                out["balance"] = node.wallet_balance_micros
                out["read"] = True
                out["release"].wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _wait_until_blocked(out: dict) -> None:
    time.sleep(0.3)  # long enough for the statement to reach its lock wait
    assert "read" not in out, "the read went through a lock that another transaction held"


@pytest.mark.django_db(transaction=True)
def test_the_node_is_locked_before_the_wallet():
    renter = UserFactory()
    fund(renter, "10.00")
    node = make_listed_node(gpu_count=1)
    wallet = _wallet(renter)
    # The wallet held elsewhere: the read waits for it, and holds the node's share lock meanwhile.
    with _other_connection() as holder:
        holder.execute("SELECT 1 FROM billing_account WHERE id = %s FOR UPDATE", [wallet.pk])
        thread, out = _read_in_thread(node.pk, renter.pk)
        _wait_until_blocked(out)
        assert _locked_elsewhere("SELECT 1 FROM marketplace_node WHERE id = %s FOR UPDATE NOWAIT", [node.pk])
        holder.rollback()
    out["release"].set()
    thread.join(10)
    assert out.get("balance") == 10_000_000
    # The node held elsewhere: the read waits for it, and has not locked the wallet yet.
    with _other_connection() as holder:
        holder.execute("SELECT 1 FROM marketplace_node WHERE id = %s FOR UPDATE", [node.pk])
        thread, out = _read_in_thread(node.pk, renter.pk)
        _wait_until_blocked(out)
        assert not _locked_elsewhere("SELECT 1 FROM billing_account WHERE id = %s FOR UPDATE NOWAIT", [wallet.pk])
        holder.rollback()
    out["release"].set()
    thread.join(10)
    assert out.get("read")
    connection.close()


def test_a_renter_without_a_wallet_row_reads_a_balance_of_zero():
    renter = UserFactory()
    node = make_listed_node(gpu_count=1)
    assert not Account.objects.filter(user=renter).exists()
    with transaction.atomic():
        assert _lock_node_for_booking(node.pk, count_gpus=True, wallet_of=renter.pk).wallet_balance_micros == 0
        assert _lock_node_for_booking(node.pk + 10_000, count_gpus=True, wallet_of=renter.pk) is None


def test_short_of_funds_after_the_one_statement_booking_leaves_nothing_behind(settings, sent_jobs):
    """The funds check comes after the statement that wrote the instance, its GPUs and its job: the 402 rolls all
    of it back, and nothing is sent."""
    settings.BILLING_REQUIRE_FUNDS = True
    renter = UserFactory()
    fund(renter, "1.00")
    node = make_listed_node(gpu_count=2)  # the factory's price: more than $1.00 an hour for two GPUs
    with pytest.raises(svc.InsufficientFunds):
        svc.instance_create(renter=renter, node_id=node.pk, num_gpus=2, image=Image.objects.get(slug="cuda-12-4"),
                            ssh_public_keys=[ED25519])
    assert not Instance.objects.exists() and not Job.objects.exists() and not GpuAllocation.objects.exists()
    assert not node.gpus.exclude(status="free").exists() and sent_jobs == []


def test_a_booking_with_volumes_locks_the_wallet_after_them(settings):
    settings.BILLING_REQUIRE_FUNDS = True
    renter = UserFactory()
    fund(renter, "100.00")
    node = make_listed_node(gpu_count=1)
    volume = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=renter, node_id=node.pk, size_gb=10).pk)
    with CaptureQueriesContext(connection) as captured:
        instance, _ = svc.instance_create(renter=renter, node_id=node.pk, num_gpus=1,
                                          image=Image.objects.get(slug="cuda-12-4"), ssh_public_keys=[ED25519],
                                          volumes=[{"volume": volume.pk, "mount": "/data"}])
    sql = [q["sql"] for q in captured.captured_queries]
    node_at = next(i for i, s in enumerate(sql) if "FOR SHARE OF n" in s)
    volume_at = next(i for i, s in enumerate(sql) if Volume._meta.db_table in s and "FOR UPDATE" in s)
    wallet_at = next(i for i, s in enumerate(sql) if "billing_account" in s and "FOR UPDATE" in s)
    assert node_at < volume_at < wallet_at, sql
    assert "billing_account" not in sql[node_at]
    assert instance.volume_mounts.get().volume == volume
    assert Job.objects.filter(instance=instance, kind="instance_provision").count() == 1


def test_a_mig_booking_is_the_same_four_round_trips(settings):
    """Slices as GPUs: the node and wallet in one statement; the rate, the instance, its slices (their GPUs' rows
    under a share lock) and its job in the other."""
    from .mig_helpers import SEVEN, make_mig_node

    settings.BILLING_REQUIRE_FUNDS = True
    renter = UserFactory()
    fund(renter, "100.00")
    node = make_mig_node({0: SEVEN})
    with CaptureQueriesContext(connection) as captured:
        instance, _ = svc.instance_create(renter=renter, node_id=node.pk, num_gpus=2, mig_profile="1g.10gb",
                                          image=Image.objects.get(slug="cuda-12-4"), ssh_public_keys=[ED25519])
    statements = [q["sql"].split(None, 1)[0].upper() for q in captured.captured_queries]
    # In this test's own transaction the booking's is a savepoint; before it, the renter's e-mail check.
    assert statements[-4:] == ["SAVEPOINT", "WITH", "WITH", "RELEASE"], statements
    booking = captured.captured_queries[-2]["sql"]
    assert "parents AS (SELECT id FROM" in booking and 'INSERT INTO "marketplace_migsliceallocation"' in booking
    assert instance.slice_allocations.filter(released_at=None).count() == 2
    assert Job.objects.filter(instance=instance, kind="instance_provision").count() == 1
