"""Catalogue GPU models are not deleted in the operators' panel (review r53 #5): they are read-only once saved
(catalogue data: the data file and a migration), yet Django's delete page and delete_selected emptied every unused
row of the catalogue, also for a non-superuser holding delete_gpumodel."""
import pytest

from marketplace.models import GpuModel
from tests.web.conftest import logged_in
from tests.web.test_admin_permissions import act, offered, staff

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("who", ["staff", "superuser"])
def test_catalogue_gpu_models_are_not_deleted_one_by_one_nor_in_bulk(who, operator):
    user = operator if who == "superuser" else staff("marketplace.delete_gpumodel", "marketplace.view_gpumodel")
    client = logged_in(user)
    ids = list(GpuModel.objects.values_list("pk", flat=True))
    assert ids
    assert client.post(f"/admin/marketplace/gpumodel/{ids[0]}/delete/", {"post": "yes"}).status_code == 403
    act(client, "marketplace/gpumodel", "delete_selected", *ids, post="yes", index=0)
    assert GpuModel.objects.count() == len(ids)
    assert "delete_selected" not in offered(user, GpuModel)
