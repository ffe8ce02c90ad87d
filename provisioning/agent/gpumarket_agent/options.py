"""The renter's own options on `vm create`: registry_auth, env, onstart, ports, volumes (contract: issue 12), and
image_env, the platform's word that the image is the renter's own, whose command gets the env (dockerbox.py).

Only options actually given go into the spec, so a VM recorded before they existed compares equal on a retry."""
import posixpath
import re

from .core import invalid

ENV_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
# Names the host's container runtime hooks read from a container's environment, never a renter's to set: the
# NVIDIA container runtime/toolkit takes NVIDIA_VISIBLE_DEVICES (=all: every GPU of the node where --gpus is not
# used), NVIDIA_DRIVER_CAPABILITIES, NVIDIA_REQUIRE_*, NVIDIA_DISABLE_REQUIRE, NVIDIA_MIG_*... So: every name
# starting with NVIDIA_. CUDA_VISIBLE_DEVICES and the like only change what CUDA sees of the GPUs the container
# already has, and stay allowed.
RESERVED_ENV_PREFIXES = ("NVIDIA_",)
VOLUME_NAME_RE = re.compile(r"vol-[a-z0-9]{8,32}")
MAX_ENV, MAX_ENV_VALUE, MAX_ENV_BYTES = 64, 4096, 32768
MAX_ONSTART, MAX_PORTS, MAX_VOLUMES = 16384, 16, 8
# The system's own folders, never a renter's volume (the platform refuses the same: marketplace/services/volumes.py
# _SYSTEM_MOUNT_ROOTS): the kernel's (/proc, /sys, /dev) and what the VM's SSH server and the entry wrapper need to
# start it: its program and libraries (/usr, and /bin, /sbin, /lib* where they are not links into /usr), its
# configuration and host keys (/etc, /etc/ssh), its run-time and privilege-separation folders (/run, /var/run,
# /var/empty), and /boot. A volume over one (its content the renter's) could keep sshd from starting, which made
# a catalogue image's silent SSH server the renter's doing rather than the node's (found by review).
FORBIDDEN_MOUNTS = ("/proc", "/sys", "/dev", "/bin", "/boot", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/run",
                    "/sbin", "/usr", "/var/empty", "/var/run")
AUTHORIZED_KEYS_MOUNT = "/root/.ssh/authorized_keys"  # the renter's SSH keys, bound read-only into the container
# The agent's own mounts in a container (the platform refuses the same: marketplace/services/volumes.py
# _FORBIDDEN_MOUNT_ROOTS). A volume at the keys' path was taken, and docker refused the create: "Duplicate mount
# point", counted as the node's failure (found by review).
RESERVED_MOUNTS = ("/.gpumarket", "/.gpumarket-state", AUTHORIZED_KEYS_MOUNT)


def _text(value, field, limit):
    if not isinstance(value, str) or "\x00" in value or len(value) > limit:
        raise invalid(field, "%s must be a string of at most %d characters without NUL" % (field, limit))
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(field, "%s is not valid Unicode text" % field) from None
    return value


def validate_registry_auth(value):
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"username", "password"}:
        raise invalid("registry_auth", "registry_auth must be an object with exactly 'username' and 'password'")
    user, password = value["username"], value["password"]
    if not isinstance(user, str) or not 0 < len(user) <= 255 or ":" in user or \
            any(ord(ch) < 32 or ord(ch) == 127 for ch in user):
        raise invalid("registry_auth", "registry_auth.username must be 1-255 printable characters without ':'")
    if not isinstance(password, str) or not 0 < len(password) <= 4096 or "\x00" in password:
        raise invalid("registry_auth", "registry_auth.password must be 1-4096 characters without NUL")
    _text(password, "registry_auth", 4096)
    return {"username": user, "password": password}


def validate_env(value):
    if not isinstance(value, dict) or len(value) > MAX_ENV:
        raise invalid("env", "env must be an object of at most %d names" % MAX_ENV)
    total = 0
    for name in sorted(value):
        if not ENV_NAME_RE.fullmatch(name):
            raise invalid("env", "env name %r must match [A-Z_][A-Z0-9_]{0,127}" % name[:140])
        if name.startswith(RESERVED_ENV_PREFIXES):
            raise invalid("env", "env name %s is reserved: names starting with %s steer the node's GPU container "
                          "runtime" % (name, " or ".join(RESERVED_ENV_PREFIXES)))
        text = _text(value[name], "env", MAX_ENV_VALUE)
        if "\n" in text or "\r" in text:
            raise invalid("env", "env.%s must be one line (no CR or LF)" % name)
        total += len(name) + 1 + len(text.encode("utf-8"))
    if total > MAX_ENV_BYTES:
        raise invalid("env", "env holds %d bytes; at most %d" % (total, MAX_ENV_BYTES))
    return {k: value[k] for k in sorted(value)}


