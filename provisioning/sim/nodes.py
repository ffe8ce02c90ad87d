"""Start and stop simulated GPU nodes.

A node is one `sshd -f <node dir>/sshd_config` listening on its own port, with its own ed25519 host key and
its own folder `<base>/nodes/<port>/`. Its sshd's `SetEnv` puts the agent in `sim` mode with the node's
profile, so the platform drives it exactly like a real server: SSH with a pinned host key, SFTP upload, the
agent's JSON protocol. The node's VMs (sshd processes started by the agent) live in `<node dir>/vms/`.

No database: the base folder comes from `settings.SIMNODES_DIR` when Django is configured, else from the
environment variable GPUMARKET_SIMNODES_DIR, else `<repo>/var/simnodes`.
"""
from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

from provisioning.agent import gpumarket_agent as agent

REPO_DIR = Path(__file__).resolve().parents[2]
PROFILES_DIR = REPO_DIR / "provisioning" / "agent" / "profiles"
# sshd_config has no quoting for these paths and expands %-tokens: keep paths plain.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._/+@=,-]*")


def simnodes_dir(base_dir: str | os.PathLike | None = None) -> Path:
    if base_dir is not None:
        return Path(base_dir).resolve()
    try:
        from django.conf import settings

        if settings.configured:
            return Path(settings.SIMNODES_DIR).resolve()
    except ImportError:
        pass
    return Path(os.environ.get("GPUMARKET_SIMNODES_DIR") or REPO_DIR / "var" / "simnodes").resolve()


def resolve_profile(profile: str | os.PathLike) -> Path:
    """A profile name from provisioning/agent/profiles/, or a path to a profile file."""
    text = str(profile)
    if re.fullmatch(r"[a-z0-9][a-z0-9-]*", text) and (PROFILES_DIR / f"{text}.json").is_file():
        return PROFILES_DIR / f"{text}.json"
    path = Path(text).expanduser()
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
        raise ValueError(f"no profile {text!r}; known profiles: {', '.join(known)}")
    return path.resolve()


def _sshd_config(node: Path, port: int, listen: str, public_address: str | None) -> str:
    env = {
        "GPUMARKET_RUNTIME": "sim",
        "GPUMARKET_SIM_PROFILE": str(node / "profile.json"),
        "GPUMARKET_SIM_ROOT": str(node),
        "GPUMARKET_SIM_LISTEN": listen,
        # Each node its own home: uploads (SFTP starts there too) never collide between nodes.
        "HOME": str(node / "home"),
    }
    if public_address:
        env["GPUMARKET_PUBLIC_HOST"] = public_address
    return "\n".join(
        [
            f"Port {port}",
            f"ListenAddress {listen}",
            f"HostKey {node / 'ssh_host_ed25519_key'}",
            f"PidFile {node / 'sshd.pid'}",
            f"AuthorizedKeysFile {node / 'authorized_keys'}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # test folders are not root-owned 0700 chains
            "PermitRootLogin prohibit-password",
            "PermitUserEnvironment no",
            "X11Forwarding no",
            "MaxStartups 50:30:200",  # fleet health checks open many connections at once
            f"Subsystem sftp internal-sftp -d {node / 'home'}",
            "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()),
            "",
        ]
    )


def _free_port(listen: str) -> int:
    with socket.socket() as sock:
        sock.bind((listen, 0))
        return sock.getsockname()[1]


def _run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
    return proc.stdout


def _fingerprint(pub_path: Path) -> str:
    # `ssh-keygen -lf` prints "256 SHA256:... comment (ED25519)"; the platform pins the second field.
    return _run(["ssh-keygen", "-lf", str(pub_path)]).split()[1]


def _own_gpus(profile_file: Path, host_public_key: str) -> None:
    """Give this server GPUs of its own: every GPU UUID of its copy of the profile is derived from the profile's and
    the server's host key. Two servers started from one profile do not report the same GPUs (the platform refuses a
    GPU UUID on two live nodes), and one server reports the same UUIDs for as long as it runs."""
    data = json.loads(profile_file.read_text())
    rows = []
    for line in data.get("nvidia_smi", []):
        for gpu in agent.parse_gpu_csv(line):
            if gpu.get("uuid"):
                d = hashlib.sha256(f"{host_public_key} {gpu['uuid']}".encode()).hexdigest()
                line = line.replace(gpu["uuid"], f"GPU-{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:32]}")
        rows.append(line)
    profile_file.write_text(json.dumps({**data, "nvidia_smi": rows}, indent=1))


def _read_pid(node: Path, timeout: float = 2.0) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int((node / "sshd.pid").read_text().strip())
        except (OSError, ValueError):
            time.sleep(0.02)
    return None


