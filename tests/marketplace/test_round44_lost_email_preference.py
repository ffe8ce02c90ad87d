"""An interrupted instance that fails (found by review): interruption_close e-mailed the renter directly ("could not
be recovered", the INSTANCE_LOST billing event with email=True) whatever they chose for failed instances, besides the
INSTANCE_FAILED notice on the channels they chose: a renter who turned those e-mails off was e-mailed anyway, one who
left them on got two e-mails for one failure. The billing event is recorded, not e-mailed; the notice carries the
credit's sentence."""
import pytest

from billing.models import BillingEvent, EventKind
from notifications.models import Kind, Notification
from notifications.services.notify import preference_set
from provisioning.services.fleet_record import node_record_health
from provisioning.services.nodes import OFFLINE_AFTER_FAILED_CHECKS
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _interrupted(settings, renter):
    fund(renter, "50")
    host = node("1.000000")
    instance = running(renter, host)
    for _ in range(max(OFFLINE_AFTER_FAILED_CHECKS, settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS) + 1):
        node_record_health(node_id=host.pk, ok=False, error="timed out")
    instance.refresh_from_db()
    assert instance.status == "interrupted"
    return instance


@pytest.mark.parametrize("email", [False, True])
def test_an_interrupted_instance_that_fails_is_e_mailed_only_as_the_renter_chose(
        settings, mailoutbox, django_capture_on_commit_callbacks, monkeypatch, email):
    monkeypatch.setattr("core.dispatch.send", lambda *a, **k: None)  # the notice's own e-mail task: not run
    renter = UserFactory()
    preference_set(user=renter, kind=Kind.INSTANCE_FAILED, in_app=True, email=email, webhook=True)
    instance = _interrupted(settings, renter)
    mailoutbox.clear()
    from marketplace.services import instances as svc

    with django_capture_on_commit_callbacks(execute=True):
        svc.instance_mark_failed(instance_id=instance.pk, message="the VM vanished")
    failed = Notification.objects.get(user=renter, kind=Kind.INSTANCE_FAILED)
    assert failed.email_status == ("pending" if email else "none")  # the notice's e-mail: as chosen
    assert [m.subject for m in mailoutbox] == []  # nothing else: before, "Instance lost with its node" was sent
    assert failed.body.startswith("the VM vanished") and "you were credited" in failed.body
    lost = BillingEvent.objects.get(user=renter, kind=EventKind.INSTANCE_LOST)
    assert not lost.emailed and "the VM vanished" in lost.message


def test_a_long_reason_is_cut_and_the_credit_kept(settings, monkeypatch):
    monkeypatch.setattr("core.dispatch.send", lambda *a, **k: None)
    renter = UserFactory()
    instance = _interrupted(settings, renter)
    from marketplace.services import instances as svc

    svc.instance_mark_failed(instance_id=instance.pk, message="x" * 600)
    instance.refresh_from_db()
    assert len(instance.status_message) <= 500 and instance.status_message.startswith("xxx")
    assert instance.status_message.endswith(" for it.") and "you were credited" in instance.status_message
    failed = Notification.objects.get(user=renter, kind=Kind.INSTANCE_FAILED)
    assert "you were credited" in failed.body
