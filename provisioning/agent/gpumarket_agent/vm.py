"""The vm commands: create, start, stop, destroy, list, status, logs."""
import os
import shutil
import time

from .allocation import cards_held, check_and_start, check_gpus_free, remember_addresses, visible_gpus
from .core import RUNTIMES, AgentError, invalid, safe_text, state_or_unknown
from .mig import read_mig, validate_mig_uuids
from .options import validate_registry_auth
from .records import RecordUnreadable, all_records, file_lock, load_record, save_record, scan_records, vm_dir, vm_log
from .runtimes import RUNTIME_CLASSES
from .validation import PLATFORM_VM_ID_RE, reject_unknown, validate_create, validate_gpus, validate_vm_id
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
    """The VM as answered. Its os and host key were read from the image, and a record an older agent wrote may hold
    a NUL in them (safe_text): every later answer about the VM was refused."""
    host = rt.host()
    return {"vm_id": rec["vm_id"], "runtime": rec["runtime"], "state": state, "ssh_host": host,
            "ssh_port": rec.get("ssh_port"), "ssh_user": rt.ssh_user,
            "ssh_host_key": safe_text(rec.get("ssh_host_key")), "gpu_indices": rec["spec"]["gpu_indices"],
            "created_at": rec.get("created_at"),
            "ports": {name: {"host": host, "port": port} for name, port in sorted((rec.get("ports") or {}).items())},
            "os": safe_text(rec.get("os")), "disk_gb": rec["spec"].get("disk_gb"), "disk_limit": rt.disk_limit(rec)}


