"""The GPU catalogue in the operators' panel (found by review): a model's slug keys the PCI device ids, its MIG
profiles and the API's filters, and its figures are what the checks judge nodes against. Renamed or edited in the
admin, the PCI id check said nothing for that model's nodes, MIG checks failed, and the row no longer matched the
data file gpu-selfcheck reads. A saved model is read-only; one is still added with its slug."""
import pytest

from marketplace.models import GpuModel
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form

pytestmark = pytest.mark.django_db


@pytest.fixture
def ops(operator):
    return logged_in(operator)


def test_a_saved_models_slug_and_figures_cannot_be_changed(ops):
    model = GpuModel.objects.get(slug="a100-80gb-sxm")
    before = GpuModel.objects.filter(pk=model.pk).values().get()
    url = f"/admin/marketplace/gpumodel/{model.pk}/change/"
    data = change_form(ops, url, "gpumodel_form")
    assert "slug" not in data and "bf16_tflops" not in data and "smi_name" not in data  # shown, not editable
    page = ops.get(url).content.decode()
    assert "a100-80gb-sxm" in page  # the slug is shown
    data.update(slug=["a100-renamed"], bf16_tflops=["1.0"], memory_bandwidth_gbps=["1.0"], smi_name=["Fake"],
                mig_max_instances=["0"], name=["Renamed"])
    r = ops.post(url, data)
    assert r.status_code == 302, r.content.decode()[:2000]
    assert GpuModel.objects.filter(pk=model.pk).values().get() == before


def test_a_model_is_still_added_with_its_slug(ops):
    data = change_form(ops, "/admin/marketplace/gpumodel/add/", "gpumodel_form")
    data.update(slug=["new-card"], name=["New Card"], smi_name=["NVIDIA New Card"], architecture=["Hopper"],
                form_factor=["pcie"], memory_gb=["48"], memory_mib=["49152"], memory_mib_ecc_off=["49152"],
                memory_mib_ecc_on=["49152"], memory_type=["GDDR6"], memory_bandwidth_gbps=["900"],
                fp32_tflops=["40"], tf32_tflops=["80"], bf16_tflops=["160"], tdp_w=["300"], pcie_gen=["4"],
                pcie_lanes=["16"], cuda_cores=["10000"], tensor_cores=["300"], mig_max_instances=["0"])
    r = ops.post("/admin/marketplace/gpumodel/add/", data)
    assert r.status_code == 302, r.content.decode()[:3000]
    assert GpuModel.objects.get(slug="new-card").bf16_tflops == 160
