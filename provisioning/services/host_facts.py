"""The host's facts renters compare offers by, taken from a verification: what the agent read and measured on the
node (CPU, RAM, free disk and the disk test, driver and CUDA version, the GPUs' PCIe links) and what the platform
measured itself (its throughput to the node over SSH). Stored on the node's columns (marketplace.models.host)."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from marketplace.models import Node
from marketplace.models.host import cuda_version_code

# JSON integers are unbounded: past these, float() overflows and PostgreSQL's integer columns refuse the value.
_INT_MAX = 2**31 - 1
_NUMBER_MAX = 1e15


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _INT_MAX else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= _NUMBER_MAX:
        return None  # NaN too: it compares false
    return float(value)


def host_facts_from(inventory: dict[str, Any], net_mbps: float | None) -> dict[str, Any]:
    """The node's host-fact columns from an agent inventory (anything missing or malformed is null / blank)."""
    cpu: dict[str, Any] = inventory["cpu"] if isinstance(inventory.get("cpu"), dict) else {}
    disk: dict[str, Any] = inventory["disk"] if isinstance(inventory.get("disk"), dict) else {}
    gpus = [g for g in inventory.get("gpus") or [] if isinstance(g, dict)]
    ram_mib = _int(inventory.get("ram_mib"))
    speeds = [s for s in (_number(disk.get("write_mbs")), _number(disk.get("read_mbs"))) if s is not None]
    gens = [g for g in (_int(gpu.get("pcie_link_gen_max")) for gpu in gpus) if g is not None]
    widths = [w for w in (_int(gpu.get("pcie_link_width_max")) for gpu in gpus) if w is not None]
    cuda = inventory.get("cuda_version")
    free, total = _int(disk.get("free_gb", inventory.get("disk_free_gb"))), _int(disk.get("total_gb"))
    return {
        "cpu_model": str(cpu.get("model") or "")[:200],
        "cpu_cores": _int(cpu.get("cores")),
        "ram_gb": round(ram_mib / 1024) if ram_mib is not None else None,
        "disk_free_gb": free,
        "disk_total_gb": total if total is not None and (free is None or total >= free) else None,  # else garbled
        # Both ways were measured: the slower one is what a workload gets at worst.
        "disk_bandwidth_mbs": min(speeds) if len(speeds) == 2 else None,
        "driver_version": str(inventory.get("driver_version") or "")[:32],
        "cuda_version": cuda_version_code(cuda) if isinstance(cuda, str) else None,
        # The weakest GPU's link decides what the node can promise for each GPU.
        "pcie_gen": min(gens) if gens and len(gens) == len(gpus) else None,
        "pcie_width": min(widths) if widths and len(widths) == len(gpus) else None,
        "net_mbps": _number(net_mbps),
    }


def node_apply_host_facts(node: Node, inventory: dict[str, Any], net_mbps: float | None, at: datetime) -> None:
    """Set the host facts on `node` in memory (the caller saves it, inside its verification's transaction)."""
    for field, value in host_facts_from(inventory, net_mbps).items():
        setattr(node, field, value)
    node.host_checked_at = at
