"""nvidia-smi parsing on real-looking output samples (tests/provisioning/fixtures/nvidia_smi/)."""
from pathlib import Path

import pytest

from provisioning.agent import gpumarket_agent as agent

SAMPLES = Path(__file__).parent / "fixtures" / "nvidia_smi"


def parse(name):
    return agent.parse_gpu_csv((SAMPLES / name).read_text())


def test_query_asks_for_the_fifteen_fields_in_order():
    assert agent.NVIDIA_SMI_QUERY == [
        "nvidia-smi",
        "--query-gpu=index,uuid,name,memory.total,pci.bus_id,pci.device_id,pcie.link.gen.max,"
        "pcie.link.gen.current,pcie.link.width.max,pcie.link.width.current,power.limit,power.default_limit,"
        "mig.mode.current,ecc.mode.current,driver_version",
        "--format=csv,noheader,nounits",
    ]


def test_four_a100_sxm4_80gb():
    gpus = parse("a100_sxm4_80gb_x4.csv")
    assert [g["index"] for g in gpus] == [0, 1, 2, 3]
    assert [g["pci_bus_id"] for g in gpus] == [
        "00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0",
    ]
    assert gpus[2] == {
        "index": 2,
        "uuid": "GPU-c91f6b08-4d2e-7a35-b6c1-e8f0a3d5b792",
        "name": "NVIDIA A100-SXM4-80GB",
        "memory_total_mib": 81920,
        "pci_bus_id": "00000000:47:00.0",
        "pci_device_id": "0x20B210DE",
        "pcie_link_gen_max": 4,
        "pcie_link_gen_current": 4,
        "pcie_link_width_max": 16,
        "pcie_link_width_current": 16,
        "power_limit_w": 400.0,
        "power_default_limit_w": 400.0,
        "mig_mode": "Disabled",
        "ecc_mode": "Enabled",
        "driver_version": "535.129.03",
    }


def test_rtx_a6000_has_no_mig_and_an_idle_link():
    (gpu,) = parse("rtx_a6000_x1.csv")
    assert gpu["name"] == "NVIDIA RTX A6000"
    assert gpu["memory_total_mib"] == 49140
    assert gpu["mig_mode"] is None  # "[N/A]": the card has no MIG
    assert gpu["ecc_mode"] == "Disabled"
    assert (gpu["pcie_link_gen_current"], gpu["pcie_link_gen_max"]) == (1, 4)  # idle cards drop the link


def test_mig_enabled_a100_with_missing_fields():
    first, second = parse("a100_mig_na.csv")
    assert first["mig_mode"] == second["mig_mode"] == "Enabled"
    assert first["power_limit_w"] == 400.0
    # "[N/A]", "[Not Supported]" and bare "N/A" all read as unknown, never as a number or a string.
    assert second["pcie_link_gen_current"] is None
    assert second["pcie_link_width_current"] is None
    assert second["power_limit_w"] is None
    assert second["power_default_limit_w"] is None
    assert second["ecc_mode"] is None
    assert second["pcie_link_width_max"] == 16


def test_h100_sxm():
    (gpu,) = parse("h100_sxm_x1.csv")
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert (gpu["memory_total_mib"], gpu["pcie_link_gen_max"], gpu["power_limit_w"]) == (81559, 5, 700.0)


def test_spacing_after_commas_does_not_matter():
    tight = (SAMPLES / "h100_sxm_x1.csv").read_text().replace(", ", ",")
    loose = (SAMPLES / "h100_sxm_x1.csv").read_text().replace(", ", ",   ")
    assert agent.parse_gpu_csv(tight) == agent.parse_gpu_csv(loose) == parse("h100_sxm_x1.csv")


def test_blank_lines_are_skipped_and_empty_output_is_no_gpus():
    assert agent.parse_gpu_csv("") == []
    assert len(agent.parse_gpu_csv("\n" + (SAMPLES / "h100_sxm_x1.csv").read_text() + "\n\n")) == 1


@pytest.mark.parametrize(
    "line",
    [
        "0, GPU-x, NVIDIA A100-SXM4-80GB, 81920",  # too few fields
        "0, GPU-x, NVIDIA H100, 81559 MiB, 00000000:18:00.0, 0x233010DE, 5, 5, 16, 16, 700, 700, Disabled, "
        "Enabled, 550.54.15",  # units although nounits was asked for
        "[N/A], GPU-x, NVIDIA H100, 81559, 00000000:18:00.0, 0x233010DE, 5, 5, 16, 16, 700, 700, Disabled, "
        "Enabled, 550.54.15",  # no index
    ],
)
def test_garbage_is_refused_with_a_clear_error(line):
    with pytest.raises(agent.AgentError) as exc:
        agent.parse_gpu_csv(line)
    assert exc.value.code == "nvidia_smi_unparsable"


def test_cuda_version_from_the_banner():
    assert agent.parse_cuda_version((SAMPLES / "h100_sxm_x1_table.txt").read_text()) == "12.4"
    assert agent.parse_cuda_version("NVIDIA-SMI has failed because it couldn't communicate") is None
