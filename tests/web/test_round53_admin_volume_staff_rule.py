"""Ending a volume as lost from the admin follows the staff-account rule of the other actions (review r53 #6): a
non-superuser with change_volume ended (deleted, closed the billing of) a superuser's or a staff account's volume."""
import pytest
from django.utils import timezone

from marketplace.models import Volume, VolumeState
from marketplace.services import volumes as volume_svc
from tests.factories import UserFactory, make_listed_node
from tests.web.conftest import logged_in
from tests.web.test_admin_permissions import act, staff

pytestmark = pytest.mark.django_db


def _missing_volume(owner) -> Volume:
    volume = volume_svc.volume_create(owner=owner, node_id=make_listed_node().pk, size_gb=10)
    volume_svc.volume_mark_available(volume_id=volume.pk)
    Volume.objects.filter(pk=volume.pk).update(missing_since=timezone.now())
    return volume


@pytest.mark.parametrize("superuser", [True, False])
def test_a_non_superuser_does_not_end_a_staff_accounts_volume(superuser):
    theirs = _missing_volume(UserFactory(is_staff=True, is_superuser=superuser))
    renters = _missing_volume(UserFactory())
    op = staff("marketplace.change_volume", "marketplace.view_volume")
    client = logged_in(op)
    act(client, "marketplace/volume", "end_lost", theirs.pk, renters.pk, index=0)
    assert Volume.objects.get(pk=theirs.pk).state == VolumeState.AVAILABLE
    assert Volume.objects.get(pk=renters.pk).state == VolumeState.DELETED  # a renter's is ended as before
    assert "only a superuser changes a staff account" in client.get("/admin/marketplace/volume/").content.decode()


def test_a_superuser_ends_a_staff_accounts_volume(operator):
    theirs = _missing_volume(UserFactory(is_staff=True))
    act(logged_in(operator), "marketplace/volume", "end_lost", theirs.pk, index=0)
    assert Volume.objects.get(pk=theirs.pk).state == VolumeState.DELETED
