"""The volume commands: create, delete, list. A volume outlives the VMs that mount it (stop, start, destroy).

The record is <state>/volumes/<name>/volume.json; the runtime keeps the data (sim: <name>/data, a directory;
docker: an engine volume of the same name). The size is recorded, and enforced only where the runtime can."""
import json
import os
import shutil
import time

from .core import AgentError, invalid, read_json, write_file
from .options import VOLUME_NAME_RE
from .records import all_records, file_lock
from .validation import reject_unknown

MAX_VOLUME_GB = 65536


def volumes_root(cfg):
    return os.path.join(cfg.state_dir, "volumes")


def volume_dir(cfg, name):
    return os.path.join(volumes_root(cfg), name)


def load_volume(cfg, name):
    try:
        return read_json(os.path.join(volume_dir(cfg, name), "volume.json"))
    except (OSError, ValueError):
        return None


def all_volumes(cfg):
    root = volumes_root(cfg)
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [v for v in (load_volume(cfg, n) for n in names if VOLUME_NAME_RE.fullmatch(n)) if v]


def used_by(records, name):
    return sorted(r["vm_id"] for r in records if any(v["name"] == name for v in r["spec"].get("volumes", ())))


def validate_volume_name(value):
    if not isinstance(value, str) or not VOLUME_NAME_RE.fullmatch(value):
        raise invalid("name", "name must match vol-[a-z0-9]{8,32}")
    return value


def check_volumes_exist(cfg, spec):
    """Called under the volumes lock while a VM that mounts them is recorded."""
    for item in spec.get("volumes", ()):
        if load_volume(cfg, item["name"]) is None:
            raise AgentError("not_found", "no volume %s on this node" % item["name"], "volumes")


def volume_create(cfg, rt, req):
    reject_unknown(req, ("name", "size_gb"))
    name = validate_volume_name(req.get("name"))
    size = req.get("size_gb")
    if type(size) is not int or not 1 <= size <= MAX_VOLUME_GB:
        raise invalid("size_gb", "size_gb must be an integer from 1 to %d" % MAX_VOLUME_GB)
    with file_lock(cfg, "volumes", timeout=60):
        rec = load_volume(cfg, name)
        if rec is not None and rec["size_gb"] != size:
            raise AgentError("conflict", "volume %s exists with %d GB" % (name, rec["size_gb"]))
        os.makedirs(volume_dir(cfg, name), mode=0o700, exist_ok=True)
        # Idempotent: finishes an earlier, interrupted create. size_limit: whether the engine enforces size_gb.
        size_limit = rt.volume_create(name, size)
        if rec is None:
            rec = {"name": name, "size_gb": size, "runtime": rt.name, "size_limit": size_limit,
                   "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            write_file(os.path.join(volume_dir(cfg, name), "volume.json"), json.dumps(rec, indent=1, sort_keys=True))
            return {"name": name, "size_gb": size, "created": True, "size_limit": size_limit}
        return {"name": name, "size_gb": size, "created": False, "size_limit": size_limit}


def volume_delete(cfg, rt, req):
    reject_unknown(req, ("name",))
    name = validate_volume_name(req.get("name"))
    with file_lock(cfg, "volumes", timeout=60):
        users = used_by(all_records(cfg), name)
        if users:
            raise AgentError("volume_in_use", "volume %s is mounted by VM %s; destroy it first" % (
                name, ", ".join(users)))
        existed = load_volume(cfg, name) is not None
        rt.volume_delete(name)
        shutil.rmtree(volume_dir(cfg, name), ignore_errors=True)
        return {"name": name, "deleted": existed}


def volume_list(cfg, rt, req):
    reject_unknown(req, ())
    records = all_records(cfg)
    return {"volumes": [{"name": v["name"], "size_gb": v["size_gb"], "used_by": used_by(records, v["name"])}
                        for v in all_volumes(cfg)]}


def cmd_volume(cfg, rt, req, sub):
    commands = {"create": volume_create, "delete": volume_delete, "list": volume_list}
    if sub not in commands:
        raise invalid("command", "volume needs one of: create, delete, list")
    return commands[sub](cfg, rt, req)
