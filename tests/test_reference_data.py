"""After a transactional test's flush the rows the migrations loaded come back exactly as migrated: the stock
images as 0014 reworded them, the catalogue with its ECC sizes and MIG profiles (tests/reference_data.py)."""
import pytest
from django.core import serializers

from marketplace.models import GpuModel, Image
from tests import reference_data


def _rows(model) -> str:
    return serializers.serialize("json", model.objects.order_by("pk"))


@pytest.mark.django_db(transaction=True)
def test_a_flush_then_restore_gives_back_the_migrated_rows():
    before = {model: _rows(model) for model in (GpuModel, Image)}
    assert "SSH server" in Image.objects.get(slug="cuda-12-4").description  # 0014's wording, not 0005's
    assert {"marketplace.GpuModel", "marketplace.Image"} <= set(reference_data.snapshot_labels())
    Image.objects.all().delete()
    GpuModel.objects.all().delete()
    assert not Image.objects.exists() and not GpuModel.objects.exists()
    reference_data.restore()
    assert {model: _rows(model) for model in (GpuModel, Image)} == before
