"""Which VMs hold which GPUs, checked under the node-wide allocate lock immediately before any VM starts."""
from .core import AgentError
from .records import all_records, file_lock


def holds_gpus(rt, rec):
    """A running VM holds its GPUs; so does one whose create has not finished (recorded, maybe pulling, its
    container not made or not started yet: `provisioning` in its record, or a recorded VM whose container or
    domain is missing, as one recorded by an older agent mid-create), until that create ends or the VM is
    destroyed. The platform releases a stopped VM's GPUs to other renters: a stopped VM holds none."""
    return bool(rec.get("provisioning")) or rt.state(rec) in ("running", "missing")


def check_gpus_free(rt, others, indices, mig_uuids=None):
    """A VM given MIG slices holds only those slices of its GPU; a VM given a whole GPU holds it and every slice
    of it."""
    holding = [r["spec"] for r in others if holds_gpus(rt, r)]
    whole = {i for s in holding if not s.get("mig_uuids") for i in s["gpu_indices"]}
    sliced = {i for s in holding if s.get("mig_uuids") for i in s["gpu_indices"]}
    slices = {u for s in holding for u in s.get("mig_uuids") or ()}
    busy = sorted(whole & set(indices)) if mig_uuids else sorted((whole | sliced) & set(indices))
    if busy:
        raise AgentError("gpu_busy", "GPU %d is in use by another running VM" % busy[0])
    taken = sorted(slices & set(mig_uuids or ()))
    if taken:
        raise AgentError("gpu_busy", "MIG device %s is in use by another running VM" % taken[0])


def check_and_start(rt, rec):
    """The GPU check and the start, with the allocate lock already held (vm start holds it while it rebinds)."""
    others = [r for r in all_records(rt.cfg) if r["vm_id"] != rec["vm_id"]]
    check_gpus_free(rt, others, rec["spec"]["gpu_indices"], rec["spec"].get("mig_uuids"))
    rt.start(rec)


def checked_start(rt, rec):
    """Start a VM only if no other VM holds its GPUs, under the allocate lock: every start goes through here
    (a create's, a retried create's, vm start's), so two VMs never run on one GPU whatever the order of calls."""
    with file_lock(rt.cfg, "allocate", timeout=60):
        check_and_start(rt, rec)
