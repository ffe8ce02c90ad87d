"""The agent's MIG parts without a node: `nvidia-smi -L` parsing, the sim's listing, slice benchmarks, which VM
holds what, and the policy's MIG findings on hand-made answers."""
import io
import json
from types import SimpleNamespace

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.core import AgentError
from provisioning.verification.mig import check_mig, slice_model
from provisioning.verification.model import DeclaredModel, load_catalogue
from provisioning.verification.profiles import PROFILES_DIR

# As a driver prints it on an A100 80GB in MIG mode (two GPUs, the second whole).
REAL_LIST = """GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5f1c8a4e-2b6d-11ee-9a8b-0242ac120002)
  MIG 3g.40gb     Device  0: (UUID: MIG-0b7f3f31-5ad1-5e8a-9c21-0b6d3e7f8a10)
  MIG 2g.20gb     Device  1: (UUID: MIG-97c4a11e-3e4f-5c7a-b890-2c3d4e5f6a71)
  MIG 1g.10gb     Device  2: (UUID: MIG-1a2b3c4d-9b8a-5d6c-a1f2-3e4d5c6b7a82)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-6e2d9b5f-2b6d-11ee-9a8b-0242ac120002)
"""
A100 = DeclaredModel.from_catalogue(load_catalogue()["a100-80gb-sxm"])


def test_parse_mig_list_reads_devices_under_their_gpu():
    devices = agent.parse_mig_list(REAL_LIST)
    assert [(d["gpu"], d["device"], d["profile"]) for d in devices] == [(0, 0, "3g.40gb"), (0, 1, "2g.20gb"),
                                                                       (0, 2, "1g.10gb")]
    assert devices[1]["uuid"] == "MIG-97c4a11e-3e4f-5c7a-b890-2c3d4e5f6a71"
    assert agent.parse_mig_list("GPU 0: NVIDIA A10 (UUID: GPU-1)\n") == []


def test_the_sim_prints_its_profile_as_nvidia_smi_would_and_reads_it_back():
    path = str(PROFILES_DIR / "a100-80gb-sxm-x2-mig.json")
    profile, gpus = agent.load_profile(path)
    text = agent.list_text(gpus, agent.sim_slices(profile))
    assert agent.parse_mig_list(text) == agent.read_mig(SimpleNamespace(runtime="sim", sim_profile=path), gpus)
    assert [d["profile"] for d in agent.parse_mig_list(text)] == [s["profile"] for s in profile["mig"]["0"]]
    assert "GPU 1: NVIDIA A100-SXM4-80GB" in text  # the whole card is listed, with no MIG lines


