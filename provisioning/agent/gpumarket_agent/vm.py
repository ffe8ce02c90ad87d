"""The vm commands: create, start, stop, destroy, list, status, logs."""
import contextlib
import shutil
import time

from .allocation import check_and_start, check_gpus_free
from .core import RUNTIMES, AgentError, invalid
from .mig import read_mig, validate_mig_uuids
from .options import validate_registry_auth
from .records import all_records, file_lock, load_record, save_record, vm_dir, vm_log
from .runtimes import RUNTIME_CLASSES
from .smi import read_gpus
from .validation import reject_unknown, validate_create, validate_gpu_indices, validate_vm_id
from .volumes import check_volumes_exist, cmd_volume

MAX_LOG_TAIL = 5000


def pick_runtime(cfg, req):
    runtime = req.get("runtime", cfg.runtime)
    if runtime not in RUNTIMES:
        raise invalid("runtime", "runtime must be one of %s" % ", ".join(RUNTIMES))
    if cfg.runtime and runtime != cfg.runtime:
        raise invalid("runtime", "this node runs %s VMs, not %s" % (cfg.runtime, runtime))
    return runtime, RUNTIME_CLASSES[runtime](cfg)


def describe(cfg, rt, rec, state):
    host = rt.host()
    return {"vm_id": rec["vm_id"], "runtime": rec["runtime"], "state": state, "ssh_host": host,
            "ssh_port": rec.get("ssh_port"), "ssh_user": rt.ssh_user,
            "ssh_host_key": rec.get("ssh_host_key"), "gpu_indices": rec["spec"]["gpu_indices"],
            "created_at": rec.get("created_at"),
            "ports": {name: {"host": host, "port": port} for name, port in sorted((rec.get("ports") or {}).items())},
            "os": rec.get("os"), "disk_gb": rec["spec"].get("disk_gb"), "disk_limit": rt.disk_limit(rec)}


