"""A MIG device listed twice by one card's driver (its UUID, or its device number) is that card's fault, judged on
that card. Before, the inventory's check called the whole answer malformed (`inventory_malformed`, a finding about
no card): nothing of the inventory was stored and every renter of the node, whichever card they held, was cut to
$0/h. Now the MIG check names the card (`mig_uuid_repeated`, `mig_device_repeated`, with its index and what to do),
that card's free slices are withheld, only its renters are concerned, and the other cards are judged as usual."""
import copy

import pytest

from marketplace.mig import layout_by_gpu
from marketplace.models import Instance, MigSlice
from provisioning.models import VerificationRun
from provisioning.verification.answers import inventory_problems
from provisioning.verification.mig import judge_mig, repeated_mig_findings
from provisioning.verification.model import DeclaredModel, load_catalogue
from tests.provisioning.test_benchmark_verification import (
    profile_data,
    register,
    simbase,
    simnode,
    use_hardware,
    verify,
)
from tests.provisioning.test_round47_mig_pending_layout import _price, _rent

__all__ = ["simbase", "simnode"]

MIG_PROFILE = "a100-80gb-sxm-x2-mig"  # GPU 0 split 3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb on the server; GPU 1 whole
A100 = DeclaredModel.from_catalogue(load_catalogue()["a100-80gb-sxm"])


def _device(gpu: int, device: int, uuid: str, profile: str = "7g.80gb") -> dict:
    return {"gpu": gpu, "device": device, "profile": profile, "uuid": uuid}


def _inventory(devices: list[dict]) -> dict:
    gpus = [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920,
             "mig_mode": "Enabled"} for i in (0, 1)]
    return {"gpus": gpus, "mig": devices}


@pytest.mark.slow
def test_a_mig_uuid_repeated_on_one_card_cuts_only_that_cards_renters(db, simnode, simbase, settings):
    settings.BILLING_REQUIRE_FUNDS = False
    node, _ = verify(register(simnode, simbase, MIG_PROFILE))
    assert node.verdict == "verified", node.last_error
    whole = _rent(node, 1)  # GPU 1 whole
    sliced = _rent(node, 1, mig_profile="3g.40gb")  # GPU 0's 3g slice
    whole_price, sliced_price = _price(whole), _price(sliced)
    assert whole_price > 0 and sliced_price > 0
    glitch = copy.deepcopy(profile_data(MIG_PROFILE))
    ones = glitch["mig"]["0"][2:]  # GPU 0's driver lists its two 1g.10gb devices with one UUID
    ones[1]["uuid"] = ones[0]["uuid"]
    use_hardware(simnode, glitch)

    node, job = verify(node)

    run = VerificationRun.objects.filter(node=node).latest("created_at")
    assert job.status == "succeeded", job.error
    assert [(f["code"], f["gpu_index"]) for f in run.findings] == [("mig_uuid_repeated", 0)], run.findings
    message = run.findings[0]["message"]
    assert ones[0]["uuid"] in message and "nvidia-smi mig -i 0 -dci" in message and "other cards" in message
    assert run.inventory["mig"], "the inventory is read and kept: not malformed"
    assert node.verdict == "rejected", node.last_error
    # The renter of the healthy card pays as before; the glitching card's renter is cut, as for any finding on it.
    assert _price(whole) == whole_price
    assert _price(sliced) == 0
    assert Instance.objects.get(pk=whole.pk).status == "running"
    # The glitching card's free slices are withheld; its renter keeps its slice.
    assert not MigSlice.objects.filter(node=node, gpu__index=0, status="free").exists()
    assert MigSlice.objects.get(node=node, gpu__index=0, profile="3g.40gb").status == "rented"


@pytest.mark.slow
def test_the_other_cards_of_a_node_with_a_repeated_mig_uuid_are_benchmarked_and_judged(db, simnode, simbase):
    """No renter: the healthy card is measured as usual, the glitching card's slices are not asked for (the agent
    refuses a UUID twice in one request), and the findings are that card's only."""
    glitch = copy.deepcopy(profile_data(MIG_PROFILE))
    glitch["mig"]["0"][3]["uuid"] = glitch["mig"]["0"][2]["uuid"]
    node, job = verify(register(simnode, simbase, glitch))
    run = VerificationRun.objects.get(node=node)
    assert job.status == "succeeded", job.error
    assert [(f["code"], f["gpu_index"]) for f in run.findings] == [("mig_uuid_repeated", 0)], run.findings
    assert [g["index"] for g in run.figures["gpus"]] == [1]  # GPU 1 measured whole, as declared
    assert "mig_slices" not in run.figures
    assert not MigSlice.objects.filter(node=node).exists()


def test_a_repeated_mig_entry_is_not_a_malformed_inventory():
    repeated = _inventory([_device(0, 0, "MIG-same"), _device(1, 0, "MIG-same")])
    assert inventory_problems(repeated) == []
    twice = _inventory([_device(0, 0, "MIG-a"), _device(0, 0, "MIG-b")])
    assert inventory_problems(twice) == []
    assert inventory_problems(_inventory([{"gpu": 0, "device": "x", "profile": "7g.80gb", "uuid": 5}])) == [
        "mig[0].device is not an integer", "mig[0].uuid is not a string"]


def test_each_card_listing_a_repeated_mig_uuid_is_named_and_withheld_the_others_judged():
    devices = [_device(0, 0, "MIG-same"), _device(1, 0, "MIG-same"), _device(2, 0, "MIG-c")]
    found = repeated_mig_findings(devices)
    assert [(f.code, f.gpu_index, f.severity) for f in found] == [("mig_uuid_repeated", 0, "reject"),
                                                                  ("mig_uuid_repeated", 1, "reject")]
    assert "also reported by GPU 1" in found[0].message and "also reported by GPU 0" in found[1].message
    layout = layout_by_gpu([{"gpu": g, "profiles": ["7g.80gb"]} for g in (0, 1, 2)])
    inventory = _inventory(devices)
    inventory["gpus"].append({**inventory["gpus"][0], "index": 2, "uuid": "GPU-2"})
    bench = {"gpus": [], "mig_slices": [{"uuid": "MIG-c", "gpu": 2, "device": 0, "profile": "7g.80gb",
                                         "memory_mib": 80896, "bf16_tflops": 270, "fp16_tflops": 270,
                                         "tf32_tflops": 125, "fp32_tflops": 17.5, "memory_bandwidth_gbs": 1730,
                                         "matmul_rel_error": {"fp32": 2e-7, "bf16": 3e-3}}]}
    mig = judge_mig(A100, layout, inventory, bench)
    assert {f.gpu_index for f in mig.findings} == {0, 1}, mig.findings
    assert [(s["gpu"], s["proven"]) for s in mig.slices] == [(2, True)]


def test_a_device_number_listed_twice_on_a_card_is_named_on_that_card():
    devices = [_device(0, 0, "MIG-a", "3g.40gb"), _device(0, 0, "MIG-b", "3g.40gb"), _device(1, 0, "MIG-c")]
    found = repeated_mig_findings(devices)
    assert [(f.code, f.gpu_index) for f in found] == [("mig_device_repeated", 0)]
    assert "GPU 0 lists MIG device 0 more than once" in found[0].message
    same = repeated_mig_findings([_device(0, 0, "MIG-a"), _device(0, 0, "MIG-a")])  # one line twice
    assert [(f.code, f.gpu_index) for f in same] == [("mig_uuid_repeated", 0), ("mig_device_repeated", 0)]
    assert "MIG-a is listed twice on it" in same[0].message