def node_up(
    profile: str | os.PathLike,
    base_dir: str | os.PathLike | None = None,
    *,
    listen_address: str = "127.0.0.1",
    public_address: str | None = None,
) -> dict:
    """Start one simulated node; return address, ssh_port, ssh_user, host_key_fingerprint, profile, pid."""
    profile_path = resolve_profile(profile)
    agent.load_profile(str(profile_path))  # refuse a broken profile before starting anything
    nodes = simnodes_dir(base_dir) / "nodes"
    if not _PLAIN_PATH.fullmatch(str(nodes)):
        raise ValueError(f"simnodes folder {nodes} must be a plain path (no spaces, quotes or %)")
    nodes.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)  # sshd's privilege-separation dir
    sshd = agent.find_sshd()
    error = ""
    for _ in range(3):  # the free port we picked can be taken before sshd binds it
        port = _free_port(listen_address)
        node = nodes / str(port)
        _remove_node_dir(node)
        for sub in ("home", "vms"):
            (node / sub).mkdir(parents=True)
        shutil.copyfile(profile_path, node / "profile.json")
        (node / "authorized_keys").touch(mode=0o600)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"simnode-{port}",
              "-f", str(node / "ssh_host_ed25519_key")])
        _own_gpus(node / "profile.json", (node / "ssh_host_ed25519_key.pub").read_text().split()[1])
        (node / "sshd_config").write_text(_sshd_config(node, port, listen_address, public_address))
        # Without -D, sshd daemonises: it keeps running after this call returns.
        proc = subprocess.run([sshd, "-f", str(node / "sshd_config"), "-E", str(node / "sshd.log")],
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        connect_to = "127.0.0.1" if listen_address in ("0.0.0.0", "::") else listen_address  # noqa: S104
        if proc.returncode == 0 and agent.wait_port(connect_to, port):
            break
        log = node / "sshd.log"
        error = (proc.stderr + (log.read_text() if log.exists() else "")).strip()[-500:]
        _stop_node_processes(node)
        _remove_node_dir(node)
    else:
        raise RuntimeError(f"sshd for a simulated node did not start: {error}")
    public_key = " ".join((node / "ssh_host_ed25519_key.pub").read_text().split()[:2])
    info = {
        "address": public_address or connect_to,
        "ssh_port": port,
        "ssh_user": pwd.getpwuid(os.getuid()).pw_name,
        "host_key_fingerprint": _fingerprint(node / "ssh_host_ed25519_key.pub"),
        "host_public_key": public_key,
        "profile": profile_path.stem,
        "profile_path": str(profile_path),
        "node_dir": str(node),
        "pid": _read_pid(node),
    }
    (node / "node.json").write_text(json.dumps(info, indent=1))
    return info


def node_authorize(port: int, public_key: str, base_dir: str | os.PathLike | None = None) -> bool:
    """Add a public key to the node's authorized_keys, as a provider's install command does on a real server.
    Returns False when the key was there already."""
    agent.validate_public_key(public_key)  # ValueError for anything but one plain key line
    keys_file = _node_dir(port, base_dir) / "authorized_keys"
    text = keys_file.read_text()
    if public_key in text.splitlines():
        return False
    with keys_file.open("a") as f:
        f.write(("\n" if text and not text.endswith("\n") else "") + public_key + "\n")
    return True


def nodes_list(base_dir: str | os.PathLike | None = None) -> list[dict]:
    nodes = simnodes_dir(base_dir) / "nodes"
    found = []
    for info_file in sorted(nodes.glob("*/node.json"), key=lambda p: int(p.parent.name)):
        info = json.loads(info_file.read_text())
        info["running"] = bool(agent.pids_matching(str(info_file.parent / "sshd_config")))
        vms = info_file.parent / "vms"
        info["vms"] = sorted(p.name for p in vms.iterdir() if p.is_dir()) if vms.is_dir() else []
        found.append(info)
    return found


def node_down(port: int, base_dir: str | os.PathLike | None = None) -> bool:
    """Stop a node, its VMs and every session under them; remove its folder. False if there was none."""
    node = simnodes_dir(base_dir) / "nodes" / str(int(port))
    if not node.exists():
        return False
    _stop_node_processes(node)
    _remove_node_dir(node)
    return True


def node_cut(port: int, base_dir: str | os.PathLike | None = None) -> bool:
    """Stop only the node's own sshd, as if its network were cut: the platform cannot reach it, its VMs keep
    running (their sshd are daemons of their own). False when it was not running."""
    node = _node_dir(port, base_dir)
    pids = agent.pids_matching(f"-f {node}/sshd_config")
    agent.kill_trees(pids)
    return bool(pids)


def node_restore(port: int, base_dir: str | os.PathLike | None = None) -> bool:
    """Start a cut node's sshd again on its port, with its host key; its VMs are as they were left.
    False when it was running already."""
    node = _node_dir(port, base_dir)
    config = node / "sshd_config"
    if agent.pids_matching(f"-f {config}"):
        return False
    proc = subprocess.run([agent.find_sshd(), "-f", str(config), "-E", str(node / "sshd.log")],
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    address = json.loads((node / "node.json").read_text())["address"]
    if proc.returncode != 0 or not agent.wait_port(address, port):
        raise RuntimeError(f"sshd of the simulated node on port {port} did not start again: {proc.stderr[-300:]}")
    return True


def nodes_down(base_dir: str | os.PathLike | None = None) -> int:
    nodes = simnodes_dir(base_dir) / "nodes"
    ports = [int(p.name) for p in nodes.iterdir() if p.name.isdigit()] if nodes.is_dir() else []
    return sum(node_down(port, base_dir) for port in ports)


def _node_dir(port: int, base_dir: str | os.PathLike | None) -> Path:
    node = simnodes_dir(base_dir) / "nodes" / str(int(port))
    if not (node / "node.json").is_file():
        raise LookupError(f"no simulated node on port {port}")
    return node


def _stop_node_processes(node: Path) -> None:
    # The node's sshd and its VMs' sshds all run with "-f <node dir>/...": one path finds them all.
    agent.kill_trees(agent.pids_matching(f"{node}/"))


def _remove_node_dir(node: Path, tries: int = 5) -> None:
    """Remove the node's folder. A process the kill missed (an sshd child forked after the process table was
    read) can still write its log while the folder goes: rmtree then fails with "Directory not empty" (seen once
    in CI), so kill what is left under the folder again and retry."""
    for attempt in range(tries):
        if not node.exists():
            return
        try:
            shutil.rmtree(node)
            return
        except OSError:
            if attempt == tries - 1:
                raise
            _stop_node_processes(node)
            time.sleep(0.1 * (attempt + 1))