def vm_create(cfg, req):
    runtime, rt = pick_runtime(cfg, req)
    gpus = read_gpus(cfg)[0]
    vm_id, spec = validate_create(req, runtime, [g["index"] for g in gpus])
    if "mig_uuids" in spec:
        check_mig_uuids(cfg, gpus, spec)
    registry_auth = validate_registry_auth(req.get("registry_auth"))  # used for the pull only, never recorded
    rt.check_spec(spec)
    with file_lock(cfg, "vm-" + vm_id, timeout=300):
        with file_lock(cfg, "allocate", timeout=60), file_lock(cfg, "volumes", timeout=60):
            # GPUs, ports and volumes are node-wide; a volume cannot be deleted while a VM mounting it is recorded
            rec = load_record(cfg, vm_id)
            created = rec is None
            if rec is not None and (rec["spec"] != spec or rec["runtime"] != runtime):
                raise AgentError("conflict", "VM %s exists with a different spec" % vm_id)
            if created:
                others = all_records(cfg)
                check_gpus_free(rt, others, spec["gpu_indices"], spec.get("mig_uuids"))
                check_volumes_exist(cfg, spec)
                # `provisioning`: it holds its GPUs from now until this create ends (allocation.holds_gpus)
                rec = {"vm_id": vm_id, "runtime": runtime, "spec": spec, "provisioning": True,
                       "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                rt.allocate(rec, others)
                save_record(cfg, rec)  # first, so a crash below leaves a record that a retry completes
                vm_log(cfg, vm_id, "created VM %s (%s runtime)" % (vm_id, runtime))
        try:
            # Idempotent: finishes what an earlier, interrupted create began. It starts the VM only after the GPU
            # check under the allocate lock (Runtime.checked_start): a retried create of a VM whose GPUs another
            # VM took meanwhile fails with gpu_busy rather than starting it beside that one.
            rt.provision(rec, registry_auth)
        except Exception:
            if created:
                with contextlib.suppress(Exception):
                    rt.destroy(rec)
                shutil.rmtree(vm_dir(cfg, vm_id), ignore_errors=True)
            elif rec.pop("provisioning", None):
                save_record(cfg, rec)  # a retry that failed: the VM holds no GPUs unless it runs
            raise
        rec.pop("provisioning", None)
        save_record(cfg, rec)
        answer = describe(cfg, rt, rec, rt.state(rec))
        answer["created"] = created
        return answer


def check_mig_uuids(cfg, gpus, spec):
    """The MIG devices asked for exist on the node, on the GPUs asked for."""
    validate_mig_uuids(spec["mig_uuids"])
    on = {d["uuid"]: d["gpu"] for d in read_mig(cfg, gpus)}
    for uuid in spec["mig_uuids"]:
        if on.get(uuid) not in spec["gpu_indices"]:
            raise invalid("mig_uuids", "no MIG device %s on GPU %s of this node" % (uuid, spec["gpu_indices"]))


def vm_start(cfg, rt, rec, req):
    """Start a VM; with `gpu_indices`, first move it onto those GPUs (they may differ after a stop)."""
    wanted = req.get("gpu_indices")
    if wanted is not None:
        wanted = validate_gpu_indices(wanted, [g["index"] for g in read_gpus(cfg)[0]])
    with file_lock(cfg, "allocate", timeout=60):
        if wanted is not None and wanted != rec["spec"]["gpu_indices"]:
            if rt.state(rec) == "running":
                raise AgentError("conflict", "VM %s is running; stop it before moving it to other GPUs" % rec["vm_id"])
            rec["spec"]["gpu_indices"] = wanted
            rt.rebind(rec)
        check_and_start(rt, rec)
    save_record(cfg, rec)  # the port or the GPUs may have changed


def vm_simple(cfg, req, action):
    _, rt = pick_runtime(cfg, req)
    allowed = {"start": ("vm_id", "gpu_indices"), "logs": ("vm_id", "tail")}.get(action, ("vm_id",))
    reject_unknown(req, allowed)
    vm_id = validate_vm_id(req.get("vm_id"))
    if action == "logs":
        tail = req.get("tail", 200)
        if type(tail) is not int or not 1 <= tail <= MAX_LOG_TAIL:
            raise invalid("tail", "tail must be an integer from 1 to %d" % MAX_LOG_TAIL)
        # Read without the VM's lock: a create holds it through a long pull, whose progress the logs show.
        rec = load_record(cfg, vm_id)
        if rec is None:
            raise AgentError("not_found", "no VM %s on this node" % vm_id)
        return {"vm_id": vm_id, "lines": rt.logs(rec, tail)}
    with file_lock(cfg, "vm-" + vm_id, timeout=300):
        rec = load_record(cfg, vm_id)
        if rec is None:
            if action == "destroy":
                return {"vm_id": vm_id, "state": "destroyed", "existed": False}
            raise AgentError("not_found", "no VM %s on this node" % vm_id)
        if action == "start":
            vm_log(cfg, vm_id, "starting")
            vm_start(cfg, rt, rec, req)
        elif action == "destroy":
            rt.destroy(rec)
            shutil.rmtree(vm_dir(cfg, vm_id), ignore_errors=True)
            return {"vm_id": vm_id, "state": "destroyed", "existed": True}
        elif action == "stop":
            vm_log(cfg, vm_id, "stopping")
            rt.stop(rec)
            save_record(cfg, rec)
        return describe(cfg, rt, rec, rt.state(rec))


def vm_list(cfg, req):
    _, rt = pick_runtime(cfg, req)
    reject_unknown(req, ())
    records = all_records(cfg)
    vms = [describe(cfg, rt, rec, rt.state(rec)) for rec in records]
    vms += rt.unrecorded({r["vm_id"] for r in records})
    return {"vms": vms}


def cmd_vm(cfg, req, sub):
    if sub == "create":
        return vm_create(cfg, req)
    if sub == "list":
        return vm_list(cfg, req)
    if sub in ("start", "stop", "destroy", "status", "logs"):
        return vm_simple(cfg, req, sub)
    raise invalid("command", "vm needs one of: create, start, stop, destroy, list, status, logs")


def cmd_volumes(cfg, req, sub):
    _, rt = pick_runtime(cfg, req)
    return cmd_volume(cfg, rt, req, sub)
