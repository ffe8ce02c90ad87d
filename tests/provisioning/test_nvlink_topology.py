"""NVLink: the agent's parsers of `nvidia-smi topo -m` and `nvidia-smi nvlink -s` (real output and the sim's), the
sim's p2p copies, and the acceptance policy's findings on the interconnect."""
import time
from types import SimpleNamespace

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.sim import resolve_profile
from provisioning.verification.interconnect import check_topology, nvlink_summary

# As a DGX A100 (NVSwitch) prints it, trimmed to four GPUs and two NICs.
TOPO_REAL = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV12\tNV12\tNV12\tPXB\tSYS\t48-63,176-191\t3\t\tN/A
GPU1\tNV12\t X \tNV12\tNV12\tPXB\tSYS\t48-63,176-191\t3\t\tN/A
GPU2\tNV12\tNV12\t X \tNV12\tSYS\tPXB\t16-31,144-159\t1\t\tN/A
GPU3\tNV12\tNV12\tNV12\t X \tSYS\tPXB\t16-31,144-159\t1\t\tN/A
NIC0\tPXB\tPXB\tSYS\tSYS\t X \tSYS

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""
NVLINK_REAL = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-aaaa)
\t Link 0: 25 GB/s
\t Link 1: 25 GB/s
\t Link 2: <inactive>
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-bbbb)
\t Link 0: 25 GB/s
\t Link 1: 25 GB/s
\t Link 2: 25 GB/s
"""


def test_topo_matrix_pairs_from_real_output_ignoring_nics():
    pairs = agent.parse_topo_matrix(TOPO_REAL)
    assert pairs == {(0, 1): "NV12", (0, 2): "NV12", (0, 3): "NV12", (1, 2): "NV12", (1, 3): "NV12",
                     (2, 3): "NV12"}
    assert agent.nvlink_islands(pairs) == [[0, 1, 2, 3]]


def test_nvlink_status_counts_inactive_links():
    assert agent.parse_nvlink_status(NVLINK_REAL) == {
        0: {"links_total": 3, "links_active": 2, "link_gbs": 25.0},
        1: {"links_total": 3, "links_active": 3, "link_gbs": 25.0}}


def test_no_nvlink_and_garbage_give_no_islands():
    assert agent.nvlink_islands(agent.parse_topo_matrix("\tGPU0\tGPU1\nGPU0\t X \tPHB\nGPU1\tPHB\t X \n")) == []
    assert agent.parse_topo_matrix("NVIDIA-SMI has failed") == {} and agent.parse_nvlink_status("") == {}


def sim_topology(name):
    profile, gpus = agent.load_profile(str(resolve_profile(name)))
    return profile, gpus, agent.read_topology(SimpleNamespace(runtime="sim"), gpus, profile)


def test_the_sim_prints_two_islands_of_four_and_the_agent_reads_them_back():
    profile, gpus, topo = sim_topology("a100-80gb-sxm-x8-nvlink-islands")
    assert topo["nvlink_islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    kinds = {(p["a"], p["b"]): p["link"] for p in topo["pairs"]}
    assert kinds[(0, 3)] == "NV12" and kinds[(3, 4)] == "SYS" and len(kinds) == 28
    assert {g["links_active"] for g in topo["gpus"]} == {12}


def test_a_degraded_gpu_shows_fewer_active_links_and_a_narrower_bond():
    profile, gpus, topo = sim_topology("a100-80gb-sxm-x4-nvlink-degraded")
    links = {g["index"]: g["links_active"] for g in topo["gpus"]}
    assert links == {0: 12, 1: 12, 2: 6, 3: 12}
    kinds = {(p["a"], p["b"]): p["link"] for p in topo["pairs"]}
    assert kinds[(0, 1)] == "NV12" and kinds[(1, 2)] == "NV6"


def test_sim_p2p_copies_take_the_time_the_hardware_would():
    cfg = SimpleNamespace(runtime="sim", sim_profile=str(resolve_profile("rtx-a4000-x2-nvlink-claimed")))
    started = time.monotonic()
    [pair] = agent.p2p_figures(cfg, [0, 1])
    nominal_s = agent.P2P_BYTES / 12e9  # the profile's 12 GB/s over PCIe
    assert time.monotonic() - started >= nominal_s * 0.97  # the noise is at most 3 %
    assert (pair["a"], pair["b"]) == (0, 1) and pair["gbs"] <= 12 * 1.03
    assert agent.p2p_figures(cfg, [1]) == []


def _topology(active=12, islands=([0, 1],)):
    pairs = [{"a": 0, "b": 1, "link": f"NV{active}" if islands else "SYS"}]
    gpus = [{"index": i, "links_total": 12 if islands else 0, "links_active": active if (i == 1 and islands) else
             (12 if islands else 0), "link_gbs": 25.0 if islands else None} for i in (0, 1)]
    return {"pairs": pairs, "gpus": gpus, "nvlink_islands": [list(i) for i in islands]}


def codes(findings):
    return {(f.code, f.gpu_index) for f in findings}


def test_healthy_nvlink_as_declared_has_no_findings():
    assert check_topology(True, 2, _topology(), [{"a": 0, "b": 1, "gbs": 240.0}]) == []


def test_nvlink_declared_but_absent_degrades():
    found = check_topology(True, 2, _topology(islands=()), [{"a": 0, "b": 1, "gbs": 20.0}])
    assert codes(found) == {("nvlink_absent", None)} and found[0].severity == "degrade"
    assert check_topology(False, 2, _topology(islands=()), []) == []  # not claimed: nothing to hold against it
    assert check_topology(True, 2, None, None)[0].code == "nvlink_absent"  # not read at all: not shown either


def test_links_down_and_slow_p2p_degrade_naming_the_gpu():
    found = check_topology(False, 2, _topology(active=6), [{"a": 0, "b": 1, "gbs": 115.0}])
    assert codes(found) == {("nvlink_degraded", 1), ("nvlink_p2p_slow", 1)}
    assert "6 of its 12" in next(f.message for f in found if f.code == "nvlink_degraded")


@pytest.mark.parametrize("gbs", [181.0, 240.0])
def test_p2p_above_the_floor_passes(gbs):
    assert check_topology(False, 2, _topology(), [{"a": 0, "b": 1, "gbs": gbs}]) == []


def test_summary_reports_islands_links_and_the_nvlink_median():
    topo = _topology()
    assert nvlink_summary(topo, [{"a": 0, "b": 1, "gbs": 231.5}]) == {
        "connected": True, "islands": [[0, 1]], "links_per_gpu": 12, "p2p_gbs": 231.5, "pcie_p2p_gbs": None}
    assert nvlink_summary(_topology(islands=()), [{"a": 0, "b": 1, "gbs": 19.6}])["p2p_gbs"] == 19.6
