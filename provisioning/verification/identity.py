"""The identity checks: do the GPUs the server reports (nvidia-smi) match the model and count declared, and is
the server or a GPU already another live node's?
"""
from __future__ import annotations

from provisioning.verification.model import DEGRADE, REJECT, DeclaredModel, Finding
from provisioning.verification.pci_ids import NVIDIA_VENDOR_ID, parse_device_id, slug_for_device_id
from provisioning.verification.tolerances import TOLERANCES


def check_identity(declared: DeclaredModel, declared_count: int, gpus: list[dict],
                   mig_gpus: frozenset[int] = frozenset()) -> list[Finding]:
    """Do the GPUs the server reports (nvidia-smi, via `inventory`) match what the provider declared?
    `mig_gpus`: the GPUs declared split into MIG slices (their MIG mode is expected; verification/mig.py)."""
    findings: list[Finding] = []
    if len(gpus) != declared_count:
        findings.append(Finding(REJECT, "gpu_count",
                                f"{declared_count} GPUs were declared but the server reports {len(gpus)}."))
    t = TOLERANCES
    for gpu in gpus:
        i = gpu.get("index")
        name = gpu.get("name") or ""
        if "MIG" in name.split() or ((gpu.get("mig_mode") or "").lower() == "enabled" and i not in mig_gpus):
            findings.append(Finding(REJECT, "mig_enabled",
                                    f"GPU {i} is a MIG slice or has MIG mode on ({name!r}); disable MIG "
                                    "(`nvidia-smi -mig 0`) so renters get the whole GPU, or declare its MIG "
                                    "layout (mig_layout) to rent it per slice.", i))
        if name != declared.smi_name:
            findings.append(Finding(REJECT, "gpu_name",
                                    f"GPU {i} reports {name!r}, not {declared.smi_name!r} as declared.", i))
        findings += check_memory_size(declared, i, gpu.get("memory_total_mib"), gpu.get("ecc_mode"), "nvidia-smi")
        limit, default = gpu.get("power_limit_w"), gpu.get("power_default_limit_w")
        floor = max(default or 0, declared.tdp_w or 0) * t["power_limit_min_fraction"]
        if limit and limit < floor:
            rated = " and ".join(part for part in (f"its default ({default:g} W)" if default else "",
                                                   f"{declared.a_label}'s TDP ({declared.tdp_w:g} W)"
                                                   if declared.tdp_w else "") if part)
            findings.append(Finding(DEGRADE, "power_capped",
                                    f"GPU {i}'s power limit is {limit:g} W, below {rated}; reset it with "
                                    f"`nvidia-smi -i {i} -pl {max(default or 0, declared.tdp_w or 0):g}`.", i))
        width_max = gpu.get("pcie_link_width_max")
        if width_max and width_max < declared.pcie_lanes:
            findings.append(Finding(DEGRADE, "pcie_width",
                                    f"GPU {i} sits on an x{width_max} PCIe link; it needs x{declared.pcie_lanes} "
                                    "(check the riser or slot).", i))
        findings += _check_pci_id(declared, i, gpu.get("pci_device_id"))
    by_uuid: dict[str, list] = {}
    for gpu in gpus:
        if gpu.get("uuid"):
            by_uuid.setdefault(gpu["uuid"], []).append(gpu.get("index"))
    for uuid, indices in by_uuid.items():
        if len(indices) > 1:
            # One finding per card carrying it, each naming every one (said once: wording.reasons): the first card
            # alone was named before, and the others read as unconcerned (the node page, the API's gpu_index).
            message = (f"GPUs {', '.join(map(str, indices))} report the same UUID {uuid}; every GPU has its own "
                       "(check `nvidia-smi -L` and the driver).")
            findings += [Finding(REJECT, "gpu_uuid_repeated", message, i) for i in indices]
    return findings


# ---------------------------------------------------------------------------------- one server, one node
# Decided by the platform's records (unique constraints on live nodes), not by the node's answers. The messages
# say what the provider can check on their own server and never name the other node or its provider.

def duplicate_host_key(fingerprint: str) -> Finding:
    return Finding(REJECT, "duplicate_host_key",
                   f"This server's SSH host key ({fingerprint}) belongs to another live node: a server can be "
                   "listed only once. If you registered it before, use that node or retire it, then verify this "
                   "one again. If this server was installed from another machine's image, give it host keys of "
                   "its own (remove /etc/ssh/ssh_host_* and run `ssh-keygen -A`), then verify again.")


def duplicate_address(address: str, ssh_port: int) -> Finding:
    """Found at first contact, once this node proved it controls the server: registering tells nobody."""
    return Finding(REJECT, "duplicate_address",
                   f"Another live node already reaches its server at {address}:{ssh_port}: a server can be listed "
                   "only once. If you registered it before, use that node or retire it, then verify this one again. "
                   "If this address was another server's before it became yours, contact the platform's support.")


def duplicate_gpus(gpus: list[tuple[int, str]]) -> Finding:
    """`gpus`: (index, uuid) of this server's GPUs that another live node holds."""
    which = ", ".join(f"GPU {i} ({uuid})" for i, uuid in gpus) or "Its GPUs"
    return Finding(REJECT, "duplicate_gpu",
                   f"{which} already belong{'s' if len(gpus) == 1 else ''} to another live node: a GPU can be "
                   "listed by one node only. If you registered this server before, use that node or retire it, "
                   "then verify this one again; if the cards came from another server of yours, verify or "
                   "retire that one first.", gpus[0][0] if gpus else None)


def check_memory_size(declared: DeclaredModel, i, memory, ecc_mode: str | None, source: str) -> list[Finding]:
    """memory.total (or CUDA's total) against the catalogue's size for the card's ECC mode."""
    t = TOLERANCES
    least, most = declared.memory_sizes(ecc_mode)
    ecc = {"enabled": " with ECC on", "disabled": " with ECC off"}.get((ecc_mode or "").lower(), "")
    said = f"GPU {i} has {memory} MiB of memory{ecc} according to {source}; {declared.memory_said()}"
    if memory is None or memory < t["memory_min_fraction"] * least:
        return [Finding(REJECT, "gpu_memory", f"{said}. It is not the card declared, or part of its memory is "
                                              "taken (a MIG slice, a vGPU profile): declare the model it is.", i)]
    if memory > t["memory_max_fraction"] * most:
        return [Finding(REJECT, "memory_larger_than_model",
                        f"{said}: more than that model has. Either it is another card (declare that one) or its "
                        "driver reports a faked size (reinstall NVIDIA's own driver, without shims).", i)]
    return []


def _check_pci_id(declared: DeclaredModel, i, raw) -> list[Finding]:
    """Only a PCI id known to belong to *another* model rejects; an id this table does not know says nothing."""
    parsed = parse_device_id(raw)
    if parsed is None or not declared.pci_device_ids:
        return []
    device, vendor = parsed
    other = slug_for_device_id(device)
    if vendor != NVIDIA_VENDOR_ID or (other and device not in declared.pci_device_ids):
        what = f"belongs to {other}" if other else f"has vendor 0x{vendor:04x}, not NVIDIA"
        return [Finding(REJECT, "pci_device_id",
                        f"GPU {i}'s PCI device id 0x{device:04x} {what}, not to {declared.a_label} "
                        f"({', '.join(f'0x{d:04x}' for d in declared.pci_device_ids)}).", i)]
    return []

