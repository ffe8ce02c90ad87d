"""A renter's own container that the engine keeps restarting (the agent's "restarting", docker) is no lost VM
(found by the second review): since 991edab the agent answers "restarting" where it said "running", and the health
check took it as stopped: the instance was interrupted (cause vm_lost), its renter credited at the provider's
expense, the reconciler started it again, and every cycle credited again. It stays running, billed, its GPUs held,
and its renter is told once through its status message."""
import pytest

from billing.services.ledger import earnings_balance
from billing.services.metering import usage_meter
from marketplace.models import Instance, InstanceStatus, Interruption, Node
from marketplace.services import instances as svc
from provisioning.services.fleet_record import RESTARTING_MESSAGE, node_record_health
from tests.billing.conftest import clock  # noqa: F401 - the fixture
from tests.billing.helpers import balance, fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def test_a_renters_own_restarting_container_is_not_interrupted_nor_credited_at_the_providers_expense(clock):  # noqa: F811
    renter = UserFactory()
    fund(renter, "50")
    host = node(price="1.500000", gpu_count=4)
    Node.objects.filter(pk=host.pk).update(runtime="docker")
    node_record_health(node_id=host.pk, ok=True)
    instance = running(renter, host, num_gpus=2)
    Instance.objects.filter(pk=instance.pk).update(image=None, image_ref="docker.io/me/exits-at-once:1")
    earnings_before = earnings_balance(user_id=host.provider_id)
    clock.advance(60)
    probed = clock.now
    clock.advance(1)
    assert node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "restarting"}, probed_at=probed) == []
    clock.advance(3600)
    assert svc.instance_restart_interrupted(instance_id=instance.pk) is None  # not interrupted: nothing to restart
    assert not Interruption.objects.filter(instance=instance).exists()
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING
    assert instance.status_message == RESTARTING_MESSAGE
    usage_meter()
    assert earnings_balance(user_id=host.provider_id) > earnings_before  # billed as running; nothing credited
    assert balance(renter) < 50_000_000


def test_the_renter_is_told_once(clock):  # noqa: F811
    renter = UserFactory()
    fund(renter, "50")
    host = node(price="1.500000", gpu_count=4)
    node_record_health(node_id=host.pk, ok=True)
    instance = running(renter, host)
    clock.advance(60)
    for _ in range(2):
        probed = clock.now
        clock.advance(1)
        assert node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "restarting"},
                                  probed_at=probed) == []
        instance.refresh_from_db()
        assert instance.status_message == RESTARTING_MESSAGE
        told_at = instance.updated_at
        clock.advance(60)
    assert Instance.objects.get(pk=instance.pk).updated_at == told_at  # the second check wrote nothing
    # A VM that does stop is still judged so (interrupted, started again by the reconciler).
    probed = clock.now
    clock.advance(1)
    assert node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=probed) == [
        instance.pk]
