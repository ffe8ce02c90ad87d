"""Records a service owns are not written by hand in the operators' panel (found by review): a MIG slice's status
(an operator set a free slice `rented` to no instance), adding a GPU or a slice (a 500: an IntegrityError), and
deleting GPUs and slices (the node's gpu_count no longer said how many it has), API keys (their audit trail went
with them: revoke instead) and SSH keys (their owners' to remove)."""
import pytest

from marketplace.models import ApiKey, Gpu, MigSlice, SliceStatus, SshKey
from marketplace.services.ssh_keys import ssh_key_create
from tests.factories import api_key_for, make_listed_node
from tests.marketplace.mig_helpers import SEVEN, make_mig_node
from tests.marketplace.renting_helpers import ed25519_key
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form
from tests.web.test_admin_permissions import act, offered

pytestmark = pytest.mark.django_db

@pytest.fixture
def ops(operator):
    return logged_in(operator)


def test_a_slices_status_is_its_checks_alone(ops):
    """Rented is set by a booking, free and unavailable by its node's check (provisioning.services.mig), which
    would undo a hand-set `unavailable` at its next run: shown, not editable."""
    node = make_mig_node({0: SEVEN}, gpu_count=1)
    piece = MigSlice.objects.filter(node=node).first()
    url = f"/admin/marketplace/migslice/{piece.pk}/change/"
    page = ops.get(url)
    assert page.status_code == 200 and 'name="status"' not in page.content.decode()
    for status in (SliceStatus.RENTED, SliceStatus.UNAVAILABLE):
        ops.post(url, {"status": status})
        piece.refresh_from_db()
        assert piece.status == SliceStatus.FREE, status


@pytest.mark.parametrize("model", ["gpu", "migslice"])
def test_gpus_and_slices_are_not_added_by_hand(ops, model):
    r = ops.post(f"/admin/marketplace/{model}/add/", {"status": "free"})
    assert r.status_code == 403
    assert f"/admin/marketplace/{model}/add/" not in ops.get(f"/admin/marketplace/{model}/").content.decode()


def test_gpus_and_slices_are_not_deleted_by_hand(ops):
    node = make_mig_node({0: SEVEN}, gpu_count=2)
    gpu, piece = Gpu.objects.filter(node=node).first(), MigSlice.objects.filter(node=node).first()
    for model, pk in (("gpu", gpu.pk), ("migslice", piece.pk)):
        assert ops.post(f"/admin/marketplace/{model}/{pk}/delete/", {"post": "yes"}).status_code == 403, model
        act(ops, f"marketplace/{model}", "delete_selected", pk, post="yes")
    assert Gpu.objects.filter(node=node).count() == node.gpu_count == 2
    assert MigSlice.objects.filter(node=node).count() == 7


def test_api_keys_are_revoked_not_deleted(ops, operator, renter):
    from django.contrib import admin

    api_key_for(renter)
    key = ApiKey.objects.get(user=renter)
    assert ops.post(f"/admin/marketplace/apikey/{key.pk}/delete/", {"post": "yes"}).status_code == 403
    act(ops, "marketplace/apikey", "delete_selected", key.pk, post="yes")
    assert ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).exists()
    assert "delete_selected" not in offered(operator, ApiKey) and "revoke" in offered(operator, ApiKey)
    act(ops, "marketplace/apikey", "revoke", key.pk)
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None  # kept, with when it was revoked
    assert admin.site._registry[ApiKey].has_delete_permission(_request(operator)) is False


def test_ssh_keys_are_their_owners_to_delete(ops, operator, renter):
    key = ssh_key_create(user=renter, public_key=ed25519_key(), name="laptop")
    assert ops.post(f"/admin/marketplace/sshkey/{key.pk}/delete/", {"post": "yes"}).status_code == 403
    act(ops, "marketplace/sshkey", "delete_selected", key.pk, post="yes")
    assert SshKey.objects.filter(pk=key.pk).exists()
    assert "delete_selected" not in offered(operator, SshKey)


def test_a_free_gpu_is_still_taken_out_of_service(ops, stranger):
    """What stays the operator's: a whole free GPU between free and unavailable (GpuStatusForm)."""
    gpu = Gpu.objects.get(node=make_listed_node(stranger, name="n1", gpu_count=1))
    url = f"/admin/marketplace/gpu/{gpu.pk}/change/"
    assert ops.post(url, {**change_form(ops, url, "gpu_form"), "status": ["unavailable"]}).status_code == 302
    gpu.refresh_from_db()
    assert gpu.status == "unavailable"


def _request(user):
    from django.test import RequestFactory

    request = RequestFactory().get("/admin/")
    request.user = user
    return request


def test_notifications_and_webhooks_are_not_deleted_by_hand(ops, renter):
    """A notification or a delivery is the record of what a user was told; an endpoint is its owner's to delete
    (its service locks the deliveries being written first)."""
    from notifications.models import Notification, WebhookDelivery, WebhookEndpoint
    from notifications.services.notify import notify
    from notifications.services.webhooks import endpoint_create

    endpoint = endpoint_create(user=renter, url="http://127.0.0.1:9/x")[0]
    told = notify(user=renter, kind="low_balance", payload={"balance_micros": 1_000_000}, dedupe_key="admin-delete")
    assert told is not None
    delivery = WebhookDelivery.objects.get(endpoint=endpoint)
    for model, pk in (("notification", told.pk), ("webhookendpoint", endpoint.pk), ("webhookdelivery", delivery.pk)):
        assert ops.post(f"/admin/notifications/{model}/{pk}/delete/", {"post": "yes"}).status_code == 403, model
        act(ops, f"notifications/{model}", "delete_selected", pk, post="yes")
    assert Notification.objects.filter(pk=told.pk).exists()
    assert WebhookEndpoint.objects.filter(pk=endpoint.pk).exists()
    assert WebhookDelivery.objects.filter(pk=delivery.pk).exists()
