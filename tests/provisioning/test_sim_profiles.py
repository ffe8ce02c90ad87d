"""The shipped sim profiles report what nvidia-smi would print for the cards they claim (figures: gpus.md)."""
import json
import statistics

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.sim import PROFILES_DIR, resolve_profile

# nvidia-smi name -> (memory.total MiB, TDP W = power limit, PCIe gen, MIG capable, HBM, dense BF16 TFLOP/s)
CARDS = {
    "NVIDIA A100-SXM4-80GB": (81920, 400, 4, True, True, 312),
    "NVIDIA RTX A6000": (49140, 300, 4, False, False, 154.8),
    "NVIDIA RTX A4000": (16376, 140, 4, False, False, 76.7),
    "NVIDIA H100 80GB HBM3": (81559, 700, 5, True, True, 989.4),
}
PROFILES = {
    "a100-80gb-sxm-x4": ("NVIDIA A100-SXM4-80GB", 4),
    "rtx-a6000-x8": ("NVIDIA RTX A6000", 8),
    "rtx-a4000-x2": ("NVIDIA RTX A4000", 2),
    "h100-sxm-x1": ("NVIDIA H100 80GB HBM3", 1),
}
FRACTIONS = {"bf16", "fp16", "tf32", "fp32", "memory_bandwidth", "host_link"}


def test_every_profile_file_is_covered_here():
    assert {p.stem for p in PROFILES_DIR.glob("*.json")} >= set(PROFILES)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_claimed_gpus_match_the_catalogue(name):
    profile, gpus = agent.load_profile(str(resolve_profile(name)))
    card, count = PROFILES[name]
    memory, tdp, gen, mig, hbm, _ = CARDS[card]
    assert profile["name"] == name
    assert [g["index"] for g in gpus] == list(range(count))
    assert len({g["uuid"] for g in gpus}) == len({g["pci_bus_id"] for g in gpus}) == count
    for gpu in gpus:
        assert gpu["name"] == card
        assert gpu["memory_total_mib"] == memory
        assert gpu["power_limit_w"] == gpu["power_default_limit_w"] == tdp
        assert gpu["pcie_link_gen_max"] == gpu["pcie_link_gen_current"] == gen
        assert gpu["pcie_link_width_max"] == gpu["pcie_link_width_current"] == 16
        assert gpu["mig_mode"] == ("Disabled" if mig else None)
        assert gpu["ecc_mode"] == ("Enabled" if hbm else "Disabled")
        assert gpu["driver_version"] == gpus[0]["driver_version"]
        agent.pci_address(gpu["pci_bus_id"])  # usable for libvirt passthrough too
    assert profile["cuda_version"]
    host = profile["host"]
    assert host["cpu_model"] and host["cpu_cores"] >= count and host["ram_mib"] > 16000 and host["disk_free_gb"] > 0


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_performance_describes_healthy_cards(name):
    profile = json.loads(resolve_profile(name).read_text())
    card = PROFILES[name][0]
    perf = profile["performance"]
    assert perf["datasheet"]["bf16_tflops"] == CARDS[card][5]
    assert [g["index"] for g in perf["gpus"]] == list(range(PROFILES[name][1]))
    for key in FRACTIONS:
        values = [g["fraction"][key] for g in perf["gpus"]]
        assert all(0.6 <= v <= 1.0 for v in values), (key, values)
        # healthy cards in one node stay within about 5 % of each other
        assert max(values) / min(values) <= 1.05, (key, values)
    for gpu in perf["gpus"]:
        telemetry = gpu["telemetry"]
        assert telemetry["clocks_event_reasons"] == []
        assert telemetry["power_draw_w"] <= CARDS[card][1]
        assert telemetry["sm_clock_mhz"] <= perf["datasheet"]["max_sm_clock_mhz"]
        assert (telemetry["pcie_link_gen"], telemetry["pcie_link_width"]) == (CARDS[card][2], 16)
        assert gpu["matmul_correct"] is True
    median_bf16 = statistics.median(g["fraction"]["bf16"] for g in perf["gpus"])
    assert 0.7 <= median_bf16 <= 0.9


@pytest.mark.parametrize("name", sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
def test_nvlink_islands_name_real_gpus_and_a_claim_needs_two(name):
    profile, gpus = agent.load_profile(str(resolve_profile(name)))
    topo = profile.get("topology") or {}
    members = [g for island in topo.get("nvlink_islands", []) for g in island]
    assert len(members) == len(set(members)) and set(members) <= {g["index"] for g in gpus}
    assert all(len(island) >= 2 for island in topo.get("nvlink_islands", []))
    for index, active in (topo.get("active_links") or {}).items():
        assert int(index) in members and 0 <= active < topo["links_per_gpu"]
    if profile["declared"].get("nvlink"):
        assert profile["declared"]["gpu_count"] >= 2


def test_unknown_profile_names_list_the_known_ones():
    with pytest.raises(ValueError, match="a100-80gb-sxm-x4"):
        resolve_profile("a100-fake")
