"""Errors, running commands, files and the node's configuration."""
import json
import os
import subprocess

AGENT_VERSION = "1.2.0"
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
