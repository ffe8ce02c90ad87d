"""Errors, running commands, files and the node's configuration."""
import json
import os
import re
import subprocess
import sys
import threading

AGENT_VERSION = "1.2.0"
RUNTIMES = ("sim", "docker", "libvirt")
MAX_REQUEST_BYTES = 1 << 20
_WATCHDOG = []  # set by main(): a hard stop for a benchmark stuck where Python cannot interrupt it
_EMIT_LOCK = threading.Lock()
_EMITTED = []
# What the platform's reader of an answer refuses in any string (core/untrusted_json.py there): a NUL, which no
# PostgreSQL text column takes, and an unpaired UTF-16 surrogate (not Unicode; Python's surrogateescape makes one
# of each undecodable byte).
_REFUSED_CHARS = re.compile("[\x00\ud800-\udfff]")


def safe_text(text):
    """Text the agent read from something a renter controls (an image's files, a container's output, a registry's
    words as docker prints them), fit for an answer: each character the platform refuses becomes U+FFFD. One NUL in
    a renter's /etc/os-release, log line or registry error made the whole answer refused, and the node was blamed
    for it (found by review)."""
    return _REFUSED_CHARS.sub("\ufffd", text) if isinstance(text, str) else text


class AgentError(Exception):
    def __init__(self, code, message, field=None):
        message = safe_text(message)  # often a command's stderr: a renter's registry or image may have written it
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


class StateUnknown(AgentError):
    """A VM the engine has (libvirt: a defined domain) whose state it cannot give now (command_failed). `vm list`
    and the health answer report that VM alone with state "unknown" (and this error): one such domain made both
    fail as a whole, every VM of the node unjudged, its renters interrupted and the node offline (found by
    review). Start, stop and status of it still answer command_failed."""

    def __init__(self, message):
        super().__init__("command_failed", message)


def state_or_unknown(rt, rec):
    """rt.state(rec), and the error text: "unknown" and the engine's words when it cannot give it (StateUnknown)."""
    try:
        return rt.state(rec), None
    except StateUnknown as exc:
        return "unknown", exc.message[:800]


def invalid(field, message):
    return AgentError("invalid_request", message, field)


def at_once(items, fn, code, what="GPU"):
    """fn(i, x) for every (i, x) of `items` at once, a thread each (PyTorch's device work runs outside the GIL);
    {i: result}. The first failure is raised as AgentError(code), naming its `what` and index."""
    results, errors = {}, []

    def one(i, x):
        try:
            results[i] = fn(i, x)
        except Exception as exc:  # noqa: BLE001 - raised below, as the command's error
            errors.append((i, exc))
    threads = [threading.Thread(target=one, args=item, daemon=True) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        i, exc = errors[0]
        raise AgentError(code, "%s %d: %s: %s" % (what, i, type(exc).__name__, str(exc)[:500]))
    return results


def run(argv, timeout=60, check=True, env=None):
    """Run an argument list (never a shell string); raise command_failed with stderr on failure. Output that is not
    UTF-8 (a registry's error as docker pull prints it) is decoded with U+FFFD, never a crash of the agent."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, encoding="utf-8",
                              errors="replace", timeout=timeout, env=env)
    except FileNotFoundError:
        raise AgentError("command_not_found", "%s is not installed on this node" % argv[0]) from None
    except subprocess.TimeoutExpired:
        raise AgentError("command_timeout", "%s did not finish within %ss" % (" ".join(argv[:3]), timeout)) from None
    if check and proc.returncode != 0:
        raise AgentError("command_failed", "%s exited %d: %s" % (
            " ".join(argv[:3]), proc.returncode, (proc.stderr or proc.stdout).strip()[-800:]))
    return proc


def write_file(path, text, mode=0o600):
    """Write then rename, so a reader never sees half a file; the data, then the rename, on disk before it returns
    (fsync of the file before the rename, then of its folder). Before, neither was synced: after a power loss a VM's
    vm.json written shortly before could come back empty, and its VM was taken as none (review r54 #3)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    sync_dir(os.path.dirname(path) or ".")


def sync_dir(path):
    """fsync a folder, so that a rename into it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        # docker: how GPUs reach a container ("toolkit": --gpus via the NVIDIA container toolkit; "none"; or
        # "devices:<host path with {index}>": --device <path>:/dev/nvidia<index>, the tests' stand-in), the host
        # address container ports are published on (default all), and when to pull ("always" checks the renter
        # may read the image even when a copy is cached; "missing" takes a catalogue image from the cache, never a
        # renter's own image or one pulled with credentials: dockerpull.py).
        self.docker_gpus = env.get("GPUMARKET_DOCKER_GPUS") or "toolkit"
        self.docker_bind = env.get("GPUMARKET_DOCKER_BIND") or None
        self.docker_pull = env.get("GPUMARKET_DOCKER_PULL") or "always"
        # Registries inside the node's network that a renter's own image may still come from (`host` or
        # `host:port`, comma-separated; reference.internal_registry): none by default, the tests' local registry.
        self.internal_registries = tuple(item.strip().lower() for item in
                                         (env.get("GPUMARKET_INTERNAL_REGISTRIES") or "").split(",") if item.strip())
        self.libvirt_uri = env.get("GPUMARKET_LIBVIRT_URI") or "qemu:///system"
        self.libvirt_dir = env.get("GPUMARKET_LIBVIRT_DIR") or "/var/lib/libvirt/images/gpumarket"
        self.libvirt_images = env.get("GPUMARKET_LIBVIRT_IMAGES") or "/var/lib/libvirt/images"
        if self.runtime is not None and self.runtime not in RUNTIMES:
            raise AgentError("bad_node_config", "GPUMARKET_RUNTIME must be one of %s" % ", ".join(RUNTIMES))
        if not (self.docker_gpus in ("toolkit", "none") or
                (self.docker_gpus.startswith("devices:/") and "{index}" in self.docker_gpus)):
            raise AgentError("bad_node_config", "GPUMARKET_DOCKER_GPUS must be toolkit, none or devices:/path{index}")
        if self.docker_pull not in ("always", "missing"):
            raise AgentError("bad_node_config", "GPUMARKET_DOCKER_PULL must be always or missing")
        if self.runtime == "sim" and not (self.sim_profile and self.sim_root):
            raise AgentError("bad_node_config", "sim runtime needs GPUMARKET_SIM_PROFILE and GPUMARKET_SIM_ROOT")


def emit(answer, out=None):
    """Print the one answer; False if one was printed already (the watchdog and main() may race)."""
    with _EMIT_LOCK:
        if _EMITTED:
            return False
        _EMITTED.append(True)
        out = out or sys.stdout
        out.write(json.dumps(answer, sort_keys=True) + "\n")
        out.flush()
        return True
