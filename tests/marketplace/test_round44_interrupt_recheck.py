"""node_instances_interrupt (marketplace.services.instances) picks a node's running instances (those whose VM is in
`vm_ids`, and, with `started_before`, those whose current run began before the probe that found the loss) by a read
that takes no lock, then interrupts each. Every condition it picked an instance by must hold still under the
instance's row lock, in the transaction that interrupts it: it asked only "still running?" there, so a renter's
restart that finished in between (the probe caught the VM mid-restart) left the instance running, started after
the probe, and it was interrupted all the same, its renter told and credited at the provider's expense, for a VM
that runs. The health check's own copy of this was fixed in ccdc738 (fleet_record._vms_lost_interrupt); this is the
service every caller shares. And two interrupters at once (a health check and a quarantine) interrupt and credit an
instance once.

Real parts: PostgreSQL, the renter's restart and the worker's "running" run through the services on a connection of
their own, committed between the unlocked read and the interruption."""
import threading
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.utils import timezone

from billing.models import BillingEvent, EventKind, LedgerTransaction, TransactionKind
from marketplace.models import Instance, InstanceStatus, Interruption, InterruptionCause
from marketplace.services import instances as svc
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401 (the sent_jobs fixture)

pytestmark = pytest.mark.django_db(transaction=True)


def _in_another_connection(action) -> None:
    """`action` on a connection of its own (another worker), committed before this returns."""
    errors = []

    def target():
        try:
            action()
        except Exception as exc:  # noqa: BLE001 (handed back to the test)
            errors.append(exc)
        finally:
            connections.close_all()
    worker = threading.Thread(target=target)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and not errors, errors


def _right_after_the_unlocked_read(then):
    """A query wrapper: `then()` once, right after the first read of the node's running instances that takes no row
    lock (the list node_instances_interrupt acts on)."""
    done = []

    def wrapper(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if (not done and 'FROM "marketplace_instance"' in sql and '"status" =' in sql and "FOR UPDATE" not in sql
                and '"node_id" =' in sql):
            done.append(True)
            then()
        return result
    return wrapper, done


def _running_since(node, minutes: int) -> Instance:
    instance = run(book(UserFactory(), node))
    Instance.objects.filter(pk=instance.pk).update(started_at=timezone.now() - timedelta(minutes=minutes))
    return Instance.objects.get(pk=instance.pk)


def _restart(instance: Instance) -> None:
    """The renter's restart, asked and finished (the worker found the VM running again)."""
    svc.instance_restart(instance=Instance.objects.get(pk=instance.pk))
    svc.instance_mark_running(instance_id=instance.pk, ssh_host="10.0.0.1", ssh_port=40001, ssh_user="root")


def _credits(instance: Instance) -> int:
    return LedgerTransaction.objects.filter(kind=TransactionKind.SERVICE_CREDIT,
                                            memo__startswith=f"Instance {instance.pk} interrupted").count()


def _told(instance: Instance) -> int:
    return BillingEvent.objects.filter(kind=EventKind.INSTANCE_INTERRUPTED, data__instance=instance.pk).count()


def test_an_instance_restarted_between_the_read_and_its_lock_is_not_interrupted_nor_credited():
    node = make_listed_node(gpu_count=2)
    restarted, lost = _running_since(node, 10), _running_since(node, 10)
    probed = timezone.now()  # the probe found both VMs stopped (the first one mid-restart)
    wrapper, done = _right_after_the_unlocked_read(lambda: _in_another_connection(lambda: _restart(restarted)))
    with connection.execute_wrapper(wrapper):
        interrupted = svc.node_instances_interrupt(
            node_id=node.pk, since=probed - timedelta(minutes=2), cause=InterruptionCause.VM_LOST,
            detail="the server answers, but the VM is not running on it", vm_ids={restarted.vm_id, lost.vm_id},
            started_before=probed)
    assert done, "the service never read the instances it judges"
    restarted.refresh_from_db()
    assert restarted.started_at > probed  # its current run began after the probe: not judged by it
    assert interrupted == [lost.pk]
    assert restarted.status == InstanceStatus.RUNNING, restarted.status_message
    assert not Interruption.objects.filter(instance=restarted).exists()
    assert _credits(restarted) == 0 and _told(restarted) == 0
    # The one whose run began before the probe is interrupted, credited and told, once.
    lost.refresh_from_db()
    assert lost.status == InstanceStatus.INTERRUPTED
    assert Interruption.objects.filter(instance=lost).count() == 1 and _credits(lost) == 1 and _told(lost) == 1


def test_started_before_is_decided_under_the_lock_by_instance_interrupt_itself():
    node = make_listed_node(gpu_count=1)
    instance = _running_since(node, 10)
    assert svc.instance_interrupt(instance_id=instance.pk, since=None, cause=InterruptionCause.VM_LOST, detail="x",
                                  started_before=instance.started_at) is None  # began at it, not before
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING and not Interruption.objects.filter(instance=instance).exists()
    assert svc.instance_interrupt(instance_id=instance.pk, since=None, cause=InterruptionCause.VM_LOST, detail="x",
                                  started_before=instance.started_at + timedelta(microseconds=1)) is not None


def test_two_interrupters_at_once_interrupt_and_credit_an_instance_once():
    """The health check (its VM stopped) and a quarantine (the node's host key changed) both read the instance as
    running before either interrupts it."""
    node = make_listed_node(gpu_count=1)
    instance = _running_since(node, 10)
    probed = timezone.now()
    both_read = threading.Barrier(2, timeout=20)
    results: dict[str, list[int]] = {}
    errors = []

    def interrupter(name: str, **kwargs) -> None:
        wrapper, _done = _right_after_the_unlocked_read(both_read.wait)
        try:
            with connections["default"].execute_wrapper(wrapper):
                results[name] = svc.node_instances_interrupt(node_id=node.pk, since=probed - timedelta(minutes=2),
                                                             detail=name, **kwargs)
        except Exception as exc:  # noqa: BLE001 (handed back to the test)
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=interrupter, args=("health",),
                                kwargs={"cause": InterruptionCause.VM_LOST, "vm_ids": {instance.vm_id},
                                        "started_before": probed}),
               threading.Thread(target=interrupter, args=("quarantine",),
                                kwargs={"cause": InterruptionCause.NODE_LOST})]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors and not any(thread.is_alive() for thread in threads), errors
    assert sorted(results["health"] + results["quarantine"]) == [instance.pk]
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.INTERRUPTED
    assert Interruption.objects.filter(instance=instance).count() == 1
    assert _credits(instance) == 1 and _told(instance) == 1
