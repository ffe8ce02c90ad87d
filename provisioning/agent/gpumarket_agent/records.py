"""VM records on disk, locks and host ports."""
import contextlib
import fcntl
import json
import os
import time

from .core import AgentError, read_json, write_file
from .procs import port_free
from .validation import VM_ID_RE


def vm_dir(cfg, vm_id):
    return os.path.join(cfg.state_dir, "vms", vm_id)


def load_record(cfg, vm_id):
    try:
        return read_json(os.path.join(vm_dir(cfg, vm_id), "vm.json"))
    except (OSError, ValueError):
        return None


def save_record(cfg, rec):
    os.makedirs(vm_dir(cfg, rec["vm_id"]), exist_ok=True)
    write_file(os.path.join(vm_dir(cfg, rec["vm_id"]), "vm.json"), json.dumps(rec, indent=1, sort_keys=True))


def all_records(cfg):
    root = os.path.join(cfg.state_dir, "vms")
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [r for r in (load_record(cfg, n) for n in names if VM_ID_RE.fullmatch(n)) if r]


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


def pick_host_port(cfg, records):
    used = {r.get("ssh_port") for r in records}
    for port in range(cfg.port_range[0], cfg.port_range[1] + 1):
        if port not in used and port_free(port):
            return port
    raise AgentError("no_free_port", "no free port in GPUMARKET_PORT_RANGE %d-%d" % cfg.port_range)
