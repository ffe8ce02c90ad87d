"""A lost node's SSH error is written for its provider ("gpuadmin@203.0.113.7:52222 refused the platform's key. Run
the node's install command..."): it went into the renter's interruption message, and from there to the instance
page, the API, the Vast-compatible status_msg and the notification (found after review r55 renter MEDIUM-1, which
fixed the same leak for failed jobs). The node keeps the error; the renter reads how many checks failed."""
import pytest
from django.core import mail

from billing.models import BillingEvent, EventKind
from marketplace.models import Interruption
from notifications.models import Notification
from provisioning.services.fleet_record import node_record_health
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PROVIDER_TEXT = ("gpuadmin@203.0.113.7:52222 refused the platform's key. Run the node's install command as that "
                 "user, then verify again.")


def test_the_renter_is_not_shown_the_nodes_ssh_error_when_it_is_lost(clock, django_capture_on_commit_callbacks):
    renter = UserFactory()
    fund(renter, "50")
    host = node(price="1.500000", gpu_count=2)
    node_record_health(node_id=host.pk, ok=True)
    instance = running(renter, host, num_gpus=1)
    clock.advance(60)
    with django_capture_on_commit_callbacks(execute=True):
        interrupted = []
        for _ in range(3):
            interrupted += node_record_health(node_id=host.pk, ok=False, error=PROVIDER_TEXT)
    assert interrupted == [instance.pk]
    instance.refresh_from_db()
    host.refresh_from_db()
    assert "health checks failed in a row" in instance.status_message
    shown = [instance.status_message, Interruption.objects.get(instance=instance).detail,
             BillingEvent.objects.get(user=renter, kind=EventKind.INSTANCE_INTERRUPTED).message,
             Notification.objects.get(user=renter, kind="instance_interrupted").body,
             *(message.body for message in mail.outbox if renter.email in message.to)]
    for text in shown:
        assert "gpuadmin" not in text and "203.0.113.7" not in text and "install command" not in text, text
    assert PROVIDER_TEXT in host.last_error  # the provider and operators still read it
