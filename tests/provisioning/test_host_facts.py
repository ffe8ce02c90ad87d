"""Host facts: the agent's bounded disk test, and what the platform stores from an inventory (malformed figures
are dropped, never guessed)."""
import os

import pytest

from marketplace.models.host import cuda_version_code, cuda_version_text
from provisioning.agent.gpumarket_agent import smi
from provisioning.services.host_facts import host_facts_from

INVENTORY = {
    "cpu": {"model": "AMD EPYC 7543 32-Core Processor", "cores": 64}, "ram_mib": 515_000, "disk_free_gb": 3500,
    "disk": {"free_gb": 3500, "total_gb": 3840, "write_mbs": 1800.5, "read_mbs": 2500.0, "test_mib": 32},
    "driver_version": "550.54.15", "cuda_version": "12.4",
    "gpus": [{"index": 0, "pcie_link_gen_max": 4, "pcie_link_width_max": 16},
             {"index": 1, "pcie_link_gen_max": 3, "pcie_link_width_max": 8}],
}


def test_the_disk_test_writes_reads_and_cleans_up(tmp_path):
    answer = smi.disk_bandwidth(str(tmp_path), 4)
    assert answer["test_mib"] == 4 and answer["write_mbs"] > 0 and answer["read_mbs"] > 0
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_the_disk_test_is_bounded_and_says_when_it_cannot_run(tmp_path):
    assert smi.disk_bandwidth(str(tmp_path), 10**6)["test_mib"] == smi.DISK_TEST_MAX_MIB
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    answer = smi.disk_bandwidth(str(blocked), 1)
    assert answer["write_mbs"] is None and answer["read_mbs"] is None and answer["error"]


def test_host_facts_from_an_inventory():
    facts = host_facts_from(INVENTORY, 941.26)
    assert facts == {
        "cpu_model": "AMD EPYC 7543 32-Core Processor", "cpu_cores": 64, "ram_gb": 503, "disk_free_gb": 3500,
        "disk_total_gb": 3840, "disk_bandwidth_mbs": 1800.5, "driver_version": "550.54.15", "cuda_version": 12040,
        "pcie_gen": 3, "pcie_width": 8,  # the weakest GPU's link
        "net_mbps": 941.26,
    }


def test_a_disk_smaller_than_its_free_space_is_no_size():
    """A size below the free space is garbled: the room is then judged by the free space alone, not by nonsense."""
    assert host_facts_from({**INVENTORY, "disk": {"free_gb": 3500, "total_gb": 100}}, None)["disk_total_gb"] is None
    assert host_facts_from({**INVENTORY, "disk": {"free_gb": 3500, "total_gb": "big"}}, None)["disk_total_gb"] is None


def test_the_agent_reports_its_file_systems_size_beside_its_free_space(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMARKET_DISK_PATH", str(tmp_path))
    monkeypatch.setenv("GPUMARKET_DISK_TEST_MIB", "1")
    cfg = type("Cfg", (), {"runtime": "docker", "state_dir": str(tmp_path)})()
    disk = smi.host_facts(cfg)["disk"]
    usage = os.statvfs(tmp_path)
    assert disk["total_gb"] == usage.f_blocks * usage.f_frsize // 10**9 and 0 <= disk["free_gb"] <= disk["total_gb"]


@pytest.mark.parametrize("broken", [
    {"cpu": "x", "ram_mib": -1, "disk": [], "cuda_version": 12.4, "gpus": "none"},
    {"cpu": {"cores": True}, "ram_mib": "lots", "disk": {"write_mbs": "fast", "read_mbs": 10},
     "cuda_version": "twelve", "gpus": [{"pcie_link_gen_max": None}, {"pcie_link_gen_max": 4}]},
    {},
    # Beyond a float's range or an integer column's: dropped, not an OverflowError or a DataError.
    {"cpu": {"cores": 10**400}, "ram_mib": 10**400, "disk": {"write_mbs": 10**400, "read_mbs": float("nan")}},
])
def test_malformed_figures_are_dropped_not_guessed(broken):
    facts = host_facts_from(broken, None)
    assert facts["cpu_cores"] is None and facts["ram_gb"] is None and facts["disk_bandwidth_mbs"] is None
    assert facts["cuda_version"] is None and facts["pcie_gen"] is None and facts["net_mbps"] is None
    assert facts["cpu_model"] == "" and facts["driver_version"] == ""


@pytest.mark.parametrize(("text", "code"), [("12.2", 12020), ("12.10", 12100), ("11.8", 11080), ("9.0", 9000),
                                            ("12", None), ("12.2.1", None), ("012.2", None), ("", None),
                                            ("12.123", None)])
def test_cuda_versions_sort_as_numbers(text, code):
    assert cuda_version_code(text) == code
    if code is not None:
        assert cuda_version_text(code) == text
