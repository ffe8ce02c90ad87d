"""A volume create read its node's provider's is_active unlocked, so one overlapping a deactivation committed a new
billed volume on the deactivated provider's node, where a booking (allocation._lock_node_for_booking: KEY SHARE on
the provider's row) waits for the deactivation and is refused (found by review)."""
import threading
import time

import pytest
from django.db import connection, transaction

from core.errors import Conflict
from marketplace.models import User, Volume
from marketplace.services.account_status import account_deactivate
from marketplace.services.volumes import volume_create
from provisioning.models import Job
from tests.factories import UserFactory, make_listed_node

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_volume_create_waits_for_a_deactivation_under_way_and_is_refused():
    """As test_account_status.test_a_booking_waits_for_a_deactivation_under_way_and_is_refused, for a volume."""
    provider, renter = UserFactory(), UserFactory()
    node = make_listed_node(provider, gpu_count=2)
    deactivated, release, outcome = threading.Event(), threading.Event(), {}

    def deactivate():
        try:
            with transaction.atomic():
                account_deactivate(user=User.objects.get(pk=provider.pk))
                deactivated.set()
                release.wait(10)
        finally:
            connection.close()

    def create():
        try:
            volume_create(owner=renter, node_id=node.pk, size_gb=10)
            outcome["created"] = True
        except Conflict as exc:
            outcome["refused"] = str(exc)
        finally:
            connection.close()

    first = threading.Thread(target=deactivate)
    first.start()
    assert deactivated.wait(10)
    second = threading.Thread(target=create)
    second.start()
    time.sleep(0.5)
    early = dict(outcome)
    release.set()
    first.join(10)
    second.join(10)
    assert not Volume.objects.filter(node=node).exists(), (
        f"a volume was created on the node of a provider being deactivated (outcome before the deactivation "
        f"committed: {early})")
    assert early == {}, f"the create did not wait for the deactivation: {early}"
    assert "takes no new rentals" in outcome.get("refused", ""), outcome
    assert not Job.objects.filter(node=node).exists()
