#!/usr/bin/env python3
"""gpumarket node agent: the one file the platform uploads to a GPU server over SFTP and runs over SSH.

    python3 gpumarket_agent.py <command> [<subcommand>]  < request.json

Commands: inventory, health, benchmark, vm create|start|stop|destroy|list|status. The request is one JSON
object on stdin (empty stdin = {}); the answer is exactly one JSON object on stdout:
    {"ok": true, "agent_version": "...", ...}
    {"ok": false, "agent_version": "...", "error": {"code": "...", "message": "...", "field": "..."}}
Exit status: 0 ok, 2 bad request (invalid_request), 1 any other error.

The node's configuration comes from its environment (sshd `SetEnv` on simulated nodes):
    GPUMARKET_RUNTIME      sim | docker | libvirt: the node's runtime; a request may not ask for another
    GPUMARKET_STATE_DIR    where VM records live (default ~/.gpumarket; in sim mode $GPUMARKET_SIM_ROOT)
    GPUMARKET_PUBLIC_HOST  address renters use to reach VMs (default: sim listen address, else null)
    GPUMARKET_PORT_RANGE   host ports for VM SSH with docker/libvirt (default 40000-40999)
    GPUMARKET_SIM_PROFILE, GPUMARKET_SIM_ROOT, GPUMARKET_SIM_LISTEN   sim: profile file, node folder, address
    GPUMARKET_LIBVIRT_URI, GPUMARKET_LIBVIRT_DIR, GPUMARKET_LIBVIRT_IMAGES   libvirt: connection and folders
Stdlib only, Python 3.8+. Nothing from a request ever reaches a shell: commands are argument lists.
"""
import base64
import contextlib
import csv
import fcntl
import json
import os
import platform
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

AGENT_VERSION = "1.0.0"
RUNTIMES = ("sim", "docker", "libvirt")
MAX_REQUEST_BYTES = 1 << 20


class AgentError(Exception):
    def __init__(self, code, message, field=None):
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


def invalid(field, message):
    return AgentError("invalid_request", message, field)