def validate_ports(value):
    if not isinstance(value, list) or len(value) > MAX_PORTS:
        raise invalid("ports", "ports must be a list of at most %d port numbers" % MAX_PORTS)
    for port in value:
        if type(port) is not int or not 1 <= port <= 65535:
            raise invalid("ports", "each port must be an integer from 1 to 65535")
        if port == 22:
            raise invalid("ports", "port 22 is the instance's SSH port and is always mapped")
    if len(set(value)) != len(value):
        raise invalid("ports", "ports must be distinct")
    return sorted(value)


def normal_mount(mount):
    """The path a mount point names: '.', '..', '//' and a trailing '/' resolved (posixpath.normpath keeps a
    leading '//', which names / on Linux)."""
    return posixpath.normpath("/" + mount.lstrip("/"))


def system_folder(path):
    """(the system folder a normalised path is, is under or holds, whether it holds it), or None: /var holds
    /var/run and /var/empty, and a volume over it hides them as surely."""
    for top in FORBIDDEN_MOUNTS:
        if path == top or path.startswith(top + "/"):
            return top, False
        if top.startswith(path + "/"):
            return top, True
    return None


def validate_mount(mount):
    if not isinstance(mount, str) or not mount.startswith("/") or len(mount) > 255 or \
            any(ord(ch) < 32 or ord(ch) == 127 for ch in mount):
        raise ValueError("must be an absolute path of at most 255 printable characters")
    path = normal_mount(mount)  # compared as the path it names: /usr/../etc is /etc
    said = mount if path == mount else "%s (that is %s)" % (mount, path)
    if path == "/":
        raise ValueError("cannot be /")
    system = system_folder(path)
    if system is not None:
        top, holds = system
        raise ValueError("%s cannot be %s (a system folder the VM's SSH server needs)" % (
            said, ("%s: it holds %s" % (path, top)) if holds else ("%s or under it" % top)))
    if ".." in mount.split("/") or path != mount:
        raise ValueError("must be a normalised path (no '..', '.', '//' or trailing '/')")
    for top in RESERVED_MOUNTS:
        if mount == top or mount.startswith(top + "/"):
            raise ValueError("cannot be under %s" % top)
    return mount


def validate_volumes(value):
    if not isinstance(value, list) or len(value) > MAX_VOLUMES:
        raise invalid("volumes", "volumes must be a list of at most %d volumes" % MAX_VOLUMES)
    out = []
    for n, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"name", "mount"}:
            raise invalid("volumes", "volume %d must be an object with exactly 'name' and 'mount'" % n)
        if not isinstance(item["name"], str) or not VOLUME_NAME_RE.fullmatch(item["name"]):
            raise invalid("volumes", "volume %d name must match vol-[a-z0-9]{8,32}" % n)
        try:
            validate_mount(item["mount"])
        except ValueError as exc:
            raise invalid("volumes", "volume %d mount %s" % (n, exc)) from None
        out.append({"name": item["name"], "mount": item["mount"]})
    if len({v["name"] for v in out}) != len(out):
        raise invalid("volumes", "a volume can be mounted only once")
    mounts = sorted(v["mount"] for v in out)
    if len(set(mounts)) != len(mounts):
        raise invalid("volumes", "two volumes cannot share a mount point")
    return out


def validate_options(req):
    """(the options for the spec, registry_auth or None)."""
    options = {}
    if req.get("env"):
        options["env"] = validate_env(req["env"])
    elif "env" in req:
        validate_env(req["env"])
    if req.get("onstart"):
        options["onstart"] = _text(req["onstart"], "onstart", MAX_ONSTART)
    elif "onstart" in req and req["onstart"] != "":
        _text(req["onstart"], "onstart", MAX_ONSTART)
    if req.get("ports"):
        options["ports"] = validate_ports(req["ports"])
    elif "ports" in req:
        validate_ports(req["ports"])
    if req.get("volumes"):
        options["volumes"] = validate_volumes(req["volumes"])
    elif "volumes" in req:
        validate_volumes(req["volumes"])
    # The image's own command (ENTRYPOINT + CMD) gets the renter's env: true for a renter's own image (a vLLM, TGI
    # or Jupyter image reading MODEL_ID, HF_TOKEN, JUPYTER_TOKEN), false or absent for a catalogue image.
    image_env = req.get("image_env", False)
    if type(image_env) is not bool:
        raise invalid("image_env", "image_env must be true or false")
    if image_env:
        options["image_env"] = True
    return options, validate_registry_auth(req.get("registry_auth"))
