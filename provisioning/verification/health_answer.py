"""The agent's `health` answer checked at the boundary, before the health check believes any of it.

A health check that passes keeps the node's renters billed: it must show the node able to host their VMs, not only
that something answered. An answer counts as healthy only when its runtime works (`runtime_ok` true), its VMs were
listed (`vms`: the platform judges each running instance by that list; without it a dead VM was billed on), and,
where the host itself sees the GPUs (the docker and sim runtimes; libvirt hands each rented card to its VM, out of
the host's nvidia-smi), when nvidia-smi could be read. Each field must have its type: a tampered agent answering
{"ok": true} alone, or a list where the VMs belong, is a failed check naming what is wrong, never an internal error.
Pure: no Django.
"""
from __future__ import annotations

from typing import Any

from provisioning.verification.answers import MAX_GPUS, SHOWN_PROBLEMS, _Check

# Runtimes whose host lists every card in nvidia-smi, rented or not (libvirt binds a rented one to vfio-pci).
HOST_SEES_GPUS = frozenset({"sim", "docker"})
MAX_VMS = 4096  # far more than a server holds; past this the answer is not an agent's
VM_ID_LONGEST = 64
DETAIL_SHOWN = 300


def health_problem(answer: Any, *, runtime: str) -> str:
    """Why a `health` answer does not show a healthy node ('' when it does), in words a provider can act on."""
    check = _Check()
    body = check.obj(answer, "the answer", required=True)
    if body is None:
        return _malformed(check.problems)
    check.flag(body, "runtime_ok", "")
    check.text(body, "runtime_detail", "", 10_000)
    check.text(body, "gpu_error", "", 10_000)
    check.text(body, "inventory_hash", "", 64)
    vms = check.obj(body.get("vms"), "vms")
    if vms is not None:
        if len(vms) > MAX_VMS:
            check.add("vms", f"has {len(vms)} entries, more than {MAX_VMS}")
        for vm_id, state in list(vms.items())[:MAX_VMS]:
            if len(vm_id) > VM_ID_LONGEST:
                check.add("vms", f"names a VM id longer than {VM_ID_LONGEST} characters")
            elif not isinstance(state, str) or len(state) > 40:
                check.add(f"vms.{vm_id}", "is not a state (a short string)")
    uuids = check.items(body.get("gpu_uuids"), "gpu_uuids", most=MAX_GPUS)
    for n, uuid in enumerate(uuids or []):
        if not isinstance(uuid, str) or not 0 < len(uuid) <= 64:
            check.add(f"gpu_uuids[{n}]", "is not a GPU UUID")
    check.json_values(body, "")
    if check.problems:
        return _malformed(check.problems)
    if body.get("runtime_ok") is not True:
        said = str(body.get("runtime_detail") or "no detail")[-DETAIL_SHOWN:]
        return f"its {runtime} runtime does not work ({said}), so its VMs cannot be vouched for"
    if vms is None:
        return f"its agent could not list the {runtime} runtime's VMs, so none of them can be vouched for"
    if runtime in HOST_SEES_GPUS:
        if body.get("gpu_error") is not None:
            return f"its GPUs cannot be read: nvidia-smi failed ({str(body['gpu_error'])[-DETAIL_SHOWN:]})"
        if uuids is None:
            return "its answer does not list the GPUs nvidia-smi shows (gpu_uuids)"
    return ""


def _malformed(problems: list[str]) -> str:
    shown = "; ".join(problems[:SHOWN_PROBLEMS])
    more = len(problems) - SHOWN_PROBLEMS
    return (f"its health answer is malformed: {shown}{f'; and {more} more' if more > 0 else ''}. The platform's "
            "agent does not answer like this on its own: check that nothing changes the agent's files")
