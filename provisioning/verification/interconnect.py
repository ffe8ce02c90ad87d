"""The interconnect: what offers show of NVLink (nvlink_summary) and the findings on it (check_topology)."""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from provisioning.verification.model import DEGRADE, Finding
from provisioning.verification.tolerances import TOLERANCES


def _is_nvlink(link: str) -> bool:
    return link.startswith("NV")


def nvlink_summary(topology: dict | None, p2p: Sequence[dict] | None) -> dict:
    """What offers show of the interconnect: NVLink-connected or not, its islands, the fewest active links of a GPU
    in an island, and the measured p2p GB/s (median over NVLink pairs; else over all pairs measured)."""
    topology, p2p = topology or {}, list(p2p or [])
    islands = topology.get("nvlink_islands") or []
    in_island = {g for island in islands for g in island}
    links = [g.get("links_active") or 0 for g in topology.get("gpus") or [] if g.get("index") in in_island]
    kind = {(p["a"], p["b"]): p["link"] for p in topology.get("pairs") or []}
    nvlink_pairs = [p["gbs"] for p in p2p if p.get("gbs") and _is_nvlink(kind.get((p["a"], p["b"]), ""))]
    other_pairs = [p["gbs"] for p in p2p if p.get("gbs") and not _is_nvlink(kind.get((p["a"], p["b"]), ""))]
    measured = nvlink_pairs or other_pairs
    return {"connected": bool(islands), "islands": islands, "links_per_gpu": min(links) if links else None,
            "p2p_gbs": round(statistics.median(measured), 1) if measured else None,
            "pcie_p2p_gbs": round(statistics.median(other_pairs), 1) if other_pairs else None}


def check_topology(nvlink_declared: bool, gpu_count: int, topology: dict | None,
                   p2p: Sequence[dict] | None) -> list[Finding]:
    """NVLink declared but absent; links down; NVLink pairs whose p2p copies are slow for their links."""
    if gpu_count < 2:
        return []
    topology, found = topology or {}, []
    if nvlink_declared and not topology.get("nvlink_islands"):
        found.append(Finding(DEGRADE, "nvlink_absent",
                             "The node is declared NVLink-connected, but nvidia-smi (`topo -m`) shows no NVLink "
                             "between its GPUs. Fix the bridges or board, or declare it without NVLink."))
    speeds = {g["index"]: g for g in topology.get("gpus") or []}
    for gpu in speeds.values():
        total, active = gpu.get("links_total") or 0, gpu.get("links_active") or 0
        if total and active < total:
            found.append(Finding(DEGRADE, "nvlink_degraded",
                                 f"GPU {gpu['index']} has {active} of its {total} NVLink links active "
                                 f"(`nvidia-smi nvlink -s -i {gpu['index']}`): reseat the card or check the board.",
                                 gpu["index"]))
    kind = {(p["a"], p["b"]): p["link"] for p in topology.get("pairs") or []}
    for pair in p2p or []:
        a, b, gbs = pair.get("a"), pair.get("b"), pair.get("gbs")
        if not gbs or not _is_nvlink(kind.get((a, b), "")):
            continue
        total = min((speeds.get(i) or {}).get("links_total") or 0 for i in (a, b))
        per_link = max((speeds.get(i) or {}).get("link_gbs") or 0.0 for i in (a, b))
        expected = total * per_link
        if expected and gbs < TOLERANCES["nvlink_p2p_min_fraction"] * expected:
            weaker = min((a, b), key=lambda i: (speeds.get(i) or {}).get("links_active") or 0)  # the likely culprit
            found.append(Finding(DEGRADE, "nvlink_p2p_slow",
                                 f"GPUs {a} and {b} copy peer to peer at {gbs:g} GB/s over NVLink, "
                                 f"{gbs / expected:.0%} of their {total} links' {expected:g} GB/s.", weaker))
    return found