def test_a_vm_given_one_slice_lists_only_that_slice(tmp_path):
    path = str(PROFILES_DIR / "a100-80gb-sxm-x2-mig.json")
    profile, _ = agent.load_profile(path)
    mine = profile["mig"]["0"][1]["uuid"]
    gpus_file = tmp_path / "gpus.json"
    gpus_file.write_text(json.dumps({"nvidia_smi": profile["nvidia_smi"][:1], "mig": profile["mig"],
                                     "mig_uuids": [mine]}))
    out = io.StringIO()
    assert agent.sim_nvidia_smi(["-L"], str(gpus_file), out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("GPU 0:") and mine in lines[1] and "2g.20gb" in lines[1]


def test_slice_benchmarks_scale_with_the_real_slice():
    cfg = SimpleNamespace(runtime="sim", sim_profile=str(PROFILES_DIR / "a100-80gb-sxm-x2-mig.json"))
    profile, _ = agent.load_profile(cfg.sim_profile)
    uuids = [s["uuid"] for s in profile["mig"]["0"]]
    rows = {r["profile"]: r for r in agent.bench_slices(cfg, True, uuids)}
    # 3 of 7 compute slices against 1 of 7, within the sim's ±3 % noise either way
    assert 2.8 < rows["3g.40gb"]["bf16_tflops"] / rows["1g.10gb"]["bf16_tflops"] < 3.2
    assert rows["3g.40gb"]["memory_mib"] == 40192
    with pytest.raises(AgentError, match="no MIG device"):
        agent.bench_slices(cfg, True, ["MIG-00000000-0000-0000-0000-000000000000"])


def test_benchmark_requests_check_mig_uuids():
    with pytest.raises(AgentError, match="mig_uuids"):
        agent.validate_mig_uuids(["GPU-1234"])
    with pytest.raises(AgentError, match="mig_uuids"):
        agent.validate_mig_uuids(["MIG-0b7f3f31-5ad1", "MIG-0b7f3f31-5ad1"])
    # Whole: re.match with "$" let a trailing newline through (found by review).
    for bad in ("MIG-0b7f3f31-5ad1\n", "MIG-0b7f3f31-5ad1\nx", " MIG-0b7f3f31-5ad1"):
        with pytest.raises(AgentError, match="mig_uuids"):
            agent.validate_mig_uuids([bad])
    assert agent.validate_mig_uuids(["MIG-0b7f3f31-5ad1"]) == ["MIG-0b7f3f31-5ad1"]


class _Rt:
    def state(self, rec):
        return "running"


def test_a_whole_gpu_and_its_slices_are_never_given_to_two_running_vms():
    slice_vm = {"spec": {"gpu_indices": [0], "mig_uuids": ["MIG-aaaaaaaa-1"]}}
    whole_vm = {"spec": {"gpu_indices": [1]}}
    agent.check_gpus_free(_Rt(), [slice_vm, whole_vm], [0], ["MIG-bbbbbbbb-2"])  # another slice of GPU 0: fine
    with pytest.raises(AgentError, match="MIG device MIG-aaaaaaaa-1"):
        agent.check_gpus_free(_Rt(), [slice_vm], [0], ["MIG-aaaaaaaa-1"])
    with pytest.raises(AgentError, match="GPU 0 is in use"):
        agent.check_gpus_free(_Rt(), [slice_vm], [0])  # GPU 0 whole while one of its slices runs
    with pytest.raises(AgentError, match="GPU 1 is in use"):
        agent.check_gpus_free(_Rt(), [whole_vm], [1], ["MIG-cccccccc-3"])  # a slice of a GPU given whole


# --- the policy on hand-made answers ------------------------------------------------------------------------

def _gpu(mode="Enabled"):
    return {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920, "mig_mode": mode}


def _slice(profile="3g.40gb", share=3 / 7, memory=40192, uuid="MIG-0b7f3f31-5ad1-5e8a-9c21-0b6d3e7f8a10"):
    return {"gpu": 0, "device": 0, "profile": profile, "uuid": uuid, "memory_mib": memory,
            "bf16_tflops": 312 * 0.87 * share, "fp16_tflops": 312 * 0.87 * share, "tf32_tflops": 156 * 0.8 * share,
            "fp32_tflops": 19.5 * 0.9 * share, "memory_bandwidth_gbs": 2039 * 0.85 * 0.5,
            "matmul_rel_error": {"fp32": 2e-7, "bf16": 3e-3}}


def _device(profile="3g.40gb"):
    return {"gpu": 0, "device": 0, "profile": profile, "uuid": _slice()["uuid"]}


def test_a_slice_that_measures_as_its_profile_is_proven():
    findings, slices = check_mig(A100, {0: ["3g.40gb"]}, [_gpu()], [_device()], [_slice()])
    assert findings == [] and slices[0]["proven"] and slices[0]["memory_mib"] == 40192


@pytest.mark.parametrize(("gpu", "devices", "measured", "code"), [
    (_gpu("Disabled"), [], [], "mig_not_configured"),
    (_gpu(), [], [], "mig_not_configured"),
    (_gpu(), [_device("2g.20gb")], [], "mig_layout_mismatch"),
    (_gpu(), [_device()], [], "mig_slice_unproven"),
    (_gpu(), [_device()], [_slice(memory=19968)], "mig_slice_memory"),
    (_gpu(), [_device()], [_slice(share=1 / 7)], "mig_slice_slow"),  # a third of a 3g.40gb
    (_gpu(), [_device()], [_slice(share=7 / 7)], "mig_slice_too_fast"),
])
def test_what_is_wrong_with_a_layout_or_a_slice_is_named(gpu, devices, measured, code):
    findings, slices = check_mig(A100, {0: ["3g.40gb"]}, [gpu], devices, measured)
    assert code in {f.code for f in findings} and all(f.severity == "reject" for f in findings if f.code == code)
    assert not any(s["proven"] for s in slices)


def test_a_rented_slice_is_neither_measured_nor_judged():
    findings, slices = check_mig(A100, {0: ["3g.40gb"]}, [_gpu()], [_device()], [], skip_uuids=[_device()["uuid"]])
    assert findings == [] and slices[0]["rented"] and not slices[0]["proven"]


def test_a_slice_model_is_the_card_scaled_by_the_profile():
    from marketplace.mig import profiles_for
    model = slice_model(A100, profiles_for("a100-80gb-sxm")["1g.10gb"])
    assert model.datasheet["bf16_tflops"] == pytest.approx(312 / 7)
    assert model.datasheet["memory_bandwidth_gbs"] == pytest.approx(2039 / 8)


def test_a_slice_somewhat_slower_than_its_profile_is_degraded_not_rejected():
    findings, slices = check_mig(A100, {0: ["3g.40gb"]}, [_gpu()], [_device()], [_slice(share=2 / 7)])
    assert {(f.code, f.severity) for f in findings} == {("mig_slice_slow", "degrade")}
    assert slices[0]["proven"]  # listed, the node degraded
