"""The public GPU catalogue carries the figures of shared/reference/gpus.md, not the source documents' errors."""
import pytest

pytestmark = pytest.mark.django_db

URL = "/api/v1/gpu-models/"

# The table of shared/reference/gpus.md, transcribed: nvidia-smi name -> (memory MiB, memory GB, memory type,
# bandwidth GB/s, FP32, TF32 dense, BF16 dense, TDP W, PCIe gen, CUDA cores, tensor cores, MIG instances).
REFERENCE = {
    "NVIDIA RTX A4000": (16376, 16, "GDDR6 ECC", 448, 19.2, 38, 76.7, 140, 4, 6144, 192, 0),
    "NVIDIA RTX A5000": (24564, 24, "GDDR6 ECC", 768, 27.8, 55.6, 111, 230, 4, 8192, 256, 0),
    "NVIDIA RTX A6000": (49140, 48, "GDDR6 ECC", 768, 38.7, 77.4, 154.8, 300, 4, 10752, 336, 0),
    "NVIDIA A100-PCIE-40GB": (40960, 40, "HBM2", 1555, 19.5, 156, 312, 250, 4, 6912, 432, 7),
    "NVIDIA A100-SXM4-40GB": (40960, 40, "HBM2", 1555, 19.5, 156, 312, 400, 4, 6912, 432, 7),
    "NVIDIA A100 80GB PCIe": (81920, 80, "HBM2e", 1935, 19.5, 156, 312, 300, 4, 6912, 432, 7),
    "NVIDIA A100-SXM4-80GB": (81920, 80, "HBM2e", 2039, 19.5, 156, 312, 400, 4, 6912, 432, 7),
    "NVIDIA A10": (23028, 24, "GDDR6", 600, 31.2, 62.5, 125, 150, 4, 9216, 288, 0),
    "NVIDIA L4": (23034, 24, "GDDR6", 300, 30.3, 60, 121, 72, 4, 7424, 232, 0),
    "NVIDIA L40S": (46068, 48, "GDDR6 ECC", 864, 91.6, 183, 362, 350, 4, 18176, 568, 0),
    "NVIDIA GeForce RTX 3090": (24576, 24, "GDDR6X", 936, 35.6, 35.6, 71, 350, 4, 10496, 328, 0),
    "NVIDIA GeForce RTX 4090": (24564, 24, "GDDR6X", 1008, 82.6, 82.6, 165.2, 450, 4, 16384, 512, 0),
    "NVIDIA H100 PCIe": (81559, 80, "HBM2e", 2000, 51, 378, 756, 350, 5, 14592, 456, 7),
    "NVIDIA H100 80GB HBM3": (81559, 80, "HBM3", 3350, 67, 494.7, 989.4, 700, 5, 16896, 528, 7),
    "NVIDIA H200": (143771, 141, "HBM3e", 4800, 67, 494.5, 989, 700, 5, 16896, 528, 7),
}
FIELDS = ("memory_mib", "memory_gb", "memory_type", "memory_bandwidth_gbps", "fp32_tflops", "tf32_tflops",
          "bf16_tflops", "tdp_w", "pcie_gen", "cuda_cores", "tensor_cores", "mig_max_instances")


@pytest.fixture
def catalogue(anon):
    r = anon.get(URL)
    assert r.status_code == 200  # public: no key needed
    return {row["smi_name"]: row for row in r.json()}


def test_every_reference_gpu_is_listed_with_its_figures(catalogue):
    assert set(REFERENCE) <= set(catalogue)
    for smi_name, figures in REFERENCE.items():
        row = catalogue[smi_name]
        assert tuple(row[f] for f in FIELDS) == pytest.approx(figures), smi_name
        assert row["mig_supported"] is (figures[-1] > 0)
        assert row["pcie_lanes"] == 16


def test_figures_the_source_documents_get_wrong(catalogue):
    a100_80_sxm = catalogue["NVIDIA A100-SXM4-80GB"]
    assert a100_80_sxm["memory_bandwidth_gbps"] == 2039  # not "1.6 TB/s"
    assert catalogue["NVIDIA A100 80GB PCIe"]["memory_bandwidth_gbps"] == 1935
    assert catalogue["NVIDIA A100-PCIE-40GB"]["memory_bandwidth_gbps"] == 1555  # not 640 or 866
    assert catalogue["NVIDIA A100-PCIE-40GB"]["cuda_cores"] == 6912  # not 5,120 (the bus width)
    assert catalogue["NVIDIA A100-PCIE-40GB"]["tdp_w"] == 250  # not 400 (SXM only)
    a4000 = catalogue["NVIDIA RTX A4000"]
    assert a4000["memory_bandwidth_gbps"] == 448  # not 512
    assert a4000["bf16_tflops"] == 76.7  # dense; 153.4 is sparse
    assert catalogue["NVIDIA RTX A5000"]["bf16_tflops"] == 111  # dense; 222.2 is sparse
    assert "sparse" in a4000["figures_note"]


def test_one_model_by_slug(anon):
    r = anon.get(f"{URL}a100-80gb-sxm/")
    assert r.status_code == 200
    assert r.json()["name"] == "A100 80GB SXM"
    assert r.json()["smi_name"] == "NVIDIA A100-SXM4-80GB"


@pytest.mark.parametrize("slug", ["nope", "A100", "a100.80gb"])
def test_unknown_slug_is_a_json_404(anon, slug):
    r = anon.get(f"{URL}{slug}/")
    assert r.status_code == 404
    assert "detail" in r.json()


def test_the_catalogue_is_read_only(api):
    assert api.post(URL, {"slug": "x"}).status_code == 405
    assert api.delete(f"{URL}l4/").status_code == 405


def test_an_invalid_key_on_a_public_endpoint_is_still_401(anon):
    anon.credentials(HTTP_AUTHORIZATION="Bearer gpm_wrong")
    assert anon.get(URL).status_code == 401
