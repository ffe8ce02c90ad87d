"""VM records on disk, locks, host ports and VM logs."""
import contextlib
import fcntl
import json
import os
import time

from .core import AgentError, read_json, safe_text, write_file
from .procs import port_free
from .validation import VM_ID_RE


def vm_dir(cfg, vm_id):
    return os.path.join(cfg.state_dir, "vms", vm_id)


class RecordUnreadable(AgentError):
    """A VM's record (vm.json) that is there but cannot be read: empty or cut short (a power loss soon after it was
    written, before core.write_file synced), or not a record. The VM is not taken as none: `vm list`, `vm status`
    and the health answer give it as state "unknown" with this message (the platform judges it neither gone nor
    stopped, and keeps its GPUs held and its instance as it is), start, stop, logs and create refuse it, and only
    `vm destroy` removes it (its container or domain by name, and its folder). Before, it was taken as no VM: its
    instance failed as gone while its container ran on, and its GPUs counted as free (review r54 #3)."""

    def __init__(self, vm_id, why):
        super().__init__("record_unreadable", (
            "the agent's record of VM %s (%s) cannot be read (%s): the VM is left as it is; restore the file, or "
            "destroy the VM") % (vm_id, os.path.join("vms", vm_id, "vm.json"), why))
        self.vm_id = vm_id


def load_record(cfg, vm_id):
    """The VM's record, or None when it has none (no vm.json); RecordUnreadable for one that cannot be read."""
    try:
        rec = read_json(os.path.join(vm_dir(cfg, vm_id), "vm.json"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RecordUnreadable(vm_id, "%s: %s" % (type(exc).__name__, str(exc)[:200])) from None
    if not isinstance(rec, dict) or not isinstance(rec.get("spec"), dict) or rec.get("vm_id") != vm_id:
        raise RecordUnreadable(vm_id, "not a VM record")
    return rec


def save_record(cfg, rec):
    os.makedirs(vm_dir(cfg, rec["vm_id"]), exist_ok=True)
    write_file(os.path.join(vm_dir(cfg, rec["vm_id"]), "vm.json"), json.dumps(rec, indent=1, sort_keys=True))


def scan_records(cfg):
    """(records, unreadable): the VMs' readable records, and {vm_id: message} for those whose record cannot be read
    (RecordUnreadable), which `vm list` and the health answer give as state "unknown"."""
    root = os.path.join(cfg.state_dir, "vms")
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    records, unreadable = [], {}
    for name in names:
        if not VM_ID_RE.fullmatch(name):
            continue
        try:
            rec = load_record(cfg, name)
        except RecordUnreadable as exc:
            unreadable[name] = exc.message
            continue
        if rec is not None:
            records.append(rec)
    return records, unreadable


def all_records(cfg):
    """Every VM's record, for handing out or freeing GPUs, host ports and volumes (vm create, vm start, volume
    delete and list). While any record cannot be read, `record_unreadable` naming it: which GPUs, ports and volumes
    that VM holds is not known here, and its container may run on (docker's unless-stopped), so none of them may go
    to another VM, nor its volume be deleted, until an operator restores the file or the VM is destroyed. Before, an
    unreadable record held nothing, and the next create was given its GPU and SSH port (review r54 own MEDIUM-2).
    `vm list`, `vm status`, the health answer and `vm destroy` read scan_records / load_record instead."""
    records, unreadable = scan_records(cfg)
    if unreadable:
        vm_id = sorted(unreadable)[0]
        raise AgentError("record_unreadable", (
            "%s. Until it is restored or VM %s destroyed, no VM is created or started and no volume is deleted on "
            "this node: which GPUs, ports and volumes VM %s holds is not known") % (unreadable[vm_id], vm_id, vm_id))
    return records


@contextlib.contextmanager
def file_lock(cfg, name, timeout):
    """flock on <state>/locks/<name>: agent runs for one node may overlap (retries, parallel tasks)."""
    os.makedirs(os.path.join(cfg.state_dir, "locks"), exist_ok=True)
    fd = os.open(os.path.join(cfg.state_dir, "locks", name + ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AgentError("busy", "another agent run holds the %s lock" % name) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def used_ports(records):
    """Host ports the recorded VMs hold: SSH and every mapped container port."""
    used = {r.get("ssh_port") for r in records}
    for rec in records:
        used.update((rec.get("ports") or {}).values())
    return used


def pick_host_port(cfg, records, taken=()):
    used = used_ports(records) | set(taken)
    for port in range(cfg.port_range[0], cfg.port_range[1] + 1):
        if port not in used and port_free(port):
            return port
    raise AgentError("no_free_port", "no free port in GPUMARKET_PORT_RANGE %d-%d" % cfg.port_range)


# ------------------------------------------------------------------------------------------------- logs
# A VM's log (<vm dir>/vm.log): the agent's own lines ("<UTC time> [gpumarket] ...": pull, boot, onstart) and,
# on the sim runtime, onstart's output. Never a secret: the registry password is never passed to a logger.
LOG_MAX_BYTES = 1 << 20


def log_time():
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + ".%09dZ" % int((now % 1) * 1e9)


def log_path(cfg, vm_id):
    return os.path.join(vm_dir(cfg, vm_id), "vm.log")


def append_log(path, lines, prefix="[gpumarket] "):
    """Append lines, each with the time; keep the file under LOG_MAX_BYTES by dropping its older half."""
    stamp = log_time()
    text = "".join("%s %s%s\n" % (stamp, prefix, line.rstrip("\n")) for line in lines)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8", errors="replace") as f:
        f.write(text)
        size = f.tell()
    if size > LOG_MAX_BYTES:
        with open(path, "rb") as f:
            f.seek(size - LOG_MAX_BYTES // 2)
            rest = f.read().split(b"\n", 1)[-1]
        with open(path + ".tmp", "wb") as f:
            f.write(rest)
        os.chmod(path + ".tmp", 0o600)
        os.replace(path + ".tmp", path)


def vm_log(cfg, vm_id, *lines):
    os.makedirs(vm_dir(cfg, vm_id), exist_ok=True)
    append_log(log_path(cfg, vm_id), lines)


def tail_lines(path, n):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_MAX_BYTES))
            data = f.read()
    except FileNotFoundError:
        return []
    # A sim VM's onstart output lands here, as printed: a NUL in it made the whole logs answer refused (safe_text).
    return [safe_text(ln.decode("utf-8", "replace")) for ln in data.splitlines()][-n:]
