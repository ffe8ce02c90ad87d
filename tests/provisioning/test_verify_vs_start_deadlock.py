"""A renter starting a stopped instance while its node's verification concludes (found by review), on real
PostgreSQL with a connection per thread. instance_start locked the instance's row, billed its stopped disk, then
took the node's row FOR SHARE (_lock_node_for_booking); node_verify_conclude holds the node's row FOR NO KEY UPDATE
and then cuts the price of each open instance of the node, stopped ones included, under the instance's lock. Instance
then node on one side, node then instance on the other: PostgreSQL aborted one of them ("deadlock detected ...
while locking tuple ... in relation marketplace_node", a 500 for the renter). A retire of an unreachable node, which
locks the node and then its stopped instances, met the start the same way. The start now takes the node's share lock
first, then the instance, then the disk's posting (the wallet in id order with the other accounts), as a booking and
every node-side writer take the node before its instances."""
import threading
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import Instance, Node
from marketplace.services import instances as svc
from marketplace.services.instances import lifecycle
from marketplace.services.nodes import node_retire
from provisioning.models import VerificationRun
from provisioning.services.fleet_record import node_record_health
from tests.billing.helpers import fund, node, running, stop
from tests.factories import UserFactory
from tests.provisioning.test_verify_vs_enforcement_deadlock import _conclude, _waiting_for_a_lock_or_done

pytestmark = pytest.mark.django_db(transaction=True)


def _stopped_an_hour_ago(renter, host) -> Instance:
    instance = stop(running(renter, host))
    Instance.objects.filter(pk=instance.pk).update(stopped_at=timezone.now() - timedelta(hours=1))  # disk to bill
    return instance


def _race(monkeypatch, start_id: int, other) -> tuple[dict[str, BaseException], bool]:
    """instance_start paused where it bills the stopped disk (the instance's row locked, and the node's in the
    order under test), `other` run meanwhile until it waits for a lock (or ends), then both let go. The errors of
    each, and whether `other` ended while the start was paused."""
    holding, go = threading.Event(), threading.Event()
    real_leave = lifecycle._leave_running
    errors: dict[str, BaseException] = {}

    def pause_at_the_disk_charge(instance, now):
        holding.set()
        go.wait(10)
        return real_leave(instance, now)

    monkeypatch.setattr(lifecycle, "_leave_running", pause_at_the_disk_charge)

    def run(name, work):
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's assertions
            errors[name] = exc
        finally:
            connection.close()

    s = threading.Thread(target=run, args=("start", lambda: svc.instance_start(
        instance=Instance.objects.get(pk=start_id))))
    o = threading.Thread(target=run, args=("other", other))
    try:
        s.start()
        assert holding.wait(10)
        o.start()
        _waiting_for_a_lock_or_done(o)
        other_done_meanwhile = not o.is_alive()
        go.set()
        s.join(30)
        o.join(30)
    finally:
        go.set()
    assert not s.is_alive() and not o.is_alive(), "a transaction hung"
    return errors, other_done_meanwhile


def test_a_verification_cutting_a_stopped_instance_while_its_renter_starts_it_does_not_deadlock(
        broker, monkeypatch):
    renter = UserFactory()
    fund(renter, "100")
    host = node(price="1.500000", gpu_count=4)
    Node.objects.filter(pk=host.pk).update(score=1.0)  # a degraded check at 0.5 cuts every open instance by half
    node_record_health(node_id=host.pk, ok=True)
    instance = _stopped_an_hour_ago(renter, host)

    degraded = [{"severity": "degrade", "code": "bf16_tflops", "message": "half the datasheet's BF16"}]
    errors, verified_meanwhile = _race(monkeypatch, instance.pk, lambda: _conclude(host, "degraded", 0.5, degraded))

    assert not errors, {k: f"{type(v).__name__}: {v}" for k, v in errors.items()}
    assert not verified_meanwhile  # the check waited for the start at the node's row, where the start holds it
    started = Instance.objects.get(pk=instance.pk)
    assert started.status == "starting"
    assert started.disk_cost_micros > 0  # the stopped hour's disk billed by the start
    assert started.price_per_hour_micros == 750_000  # then cut by the check, which came second
    assert VerificationRun.objects.filter(node=host).order_by("-pk").values_list("verdict", flat=True)[0] == "degraded"


def test_retiring_an_unreachable_node_while_its_renter_starts_a_stopped_instance_does_not_deadlock(
        broker, monkeypatch):
    """node_retire locks the node's row, then its stopped instances (it fails them: their disks cannot be
    reached): the same cycle. The start now waits for nothing the retire holds: it is refused by the node's failed
    health check (a 409), then the retire ends the instance."""
    renter = UserFactory()
    fund(renter, "100")
    host = node(price="1.500000", gpu_count=1)
    instance = _stopped_an_hour_ago(renter, host)
    Node.objects.filter(pk=host.pk).update(health_failures=settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS)

    errors, retired_meanwhile = _race(monkeypatch, instance.pk,
                                      lambda: node_retire(node=Node.objects.get(pk=host.pk)))

    assert not retired_meanwhile
    assert set(errors) == {"start"}, {k: f"{type(v).__name__}: {v}" for k, v in errors.items()}
    assert isinstance(errors["start"], Conflict) and "did not answer its last health check" in str(errors["start"])
    assert Node.objects.get(pk=host.pk).state == "retired"
    assert Instance.objects.get(pk=instance.pk).status == "failed"