def run(argv, timeout=60, check=True, env=None):
    """Run an argument list (never a shell string); raise command_failed with stderr on failure."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, env=env)
    except FileNotFoundError:
        raise AgentError("command_not_found", "%s is not installed on this node" % argv[0]) from None
    except subprocess.TimeoutExpired:
        raise AgentError("command_timeout", "%s did not finish within %ss" % (" ".join(argv[:3]), timeout)) from None
    if check and proc.returncode != 0:
        raise AgentError("command_failed", "%s exited %d: %s" % (
            " ".join(argv[:3]), proc.returncode, (proc.stderr or proc.stdout).strip()[-800:]))
    return proc


def write_file(path, text, mode=0o600):
    # Write then rename, so a reader never sees half a file.
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def read_json(path):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------- config

class Config:
    def __init__(self, env):
        self.runtime = env.get("GPUMARKET_RUNTIME") or None
        self.sim_profile = env.get("GPUMARKET_SIM_PROFILE")
        self.sim_root = env.get("GPUMARKET_SIM_ROOT")
        self.sim_listen = env.get("GPUMARKET_SIM_LISTEN") or "127.0.0.1"
        default_state = self.sim_root if self.runtime == "sim" and self.sim_root else \
            os.path.join(os.path.expanduser("~"), ".gpumarket")
        self.state_dir = env.get("GPUMARKET_STATE_DIR") or default_state
        self.public_host = env.get("GPUMARKET_PUBLIC_HOST") or None
        low, _, high = (env.get("GPUMARKET_PORT_RANGE") or "40000-40999").partition("-")
        self.port_range = (int(low), int(high))
        self.libvirt_uri = env.get("GPUMARKET_LIBVIRT_URI") or "qemu:///system"
        self.libvirt_dir = env.get("GPUMARKET_LIBVIRT_DIR") or "/var/lib/libvirt/images/gpumarket"
        self.libvirt_images = env.get("GPUMARKET_LIBVIRT_IMAGES") or "/var/lib/libvirt/images"
        if self.runtime is not None and self.runtime not in RUNTIMES:
            raise AgentError("bad_node_config", "GPUMARKET_RUNTIME must be one of %s" % ", ".join(RUNTIMES))
        if self.runtime == "sim" and not (self.sim_profile and self.sim_root):
            raise AgentError("bad_node_config", "sim runtime needs GPUMARKET_SIM_PROFILE and GPUMARKET_SIM_ROOT")


# -------------------------------------------------------------------------------- nvidia-smi parsing

QUERY_FIELDS = (
    "index", "uuid", "name", "memory.total", "pci.bus_id", "pci.device_id", "pcie.link.gen.max",
    "pcie.link.gen.current", "pcie.link.width.max", "pcie.link.width.current", "power.limit",
    "power.default_limit", "mig.mode.current", "ecc.mode.current", "driver_version",
)
NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=" + ",".join(QUERY_FIELDS), "--format=csv,noheader,nounits"]
# nvidia-smi field -> key in our answer: dots become underscores, units are named, ".current" modes shortened.
_KEYS = dict({f: f.replace(".", "_") for f in QUERY_FIELDS}, **{
    "memory.total": "memory_total_mib", "power.limit": "power_limit_w",
    "power.default_limit": "power_default_limit_w", "mig.mode.current": "mig_mode", "ecc.mode.current": "ecc_mode"})
_INT_FIELDS = {"index", "memory.total", "pcie.link.gen.max", "pcie.link.gen.current",
               "pcie.link.width.max", "pcie.link.width.current"}
_FLOAT_FIELDS = {"power.limit", "power.default_limit"}
# nvidia-smi prints these instead of a value; "[N/A]" in csv mode, "N/A" in some drivers' outputs.
_MISSING = re.compile(r"^\[?(N/A|Not Supported|Unknown Error|Insufficient Permissions|"
                      r"GPU requires reset|Requested functionality has been deprecated)\]?$", re.I)


def smi_value(field, raw):
    raw = raw.strip()
    if not raw or _MISSING.match(raw):
        return None
    if field in _INT_FIELDS:
        return int(raw)
    if field in _FLOAT_FIELDS:
        return float(raw)
    if field in ("mig.mode.current", "ecc.mode.current"):
        return raw.capitalize()  # "Enabled" / "Disabled"
    return raw


def split_smi_line(line):
    # csv with skipinitialspace copes with the ", " separators; GPU names never contain commas.
    return [cell.strip() for cell in next(csv.reader([line], skipinitialspace=True))]


def parse_gpu_csv(text):
    """Parse `nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits` into dicts."""
    gpus = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cells = split_smi_line(line)
        if len(cells) != len(QUERY_FIELDS):
            raise AgentError("nvidia_smi_unparsable", "line %d has %d fields, expected %d: %r" % (
                lineno, len(cells), len(QUERY_FIELDS), line[:200]))
        try:
            gpu = {_KEYS[f]: smi_value(f, cells[n]) for n, f in enumerate(QUERY_FIELDS)}
        except ValueError as exc:
            raise AgentError("nvidia_smi_unparsable", "line %d: %s" % (lineno, exc)) from None
        if gpu["index"] is None:
            raise AgentError("nvidia_smi_unparsable", "line %d has no GPU index" % lineno)
        gpus.append(gpu)
    return gpus


def parse_cuda_version(header):
    """CUDA version from the banner of plain `nvidia-smi` ("... CUDA Version: 12.2 |")."""
    match = re.search(r"CUDA Version\s*:\s*([0-9]+\.[0-9]+)", header)
    return match.group(1) if match else None


def load_profile(path):
    """A sim profile and its GPUs, parsed by the same parser as real nvidia-smi output."""
    try:
        profile = read_json(path)
    except (OSError, ValueError) as exc:
        raise AgentError("bad_node_config", "cannot read sim profile %s: %s" % (path, exc)) from None
    return profile, parse_gpu_csv("\n".join(profile.get("nvidia_smi", [])))


# ---------------------------------------------------------------------------------------- inventory

def read_gpus(cfg):
    """(gpus, cuda_version): from the sim profile, or from the real nvidia-smi."""
    if cfg.runtime == "sim":
        profile, gpus = load_profile(cfg.sim_profile)
        return gpus, profile.get("cuda_version")
    gpus = parse_gpu_csv(run(NVIDIA_SMI_QUERY, timeout=30).stdout)
    return gpus, parse_cuda_version(run(["nvidia-smi"], timeout=30, check=False).stdout)


def host_facts(cfg):
    if cfg.runtime == "sim":
        host = load_profile(cfg.sim_profile)[0].get("host", {})
        return {"cpu": {"model": host.get("cpu_model"), "cores": host.get("cpu_cores")},
                "ram_mib": host.get("ram_mib"), "disk_free_gb": host.get("disk_free_gb"),
                "os": {"name": host.get("os"), "kernel": host.get("kernel"), "arch": host.get("arch", "x86_64")}}
    cpu_model = ram_mib = os_name = None
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu_model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            ram_mib = next((int(ln.split()[1]) // 1024 for ln in f if ln.startswith("MemTotal:")), None)
    with contextlib.suppress(OSError):
        with open("/etc/os-release") as f:
            os_name = next((ln.split("=", 1)[1].strip().strip('"') for ln in f
                            if ln.startswith("PRETTY_NAME=")), None)
    disk = shutil.disk_usage(os.environ.get("GPUMARKET_DISK_PATH") or "/")
    return {"cpu": {"model": cpu_model, "cores": os.cpu_count()}, "ram_mib": ram_mib,
            "disk_free_gb": disk.free // 10**9,
            "os": {"name": os_name, "kernel": platform.release(), "arch": platform.machine()}}


def cmd_inventory(cfg, req):
    reject_unknown(req, ())
    gpus, cuda = read_gpus(cfg)
    answer = {"runtime": cfg.runtime, "hostname": socket.gethostname(), "gpus": gpus, "gpu_count": len(gpus),
              "driver_version": gpus[0]["driver_version"] if gpus else None, "cuda_version": cuda}
    answer.update(host_facts(cfg))
    return answer


def cmd_health(cfg, req):
    reject_unknown(req, ())
    answer = {"runtime": cfg.runtime, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "load": list(os.getloadavg()), "uptime_s": None, "gpu_count": None, "gpu_error": None}
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/uptime") as f:
            answer["uptime_s"] = float(f.read().split()[0])
    try:
        answer["gpu_count"] = len(read_gpus(cfg)[0])
    except AgentError as exc:
        answer["gpu_error"] = exc.message
    try:
        ok, detail = RUNTIME_CLASSES[cfg.runtime](cfg).health() if cfg.runtime else (False, "GPUMARKET_RUNTIME unset")
    except AgentError as exc:
        ok, detail = False, exc.message
    answer["runtime_ok"], answer["runtime_detail"] = ok, detail
    return answer


def cmd_benchmark(cfg, req):
    raise AgentError("not_implemented", "benchmark is not implemented by agent %s" % AGENT_VERSION)


# --------------------------------------------------------------------------------------- validation

VM_ID_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa",
             "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com")
_B64_RE = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_COMMENT_RE = re.compile(r"[\x21-\x7e]+( [\x21-\x7e]+)*")  # printable ASCII words, single spaces
# Docker reference: optional registry[:port]/, lower-case path components, optional :tag and @sha256.
_DOCKER_IMAGE_RE = re.compile(
    r"(?:[a-z0-9]+(?:[.-][a-z0-9]+)*(?::[0-9]{1,5})?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?")
_LIBVIRT_IMAGE_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")


def reject_unknown(req, allowed):
    extra = sorted(set(req) - set(allowed) - {"runtime"})
    if extra:
        raise invalid(extra[0], "unknown field %r" % extra[0])


def validate_vm_id(value):
    if not isinstance(value, str) or not VM_ID_RE.fullmatch(value):
        raise invalid("vm_id", "vm_id must be 1-63 characters of a-z, 0-9 and '-', not starting with '-'")
    return value


def validate_public_key(value):
    """One OpenSSH public key line: '<type> <base64 body> [comment]', no options, no second key."""
    if not isinstance(value, str) or not 0 < len(value) <= 16384:
        raise ValueError("must be a non-empty string of at most 16384 characters")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError("must be one line without control characters")
    parts = value.split(" ", 2)
    if parts[0] not in KEY_TYPES:
        raise ValueError("must start with a key type (%s); options are not allowed" % ", ".join(KEY_TYPES))
    if len(parts) < 2 or not _B64_RE.fullmatch(parts[1]):
        raise ValueError("key body must be base64")
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except ValueError:
        raise ValueError("key body is not valid base64") from None
    # The blob starts with its own length-prefixed type name; a mismatch means a corrupt or forged key.
    n = int.from_bytes(blob[:4], "big")
    if len(blob) < 4 + n + 16 or blob[4:4 + n].decode("ascii", "replace") != parts[0]:
        raise ValueError("key body does not hold a %s key" % parts[0])
    if len(parts) == 3:
        if not _COMMENT_RE.fullmatch(parts[2]) or len(parts[2]) > 256:
            raise ValueError("comment must be printable words separated by single spaces")
        if any(word in KEY_TYPES or (word.startswith("AAAA") and len(word) > 40) for word in parts[2].split(" ")):
            raise ValueError("holds more than one key; send one key per list item")
    return value


def validate_create(req, runtime, gpu_indices_present):
    reject_unknown(req, ("vm_id", "gpu_indices", "ssh_public_keys", "image", "disk_gb"))
    vm_id = validate_vm_id(req.get("vm_id"))
    indices = validate_gpu_indices(req.get("gpu_indices"), gpu_indices_present)
    keys = req.get("ssh_public_keys")
    if not isinstance(keys, list) or not 0 < len(keys) <= 32:
        raise invalid("ssh_public_keys", "ssh_public_keys must be a list of 1 to 32 keys")
    for n, key in enumerate(keys):
        try:
            validate_public_key(key)
        except ValueError as exc:
            raise invalid("ssh_public_keys", "key %d %s" % (n, exc)) from None
    image = req.get("image", {})
    if not isinstance(image, dict) or set(image) - {"docker", "libvirt"}:
        raise invalid("image", "image must be an object with 'docker' and/or 'libvirt' names")
    patterns = {"docker": _DOCKER_IMAGE_RE, "libvirt": _LIBVIRT_IMAGE_RE}
    for kind, name in image.items():
        if not isinstance(name, str) or len(name) > 255 or not patterns[kind].fullmatch(name) or ".." in name:
            raise invalid("image", "image.%s is not an allowed image name" % kind)
    if runtime in ("docker", "libvirt") and runtime not in image:
        raise invalid("image", "image.%s is required for the %s runtime" % (runtime, runtime))
    disk_gb = req.get("disk_gb", 50)
    if type(disk_gb) is not int or not 1 <= disk_gb <= 65536:
        raise invalid("disk_gb", "disk_gb must be an integer from 1 to 65536")
    return vm_id, {"gpu_indices": sorted(indices), "ssh_public_keys": list(keys),
                   "image": {k: image[k] for k in sorted(image)}, "disk_gb": disk_gb}


# ------------------------------------------------------------------------------- processes and ports

def proc_table():
    """{pid: (ppid, cmdline)} of live (non-zombie) processes."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
            with open("/proc/%s/cmdline" % name, "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            table[int(name)] = (int(fields[1]), cmdline)
    return table


def pids_matching(needle, table=None):
    # sshd rewrites its title but keeps "-f <config>" in the listener's, so the config path finds it.
    table = proc_table() if table is None else table
    return [pid for pid, (_, cmd) in table.items() if needle in cmd]


def kill_trees(roots, timeout=3.0):
    """SIGTERM the roots and all their descendants, SIGKILL what is left after `timeout`."""
    table = proc_table()
    spared, pid = set(), os.getpid()
    while pid > 1 and pid in table:  # never ourselves or our ancestors
        spared.add(pid)
        pid = table[pid][0]
    victims, stack = set(), [p for p in roots if p in table]
    while stack:
        pid = stack.pop()
        if pid not in victims and pid not in spared:
            victims.add(pid)
            stack.extend(child for child, (ppid, _) in table.items() if ppid == pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            victims &= set(proc_table())
            if not victims:
                return
            time.sleep(0.02)


def port_free(port, host="0.0.0.0"):  # noqa: S104 - docker publishes VM ports on all interfaces
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as sshd and dockerd bind
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def wait_port(host, port, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return True
        time.sleep(0.02)
    return False


# -------------------------------------------------------------------------------------- VM records

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


# ------------------------------------------------------------------------------------------ runtimes

class Runtime:
    """One runtime's operations on a VM record. Every operation is idempotent; state is running|stopped|missing."""
    ssh_user = "root"

    def __init__(self, cfg):
        self.cfg = cfg

    def host(self):
        return self.cfg.public_host  # None: renters use the node's own address

    def allocate(self, rec, records):
        rec["ssh_port"] = pick_host_port(self.cfg, records)

    def unrecorded(self, known):
        """VMs of ours that have no record (a crash between creating one and recording it)."""
        return []

    def rebind(self, rec):
        """Give a stopped VM the GPUs now in rec's spec (the platform may hand back other ones)."""
        raise AgentError("rebind_unsupported", "a %s VM keeps the GPUs it was created with" % rec["runtime"])


# ------------------------------------------------------------------------------------ docker runtime

def vm_name(vm_id):
    return "gpumarket-" + vm_id  # container and libvirt domain name


def docker_run_argv(vm_id, gpu_indices, image, host_port, keys_path):
    # --gpus parses its value as CSV, so "device=0,1" needs literal double quotes to stay one item.
    return ["docker", "run", "-d", "--name", vm_name(vm_id), "--hostname", vm_id,
            "--label", "gpumarket.vm_id=" + vm_id,
            "--gpus", '"device=%s"' % ",".join(str(i) for i in gpu_indices),
            "-p", "%d:22" % host_port, "-v", keys_path + ":/root/.ssh/authorized_keys:ro",
            "--restart", "unless-stopped", image]


def docker_verb_argv(verb, vm_id):
    return {"start": ["docker", "start", vm_name(vm_id)],
            "stop": ["docker", "stop", "--time", "20", vm_name(vm_id)],
            "rm": ["docker", "rm", "-f", vm_name(vm_id)],
            "inspect": ["docker", "inspect", "--format", "{{.State.Status}}", vm_name(vm_id)]}[verb]


DOCKER_LIST_ARGV = ["docker", "ps", "-a", "--filter", "label=gpumarket.vm_id",
                    "--format", '{{.Label "gpumarket.vm_id"}}\t{{.State}}']


def docker_state(status):
    return "running" if status in ("running", "restarting") else "stopped"


class DockerRuntime(Runtime):
    def provision(self, rec):
        keys_path = os.path.join(vm_dir(self.cfg, rec["vm_id"]), "authorized_keys")
        write_file(keys_path, "\n".join(rec["spec"]["ssh_public_keys"]) + "\n", 0o600)
        if self.state(rec) == "missing":
            spec = rec["spec"]
            run(docker_run_argv(rec["vm_id"], spec["gpu_indices"], spec["image"]["docker"], rec["ssh_port"],
                                keys_path), timeout=900)  # may pull the image
        self.start(rec)

    def start(self, rec):
        run(docker_verb_argv("start", rec["vm_id"]))

    def stop(self, rec):
        if self.state(rec) == "running":
            run(docker_verb_argv("stop", rec["vm_id"]), timeout=60)

    def destroy(self, rec):
        proc = run(docker_verb_argv("rm", rec["vm_id"]), check=False)
        if proc.returncode != 0 and "No such container" not in proc.stderr:
            raise AgentError("command_failed", "docker rm: " + proc.stderr.strip()[-800:])

    def state(self, rec):
        proc = run(docker_verb_argv("inspect", rec["vm_id"]), check=False)
        if proc.returncode != 0:
            if "No such" in proc.stderr:
                return "missing"
            raise AgentError("command_failed", "docker inspect: " + proc.stderr.strip()[-800:])
        return docker_state(proc.stdout.strip())

    def unrecorded(self, known):
        found = []
        for line in run(DOCKER_LIST_ARGV).stdout.splitlines():
            vm_id, _, status = line.partition("\t")
            if VM_ID_RE.fullmatch(vm_id) and vm_id not in known:
                found.append({"vm_id": vm_id, "state": docker_state(status)})
        return found

    def health(self):
        proc = run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=15, check=False)
        return proc.returncode == 0, (proc.stdout.strip() or proc.stderr.strip())[-300:]


# ----------------------------------------------------------------------------------- libvirt runtime

LIBVIRT_SSH_USER = "user"


def pci_address(bus_id):
    """nvidia-smi's '00000000:07:00.0' -> libvirt's address attributes."""
    match = re.fullmatch(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])", bus_id or "")
    if not match:
        raise AgentError("bad_inventory", "unusable PCI bus id %r" % bus_id)
    domain, bus, slot, function = match.groups()
    return {"domain": "0x%04x" % int(domain, 16), "bus": "0x" + bus.lower(), "slot": "0x" + slot.lower(),
            "function": "0x" + function}


def libvirt_share(host_cores, host_ram_mib, n_gpus, total_gpus):
    """vCPUs and memory in proportion to the GPUs rented; 10 % of RAM stays with the host."""
    vcpus = max(1, host_cores * n_gpus // total_gpus)
    return vcpus, max(2048, int(host_ram_mib * 0.9) * n_gpus // total_gpus)


def libvirt_domain_xml(vm_id, vcpus, memory_mib, disk_path, seed_path, ssh_port, pci_bus_ids):
    dom = ET.Element("domain", type="kvm")
    ET.SubElement(dom, "name").text = vm_name(vm_id)
    ET.SubElement(dom, "memory", unit="MiB").text = str(memory_mib)
    ET.SubElement(dom, "vcpu").text = str(vcpus)
    os_el = ET.SubElement(dom, "os")
    ET.SubElement(os_el, "type", arch="x86_64", machine="q35").text = "hvm"
    ET.SubElement(os_el, "boot", dev="hd")
    features = ET.SubElement(dom, "features")
    ET.SubElement(features, "acpi")
    ET.SubElement(features, "apic")
    ET.SubElement(dom, "cpu", mode="host-passthrough")
    devices = ET.SubElement(dom, "devices")
    disk = ET.SubElement(devices, "disk", type="file", device="disk")
    ET.SubElement(disk, "driver", name="qemu", type="qcow2")
    ET.SubElement(disk, "source", file=disk_path)
    ET.SubElement(disk, "target", dev="vda", bus="virtio")
    seed = ET.SubElement(devices, "disk", type="file", device="cdrom")
    ET.SubElement(seed, "driver", name="qemu", type="raw")
    ET.SubElement(seed, "source", file=seed_path)
    ET.SubElement(seed, "target", dev="sda", bus="sata")
    ET.SubElement(seed, "readonly")
    # User-mode NAT through passt (libvirt >= 9.0): host port -> guest 22, no bridge or iptables needed.
    nic = ET.SubElement(devices, "interface", type="user")
    ET.SubElement(nic, "backend", type="passt")
    ET.SubElement(nic, "model", type="virtio")
    forward = ET.SubElement(nic, "portForward", proto="tcp")
    ET.SubElement(forward, "range", start=str(ssh_port), to="22")
    for bus_id in pci_bus_ids:  # managed="yes": libvirt binds the card to vfio-pci and back
        hostdev = ET.SubElement(devices, "hostdev", mode="subsystem", type="pci", managed="yes")
        ET.SubElement(ET.SubElement(hostdev, "source"), "address", **pci_address(bus_id))
    ET.SubElement(devices, "console", type="pty")
    return ET.tostring(dom, encoding="unicode")


def cloud_init_user_data(keys, user=LIBVIRT_SSH_USER):
    # JSON is valid YAML, so key comments can never inject YAML structure.
    config = {"users": [{"name": user, "shell": "/bin/bash", "sudo": "ALL=(ALL) NOPASSWD:ALL",
                         "ssh_authorized_keys": list(keys)}],
              "ssh_pwauth": False, "disable_root": True}
    return "#cloud-config\n" + json.dumps(config, indent=1, sort_keys=True) + "\n"


def cloud_init_meta_data(vm_id):
    return "instance-id: %s\nlocal-hostname: %s\n" % (vm_id, vm_id)


def qemu_img_overlay_argv(base_path, overlay_path, disk_gb):
    return ["qemu-img", "create", "-f", "qcow2", "-F", "qcow2", "-b", base_path, overlay_path, "%dG" % disk_gb]


def seed_iso_argv(iso_path, user_data_path, meta_data_path):
    # NoCloud looks for a volume labelled "cidata" holding files named user-data and meta-data.
    return ["genisoimage", "-output", iso_path, "-volid", "cidata", "-joliet", "-rock",
            user_data_path, meta_data_path]


def virsh_argv(uri, verb, *args):
    return ["virsh", "-c", uri, verb] + list(args)


class LibvirtRuntime(Runtime):
    ssh_user = LIBVIRT_SSH_USER

    def provision(self, rec):
        vm_id, spec = rec["vm_id"], rec["spec"]
        base = os.path.join(self.cfg.libvirt_images, spec["image"]["libvirt"] + ".qcow2")
        if not os.path.isfile(base):
            raise AgentError("image_not_found", "no cloud image %s on this node" % base)
        work = os.path.join(self.cfg.libvirt_dir, vm_id)
        os.makedirs(work, exist_ok=True)
        paths = {n: os.path.join(work, n) for n in ("disk.qcow2", "seed.iso", "user-data", "meta-data",
                                                      "domain.xml")}
        if not os.path.exists(paths["disk.qcow2"]):
            run(qemu_img_overlay_argv(base, paths["disk.qcow2"], spec["disk_gb"]))
        write_file(paths["user-data"], cloud_init_user_data(spec["ssh_public_keys"]), 0o644)
        write_file(paths["meta-data"], cloud_init_meta_data(vm_id), 0o644)
        run(seed_iso_argv(paths["seed.iso"], paths["user-data"], paths["meta-data"]))
        self.rebind(rec)
        self.start(rec)

    def rebind(self, rec):
        # (Re)define the domain with the spec's GPUs as hostdevs; the disk overlay is kept.
        vm_id, spec = rec["vm_id"], rec["spec"]
        work = os.path.join(self.cfg.libvirt_dir, vm_id)
        gpus = {g["index"]: g for g in read_gpus(self.cfg)[0]}
        facts = host_facts(self.cfg)
        vcpus, mem = libvirt_share(facts["cpu"]["cores"] or 1, facts["ram_mib"] or 4096,
                                   len(spec["gpu_indices"]), len(gpus))
        domain = os.path.join(work, "domain.xml")
        write_file(domain, libvirt_domain_xml(
            vm_id, vcpus, mem, os.path.join(work, "disk.qcow2"), os.path.join(work, "seed.iso"), rec["ssh_port"],
            [gpus[i]["pci_bus_id"] for i in spec["gpu_indices"]]), 0o644)
        run(virsh_argv(self.cfg.libvirt_uri, "define", domain))

    def start(self, rec):
        if self.state(rec) != "running":
            run(virsh_argv(self.cfg.libvirt_uri, "start", vm_name(rec["vm_id"])), timeout=120)

    def stop(self, rec):
        name = vm_name(rec["vm_id"])
        if self.state(rec) != "running":
            return
        run(virsh_argv(self.cfg.libvirt_uri, "shutdown", name), check=False)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and self.state(rec) == "running":
            time.sleep(1)
        if self.state(rec) == "running":  # the guest ignored ACPI: pull the plug
            run(virsh_argv(self.cfg.libvirt_uri, "destroy", name), check=False)

    def destroy(self, rec):
        name = vm_name(rec["vm_id"])
        if self.state(rec) != "missing":
            run(virsh_argv(self.cfg.libvirt_uri, "destroy", name), check=False)
            run(virsh_argv(self.cfg.libvirt_uri, "undefine", name))
        shutil.rmtree(os.path.join(self.cfg.libvirt_dir, rec["vm_id"]), ignore_errors=True)

    def state(self, rec):
        proc = run(virsh_argv(self.cfg.libvirt_uri, "domstate", vm_name(rec["vm_id"])), check=False)
        if proc.returncode != 0:
            # Only a domain libvirt does not know is missing; libvirtd being down must not look like it.
            if "failed to get domain" in proc.stderr or "Domain not found" in proc.stderr:
                return "missing"
            raise AgentError("command_failed", "virsh domstate: " + proc.stderr.strip()[-800:])
        return "running" if proc.stdout.strip() in ("running", "paused", "in shutdown") else "stopped"

    def unrecorded(self, known):
        names = run(virsh_argv(self.cfg.libvirt_uri, "list", "--all", "--name")).stdout.split()
        found = []
        for name in names:
            vm_id = name[len("gpumarket-"):] if name.startswith("gpumarket-") else ""
            if VM_ID_RE.fullmatch(vm_id) and vm_id not in known:
                found.append({"vm_id": vm_id, "state": self.state({"vm_id": vm_id})})
        return found

    def health(self):
        proc = run(virsh_argv(self.cfg.libvirt_uri, "version", "--daemon"), timeout=15, check=False)
        return proc.returncode == 0, (proc.stdout.strip() or proc.stderr.strip())[-300:]


# --------------------------------------------------------------------------------------- sim runtime

def find_sshd():
    for path in ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd"):
        if os.access(path, os.X_OK):
            return path  # sshd refuses to start from a relative path (it re-executes itself)
    raise AgentError("command_not_found", "sshd is not installed on this node")


def sim_sshd_config(vmdir, port, listen, visible_indices, visible_uuids):
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in visible_indices),
           "GPUMARKET_SIM_VISIBLE": ",".join(visible_uuids),
           "HOME": os.path.join(vmdir, "home"),
           "PATH": os.path.join(vmdir, "bin") + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    return "\n".join([
        "Port %d" % port, "ListenAddress " + listen,
        "HostKey " + os.path.join(vmdir, "ssh_host_ed25519_key"),
        "PidFile " + os.path.join(vmdir, "sshd.pid"),
        "AuthorizedKeysFile " + os.path.join(vmdir, "authorized_keys"),
        "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "StrictModes no", "PermitRootLogin prohibit-password", "PermitUserEnvironment no",
        "X11Forwarding no", "Subsystem sftp internal-sftp -d " + env["HOME"],
        # SetEnv is applied after sshd's default PATH, so the fake nvidia-smi in bin/ comes first.
        "SetEnv " + " ".join("%s=%s" % kv for kv in sorted(env.items())), "",
    ])


def fake_nvidia_smi_script(python, agent_copy, gpus_file):
    return "#!/bin/sh\nexec %s %s _sim-nvidia-smi %s \"$@\"\n" % (
        shlex.quote(python), shlex.quote(agent_copy), shlex.quote(gpus_file))


class SimRuntime(Runtime):
    @property
    def ssh_user(self):
        return pwd.getpwuid(os.getuid()).pw_name  # VM sshds run as the node's own login

    def host(self):
        return self.cfg.public_host or self.cfg.sim_listen

    def allocate(self, rec, records):
        rec["ssh_port"] = None  # picked at start: any free port

    def provision(self, rec):
        vmdir = vm_dir(self.cfg, rec["vm_id"])
        for sub in ("bin", "home"):
            os.makedirs(os.path.join(vmdir, sub), exist_ok=True)
        key = os.path.join(vmdir, "ssh_host_ed25519_key")
        if not os.path.exists(key + ".pub"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(key)
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpumarket-vm-" + rec["vm_id"], "-f", key])
        with open(key + ".pub") as f:
            rec["ssh_host_key"] = " ".join(f.read().split()[:2])
        write_file(os.path.join(vmdir, "authorized_keys"), "\n".join(rec["spec"]["ssh_public_keys"]) + "\n")
        self.rebind(rec)
        # A private copy of this file, so re-uploading or moving the agent never breaks a running VM.
        agent_copy = os.path.join(vmdir, "bin", "gpumarket_agent.py")
        shutil.copyfile(os.path.abspath(__file__), agent_copy)
        write_file(os.path.join(vmdir, "bin", "nvidia-smi"), fake_nvidia_smi_script(
            sys.executable, agent_copy, os.path.join(vmdir, "gpus.json")), 0o755)
        self.start(rec)

    def rebind(self, rec):
        # The VM's own nvidia-smi and CUDA_VISIBLE_DEVICES show only its GPUs (sshd_config is written at start).
        profile, gpus = load_profile(self.cfg.sim_profile)
        rows = [ln for ln in profile["nvidia_smi"] if ln.strip()]  # in parse_gpu_csv's order
        mine = [n for n, g in enumerate(gpus) if g["index"] in rec["spec"]["gpu_indices"]]
        write_file(os.path.join(vm_dir(self.cfg, rec["vm_id"]), "gpus.json"), json.dumps({
            "cuda_version": profile.get("cuda_version"), "nvidia_smi": [rows[n] for n in mine]}), 0o644)
        rec["visible_uuids"] = [gpus[n]["uuid"] for n in mine]

    def start(self, rec):
        if self.state(rec) == "running":
            return
        vmdir = vm_dir(self.cfg, rec["vm_id"])
        config, log = os.path.join(vmdir, "sshd_config"), os.path.join(vmdir, "sshd.log")
        port = rec.get("ssh_port")
        for _ in range(3):  # a port picked free can be taken before sshd binds it: retry on another
            if not port or not port_free(port, self.cfg.sim_listen):
                with socket.socket() as sock:
                    sock.bind((self.cfg.sim_listen, 0))
                    port = sock.getsockname()[1]
            write_file(config, sim_sshd_config(vmdir, port, self.cfg.sim_listen, rec["spec"]["gpu_indices"],
                                               rec.get("visible_uuids", [])))
            write_file(log, "")
            # Without -D sshd daemonises (setsid, stdio to /dev/null), so it outlives this SSH session.
            run([find_sshd(), "-f", config, "-E", log],
                env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
            if wait_port(self.cfg.sim_listen, port):
                rec["ssh_port"] = port
                return
            kill_trees(pids_matching(config))
            port = None
        with open(log) as f:
            raise AgentError("vm_start_failed", "sshd did not come up: " + f.read()[-800:])

    def stop(self, rec):
        # The listener and every live session under it: a stopped VM keeps no shell running.
        kill_trees(pids_matching(os.path.join(vm_dir(self.cfg, rec["vm_id"]), "sshd_config")))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(vm_dir(self.cfg, rec["vm_id"]), "sshd.pid"))

    def destroy(self, rec):
        self.stop(rec)

    def state(self, rec):
        config = os.path.join(vm_dir(self.cfg, rec["vm_id"]), "sshd_config")
        return "running" if pids_matching(config) else "stopped"

    def health(self):
        load_profile(self.cfg.sim_profile)
        find_sshd()
        return True, "sim: ok"


def sim_nvidia_smi(args, gpus_file, out=sys.stdout):
    """The fake nvidia-smi inside a sim VM: only the VM's GPUs, in the table or --query-gpu csv form."""
    data = read_json(gpus_file)
    rows = [split_smi_line(line) for line in data["nvidia_smi"]]
    gpus = parse_gpu_csv("\n".join(data["nvidia_smi"]))
    query = next((a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")), None)
    if query is not None:
        fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "csv").split(",")
        fields = [f.strip() for f in query.split(",") if f.strip()]
        units = {"memory.total": "MiB", "power.limit": "W", "power.default_limit": "W"}
        if "noheader" not in fmt:
            out.write(", ".join(f + (" [%s]" % units[f] if f in units and "nounits" not in fmt else "")
                                for f in fields) + "\n")
        for raw in rows:
            cells = []
            for field in fields:
                value = raw[QUERY_FIELDS.index(field)] if field in QUERY_FIELDS else "[N/A]"
                if field in units and "nounits" not in fmt and not value.startswith("["):
                    value += " " + units[field]
                cells.append(value)
            out.write(", ".join(cells) + "\n")
        return 0
    if args in (["-L"], ["--list-gpus"]):
        for g in gpus:
            out.write("GPU %d: %s (UUID: %s)\n" % (g["index"], g["name"], g["uuid"]))
        return 0
    if args:
        out.write("nvidia-smi (gpumarket sim) supports no options but --query-gpu=... --format=csv and -L\n")
        return 2
    bar = "+" + "-" * 41 + "+" + "-" * 22 + "+" + "-" * 22 + "+"

    def row(a, b, c):
        out.write("| %-39s | %-20s | %20s |\n" % (a, b, c))
    driver = gpus[0]["driver_version"] if gpus else "N/A"
    out.write(time.strftime("%a %b %d %H:%M:%S %Y") + "\n" + bar + "\n")
    out.write("| %-85s |\n" % ("NVIDIA-SMI %-20s Driver Version: %-12s CUDA Version: %s" % (
        driver, driver, data.get("cuda_version") or "N/A")))
    out.write(bar.replace("-", "=") + "\n")
    for g in gpus:
        power = "60W / %dW" % g["power_limit_w"] if g["power_limit_w"] else "N/A"
        row("%3d  %-28s  On" % (g["index"], g["name"][:28]), "%s Off" % g["pci_bus_id"],
            "0" if g["ecc_mode"] == "Enabled" else "N/A")
        row("N/A   30C    P0  %21s" % power, "%20s" % ("0MiB / %dMiB" % (g["memory_total_mib"] or 0)),
            "0%      Default")
        row("", "", g["mig_mode"] or "N/A")
        out.write(bar + "\n")
    return 0


RUNTIME_CLASSES = {"sim": SimRuntime, "docker": DockerRuntime, "libvirt": LibvirtRuntime}


# ---------------------------------------------------------------------------------------- VM commands

def pick_runtime(cfg, req):
    runtime = req.get("runtime", cfg.runtime)
    if runtime not in RUNTIMES:
        raise invalid("runtime", "runtime must be one of %s" % ", ".join(RUNTIMES))
    if cfg.runtime and runtime != cfg.runtime:
        raise invalid("runtime", "this node runs %s VMs, not %s" % (cfg.runtime, runtime))
    return runtime, RUNTIME_CLASSES[runtime](cfg)


def describe(cfg, rt, rec, state):
    return {"vm_id": rec["vm_id"], "runtime": rec["runtime"], "state": state, "ssh_host": rt.host(),
            "ssh_port": rec.get("ssh_port"), "ssh_user": rt.ssh_user,
            "ssh_host_key": rec.get("ssh_host_key"), "gpu_indices": rec["spec"]["gpu_indices"],
            "created_at": rec.get("created_at")}


def vm_create(cfg, req):
    runtime, rt = pick_runtime(cfg, req)
    gpus = read_gpus(cfg)[0]
    vm_id, spec = validate_create(req, runtime, [g["index"] for g in gpus])
    with file_lock(cfg, vm_id, timeout=300):
        with file_lock(cfg, "allocate", timeout=60):  # GPUs and ports are node-wide
            rec = load_record(cfg, vm_id)
            created = rec is None
            if rec is not None and (rec["spec"] != spec or rec["runtime"] != runtime):
                raise AgentError("conflict", "VM %s exists with a different spec" % vm_id)
            if created:
                others = all_records(cfg)
                check_gpus_free(rt, others, spec["gpu_indices"])
                rec = {"vm_id": vm_id, "runtime": runtime, "spec": spec,
                       "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                rt.allocate(rec, others)
                save_record(cfg, rec)  # first, so a crash below leaves a record that a retry completes
        try:
            rt.provision(rec)  # idempotent: finishes what an earlier, interrupted create began
        except Exception:
            if created:
                with contextlib.suppress(Exception):
                    rt.destroy(rec)
                shutil.rmtree(vm_dir(cfg, vm_id), ignore_errors=True)
            raise
        save_record(cfg, rec)
        answer = describe(cfg, rt, rec, rt.state(rec))
        answer["created"] = created
        return answer


def check_gpus_free(rt, others, indices):
    """Only running VMs hold GPUs: the platform releases a stopped VM's GPUs to other renters."""
    held = {i for r in others if rt.state(r) == "running" for i in r["spec"]["gpu_indices"]}
    busy = sorted(held & set(indices))
    if busy:
        raise AgentError("gpu_busy", "GPU %d is in use by another running VM" % busy[0])


def validate_gpu_indices(value, present):
    if not isinstance(value, list) or not 0 < len(value) <= 64 or \
            not all(type(i) is int for i in value) or len(set(value)) != len(value):
        raise invalid("gpu_indices", "gpu_indices must be a non-empty list of distinct integers")
    missing = sorted(set(value) - set(present))
    if missing:
        raise invalid("gpu_indices", "no GPU with index %s on this node" % missing[0])
    return sorted(value)


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
        others = [r for r in all_records(cfg) if r["vm_id"] != rec["vm_id"]]
        check_gpus_free(rt, others, rec["spec"]["gpu_indices"])
        rt.start(rec)
    save_record(cfg, rec)  # the port or the GPUs may have changed


def vm_simple(cfg, req, action):
    _, rt = pick_runtime(cfg, req)
    reject_unknown(req, ("vm_id", "gpu_indices") if action == "start" else ("vm_id",))
    vm_id = validate_vm_id(req.get("vm_id"))
    with file_lock(cfg, vm_id, timeout=300):
        rec = load_record(cfg, vm_id)
        if rec is None:
            if action == "destroy":
                return {"vm_id": vm_id, "state": "destroyed", "existed": False}
            raise AgentError("not_found", "no VM %s on this node" % vm_id)
        if action == "start":
            vm_start(cfg, rt, rec, req)
        elif action == "destroy":
            rt.destroy(rec)
            shutil.rmtree(vm_dir(cfg, vm_id), ignore_errors=True)
            return {"vm_id": vm_id, "state": "destroyed", "existed": True}
        elif action == "stop":
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
    if sub in ("start", "stop", "destroy", "status"):
        return vm_simple(cfg, req, sub)
    raise invalid("command", "vm needs one of: create, start, stop, destroy, list, status")


# ---------------------------------------------------------------------------------------------- main

COMMANDS = {"inventory": cmd_inventory, "health": cmd_health, "benchmark": cmd_benchmark}


def handle(argv, stdin_text, env):
    """Run one command; return (answer dict, exit status). Never raises."""
    try:
        cfg = Config(env)
        try:
            req = json.loads(stdin_text) if stdin_text.strip() else {}
        except ValueError as exc:
            raise invalid("request", "stdin is not JSON: %s" % exc) from None
        if not isinstance(req, dict):
            raise invalid("request", "the request must be a JSON object")
        if argv[:1] == ["vm"] and len(argv) == 2:
            answer = cmd_vm(cfg, req, argv[1])
        elif len(argv) == 1 and argv[0] in COMMANDS:
            answer = COMMANDS[argv[0]](cfg, req)
        else:
            raise invalid("command", "usage: gpumarket_agent.py inventory|health|benchmark|vm <subcommand>")
        answer.update(ok=True, agent_version=AGENT_VERSION)
        return answer, 0
    except AgentError as exc:
        error = {"code": exc.code, "message": exc.message}
        if exc.field:
            error["field"] = exc.field
        return {"ok": False, "agent_version": AGENT_VERSION, "error": error}, 2 if exc.code == "invalid_request" else 1
    except Exception as exc:  # the caller must always get one JSON object, even for our own bugs
        return {"ok": False, "agent_version": AGENT_VERSION,
                "error": {"code": "internal_error", "message": "%s: %s" % (type(exc).__name__, exc)}}, 1


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["_sim-nvidia-smi"] and len(argv) >= 2:  # the fake nvidia-smi of a sim VM
        return sim_nvidia_smi(argv[2:], argv[1])
    stdin_text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read(MAX_REQUEST_BYTES + 1)
    if len(stdin_text) > MAX_REQUEST_BYTES:
        answer, status = {"ok": False, "agent_version": AGENT_VERSION, "error": {
            "code": "invalid_request", "message": "request larger than 1 MiB"}}, 2
    else:
        answer, status = handle(argv, stdin_text, os.environ)
    sys.stdout.write(json.dumps(answer, sort_keys=True) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
