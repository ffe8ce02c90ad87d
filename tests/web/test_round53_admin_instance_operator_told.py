"""An operator's Stop or Destroy of a renter's instance from the admin asks for a reason and tells the renter that an
operator did it and why (review r53 #1): a destroy deleted the VM and its disk and told the renter nothing (there is
no notice of a renter's own destroy), a stop only the generic "Stopped; the disk is kept"."""
import pytest

from marketplace.models import Instance, InstanceStatus
from marketplace.services import instances as svc
from notifications.models import PREFERENCE_KINDS, EmailStatus, Kind, Notification
from tests.billing.helpers import fund, node, running, worker_done
from tests.factories import UserFactory
from tests.web.conftest import logged_in
from tests.web.test_admin_permissions import act, staff

pytestmark = pytest.mark.django_db

REASON = "Mining on a rental, against the terms"


def _renters_running_instance() -> Instance:
    renter = UserFactory()
    fund(renter, "10")
    return running(renter, node("1.000000"))


def _told(instance, kind) -> list[Notification]:
    return list(Notification.objects.filter(user=instance.renter, kind=kind))


def test_a_destroy_by_an_operator_tells_the_renter_why_and_that_the_disk_is_gone(operator):
    instance = _renters_running_instance()
    ops = logged_in(operator)
    act(ops, "marketplace/instance", "force_destroy", instance.pk, reason=REASON, index=0)
    svc.instance_mark_destroyed(instance_id=instance.pk)
    worker_done(instance)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.DESTROYED
    [told] = _told(instance, Kind.INSTANCE_DESTROYED_BY_OPERATOR)
    assert told.title == f"Instance {instance.pk} was destroyed by the operators"
    assert "operator" in told.body and REASON in told.body and "disk" in told.body
    assert told.email_status == EmailStatus.PENDING  # e-mailed too, as they chose (every channel by default)
    act(ops, "marketplace/instance", "force_destroy", instance.pk, reason=REASON, index=0)  # destroyed: refused
    assert len(_told(instance, Kind.INSTANCE_DESTROYED_BY_OPERATOR)) == 1


def test_a_stop_by_an_operator_says_an_operator_did_it_and_why(operator):
    instance = _renters_running_instance()
    ops = logged_in(operator)
    act(ops, "marketplace/instance", "force_stop", instance.pk, reason=REASON, index=0)
    act(ops, "marketplace/instance", "force_stop", instance.pk, reason=REASON, index=0)  # stopping: nothing new
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.STOPPING
    assert not _told(instance, Kind.INSTANCE_STOPPED_BY_OPERATOR)  # told once it is stopped: the stop may fail
    svc.instance_mark_stopped(instance_id=instance.pk)  # what the stop job does once the node stopped the VM
    worker_done(instance)
    [told] = _told(instance, Kind.INSTANCE_STOPPED_BY_OPERATOR)
    assert not _told(instance, Kind.INSTANCE_STOPPED)  # not the generic notice as well
    assert told.title == f"Instance {instance.pk} was stopped by the operators"
    assert "operator" in told.body and REASON in told.body and "disk is kept" in told.body


def test_nobody_is_told_of_what_an_operator_did_not_do(operator):
    boss = UserFactory(is_staff=True, is_superuser=True)
    fund(boss, "10")
    theirs = running(boss, node("1.000000"))
    act(logged_in(staff("marketplace.change_instance", "marketplace.view_instance")), "marketplace/instance",
        "force_destroy", theirs.pk, reason=REASON, index=0)  # a staff account's: a superuser's to destroy
    instance = _renters_running_instance()
    act(logged_in(operator), "marketplace/instance", "force_destroy", instance.pk, reason="bad\x07", index=0)
    assert Instance.objects.get(pk=theirs.pk).status == InstanceStatus.RUNNING
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.RUNNING
    svc.instance_destroy(instance=instance)  # the renter's own destroy: no operator's notice
    assert not Notification.objects.filter(kind__in=[Kind.INSTANCE_DESTROYED_BY_OPERATOR,
                                                     Kind.INSTANCE_STOPPED_BY_OPERATOR]).exists()


def test_renters_choose_the_channels_of_the_new_notices():
    assert {Kind.INSTANCE_STOPPED_BY_OPERATOR, Kind.INSTANCE_DESTROYED_BY_OPERATOR} <= set(PREFERENCE_KINDS)