def vm_create(cfg, req):
    runtime, rt = pick_runtime(cfg, req)
    gpus = visible_gpus(rt)
    vm_id, spec = validate_create(req, runtime, [g["index"] for g in gpus], cfg.internal_registries)
    cards = cards_held(rt, {"vm_id": vm_id, "spec": spec}, gpus)  # refused before anything is recorded
    if "mig_uuids" in spec:
        check_mig_uuids(cfg, gpus, spec)
    registry_auth = validate_registry_auth(req.get("registry_auth"))  # used for the pull only, never recorded
    rt.check_spec(spec)
    with file_lock(cfg, "vm-" + vm_id, timeout=300):
        with file_lock(cfg, "allocate", timeout=60), file_lock(cfg, "volumes", timeout=60):
            # GPUs, ports and volumes are node-wide; a volume cannot be deleted while a VM mounting it is recorded
            rec = load_record(cfg, vm_id)
            created = rec is None
            if rec is not None and (not same_spec(rec["spec"], spec) or rec["runtime"] != runtime):
                raise AgentError("conflict", "VM %s exists with a different spec" % vm_id)
            if created:
                others = all_records(cfg)
                check_gpus_free(rt, others, spec["gpu_indices"], spec.get("mig_uuids"), spec.get("gpu_uuids"), gpus)
                check_volumes_exist(cfg, spec)
                # `provisioning`: it holds its GPUs from now until this create ends (allocation.holds_gpus)
                rec = {"vm_id": vm_id, "runtime": runtime, "spec": spec, "provisioning": True,
                       "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                rt.allocate(rec, others)
                remember_addresses(rt, rec, cards)
                save_record(cfg, rec)  # first, so a crash below leaves a record that a retry completes
                vm_log(cfg, vm_id, "created VM %s (%s runtime)" % (vm_id, runtime))
            elif rt.state(rec) == "missing":
                # A create retried for a record without its container or domain (the first failed before making
                # it, or it was removed on the node): it holds its GPUs through its pull again, as a first create
                # does (a finished record whose VM is missing holds none: allocation.holds_gpus), once no other VM
                # holds them.
                others = [r for r in all_records(cfg) if r["vm_id"] != vm_id]
                held = rec["spec"]
                check_gpus_free(rt, others, held["gpu_indices"], held.get("mig_uuids"), held.get("gpu_uuids"), gpus)
                rec["provisioning"] = True
                save_record(cfg, rec)
        try:
            # Idempotent: finishes what an earlier, interrupted create began. It starts the VM only after the GPU
            # check under the allocate lock (Runtime.checked_start): a retried create of a VM whose GPUs another
            # VM took meanwhile fails with gpu_busy rather than starting it beside that one.
            rt.provision(rec, registry_auth)
        except Exception:
            if created:
                discard(cfg, rt, rec)
            elif rec.pop("provisioning", None):
                save_record(cfg, rec)  # a retry that failed: the VM holds no GPUs unless it runs
            raise
        rec.pop("provisioning", None)
        save_record(cfg, rec)
        answer = describe(cfg, rt, rec, rt.state(rec))
        answer["created"] = created
        return answer


def discard(cfg, rt, rec):
    """Undo a first create that failed: its container or domain, then its record. A removal that fails keeps the
    record (no longer `provisioning`), so that the VM stays listed as recorded and a later `vm destroy` (the
    platform's, for the failed create) finishes it. Before, the record went all the same: the VM was left on the
    node as an unrecorded one that `vm destroy` did not remove."""
    try:
        rt.destroy(rec)
    except Exception as exc:  # noqa: BLE001 - the create's own error is the one raised
        rec.pop("provisioning", None)
        save_record(cfg, rec)
        vm_log(cfg, rec["vm_id"], "the failed create could not remove its VM (%s); a destroy removes it"
               % str(getattr(exc, "message", exc))[:300])
        return
    shutil.rmtree(vm_dir(cfg, rec["vm_id"]), ignore_errors=True)


def destroy_unrecorded(cfg, rt, vm_id):
    """`vm destroy` of a VM with no record: what the runtime has of it (a container or domain unrecorded() lists:
    a crash between making it and recording it) is removed all the same, with its folder; `existed` says whether
    anything was. Before, it answered existed: false and left it, so the reconciler "destroyed" the same orphan at
    every pass. Only under a name the platform gives (PLATFORM_VM_ID_RE): any other gpumarket-* container or
    domain is no VM of the platform's, and is left as it is (existed: false), its disk and folder too (found by
    review: libvirt's removal undefined any such domain and deleted its work folder)."""
    if not PLATFORM_VM_ID_RE.fullmatch(vm_id):
        return {"vm_id": vm_id, "state": "destroyed", "existed": False}
    existed = rt.destroy_unrecorded(vm_id)
    if os.path.isdir(vm_dir(cfg, vm_id)):
        shutil.rmtree(vm_dir(cfg, vm_id), ignore_errors=True)
        existed = True
    return {"vm_id": vm_id, "state": "destroyed", "existed": bool(existed)}


def destroy_missing(cfg, rt, rec):
    """`vm destroy` with only_if_missing: the record of a VM whose container or domain is gone, decided under the
    VM's lock; a VM whose container or domain is there is left as it is (conflict). The platform sends it for an
    instance it failed because its VM was gone: the record counted as mounting its volumes, so the renter's volume
    delete was refused (volume_in_use) until the instance was destroyed, and a VM the engine still has must not be
    removed on that ground (found by review). Only the record: no engine command, and what the runtime keeps beside
    the engine stays (libvirt's work folder with disk.qcow2: an undefined domain's disk is the renter's data, and
    'missing' may be a libvirt that lost its definitions for a while; found by review). The instance's destroy
    removes it (an unrecorded destroy: destroy_unrecorded deletes the work folder of an inst-<id>)."""
    state = rt.state(rec)
    if state != "missing":
        raise AgentError("conflict", "VM %s is on this node (%s), not missing: not removed" % (rec["vm_id"], state))
    shutil.rmtree(vm_dir(cfg, rec["vm_id"]), ignore_errors=True)
    return {"vm_id": rec["vm_id"], "state": "destroyed", "existed": True}


def vm_gone(rt, rec):
    """The not_found answer for a recorded VM whose container or domain is missing (removed on the node: `docker
    container prune`, an undefined domain): it cannot be started or stopped, only destroyed. The platform takes it
    as a VM gone (the instance failed, its disk no longer billed, its GPUs freed); before, a start failed with
    command_failed and the instance was stopped again, "start it again", at every try."""
    what = "domain" if rt.name == "libvirt" else "container"
    return AgentError("not_found", "VM %s is recorded on this node, but its %s is gone (removed on the node): it "
                                   "cannot run again; destroy it" % (rec["vm_id"], what))


def same_spec(recorded, spec):
    """Whether a retried create asks for the VM recorded. A record made before the platform sent gpu_uuids takes
    them from the retry (the start checks them)."""
    if "gpu_uuids" in spec and "gpu_uuids" not in recorded and dict(recorded, gpu_uuids=spec["gpu_uuids"]) == spec:
        recorded["gpu_uuids"] = spec["gpu_uuids"]
    return recorded == spec


def check_mig_uuids(cfg, gpus, spec):
    """The MIG devices asked for exist on the node, on the GPUs asked for."""
    validate_mig_uuids(spec["mig_uuids"])
    on = {d["uuid"]: d["gpu"] for d in read_mig(cfg, gpus)}
    for uuid in spec["mig_uuids"]:
        if on.get(uuid) not in spec["gpu_indices"]:
            raise invalid("mig_uuids", "no MIG device %s on GPU %s of this node" % (uuid, spec["gpu_indices"]))


def vm_start(cfg, rt, rec, req):
    """Start a VM; with `gpu_indices` (and their `gpu_uuids`), first move it onto those GPUs (they may differ after
    a stop, or be its own cards numbered anew). Without, it starts on the cards its record names, checked."""
    gpus = visible_gpus(rt)
    wanted = uuids = None
    if req.get("gpu_indices") is not None:
        wanted, uuids = validate_gpus(req, [g["index"] for g in gpus])
    elif req.get("gpu_uuids") is not None:
        raise invalid("gpu_uuids", "gpu_uuids comes with gpu_indices: one UUID per index")
    with file_lock(cfg, "allocate", timeout=60):
        all_records(cfg)  # refused while another VM's record cannot be read (its GPUs and ports are not known)
        if wanted is not None:
            take_gpus(rt, rec, wanted, uuids)
        check_and_start(rt, rec, gpus)
    save_record(cfg, rec)  # the port or the GPUs may have changed


def compatible(a, b):
    """Two UUID lists for the same indices that name no card differently (a None names none)."""
    return all(x is None or y is None or x == y for x, y in zip(a, b))  # noqa: B905 - python3.8


def take_gpus(rt, rec, indices, uuids):
    """Give the VM the GPUs of a start request. The same indices keep the cards recorded (their UUIDs completed
    from the request); the same cards numbered anew stay the VM's, running or not; other cards are bound to a
    stopped VM only. rt.rebind does either: where a runtime names its cards by UUID or PCI address (docker, libvirt),
    the same cards need no change; where by index, it refuses what it cannot do safely."""
    spec = rec["spec"]
    old = spec.get("gpu_uuids")
    if indices == spec["gpu_indices"] and (uuids is None or old is None or compatible(old, uuids)):
        if uuids is not None:
            spec["gpu_uuids"] = [x or y for x, y in zip(old or uuids, uuids)]  # noqa: B905 - python3.8
        return
    same_cards = bool(old and uuids) and None not in old and None not in uuids and set(old) == set(uuids)
    if not same_cards and rt.state(rec) in ("running", "restarting"):
        raise AgentError("conflict", "VM %s is running; stop it before moving it to other GPUs" % rec["vm_id"])
    spec["gpu_indices"] = indices
    if uuids is None:
        spec.pop("gpu_uuids", None)  # other indices, cards unnamed: the recorded UUIDs are not theirs
    else:
        spec["gpu_uuids"] = uuids
    rt.rebind(rec)  # a runtime that names its cards by UUID or PCI address has nothing to change for the same cards


def vm_simple(cfg, req, action):
    _, rt = pick_runtime(cfg, req)
    allowed = {"start": ("vm_id", "gpu_indices", "gpu_uuids"), "logs": ("vm_id", "tail"),
               "destroy": ("vm_id", "only_if_missing"), "status": ("vm_id", "probe_ssh")}.get(action, ("vm_id",))
    reject_unknown(req, allowed)
    vm_id = validate_vm_id(req.get("vm_id"))
    only_if_missing, probe_ssh = req.get("only_if_missing", False), req.get("probe_ssh", False)
    if type(only_if_missing) is not bool:
        raise invalid("only_if_missing", "only_if_missing must be true or false")
    if type(probe_ssh) is not bool:
        raise invalid("probe_ssh", "probe_ssh must be true or false")
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
        try:
            rec = load_record(cfg, vm_id)
        except RecordUnreadable as exc:
            return unreadable_vm(cfg, rt, exc, action, only_if_missing)
        if rec is None:
            if action == "destroy":
                if only_if_missing:  # no record to remove; a container or domain of that name is not missing
                    return {"vm_id": vm_id, "state": "destroyed", "existed": False}
                return destroy_unrecorded(cfg, rt, vm_id)
            raise AgentError("not_found", "no VM %s on this node" % vm_id)
        if only_if_missing:
            return destroy_missing(cfg, rt, rec)
        if action in ("start", "stop") and rt.state(rec) == "missing":
            raise vm_gone(rt, rec)
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
        state = rt.state(rec)
        answer = describe(cfg, rt, rec, state)
        if probe_ssh:  # does its SSH server answer on the node itself? (the platform could not reach it)
            answer["ssh_answers"] = rt.ssh_answers(rec) if state == "running" else False
        return answer


def unreadable_vm(cfg, rt, exc, action, only_if_missing):
    """A VM whose record cannot be read (records.RecordUnreadable): its status is "unknown", with the reason; a
    destroy removes what the runtime has of it by its name, and its folder (destroy_unrecorded); start, stop, logs
    and a destroy only_if_missing (whether it is missing cannot be told) are refused with the reason."""
    if action == "status":
        return {"vm_id": exc.vm_id, "state": "unknown", "error": exc.message}
    if action == "destroy" and not only_if_missing:
        return destroy_unrecorded(cfg, rt, exc.vm_id)
    raise exc


def vm_list(cfg, req):
    _, rt = pick_runtime(cfg, req)
    reject_unknown(req, ())
    records, unreadable = scan_records(cfg)
    vms = []
    for rec in records:  # a VM whose state the engine cannot give is "unknown", the others listed all the same
        state, error = state_or_unknown(rt, rec)
        vms.append(dict(describe(cfg, rt, rec, state), **({"error": error} if error else {})))
    # A record that cannot be read: "unknown" too (the platform leaves it unjudged), never an unrecorded VM to remove.
    vms += [{"vm_id": vm_id, "state": "unknown", "error": message} for vm_id, message in sorted(unreadable.items())]
    vms += rt.unrecorded({r["vm_id"] for r in records} | set(unreadable))
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
