"""Test helpers for talking to simulated nodes over real SSH: fresh keys, host-key pinning, the agent protocol."""
import base64
import hashlib
import io
import json
from pathlib import Path

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from provisioning.ssh import agent_bundle

AGENT_DIR = Path(__file__).resolve().parents[2] / "provisioning" / "agent" / "gpumarket_agent"  # the package


def new_keypair(comment="test@gpumarket"):
    """A fresh ed25519 key: (paramiko key, OpenSSH public key line)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    ).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return paramiko.Ed25519Key.from_private_key(io.StringIO(private)), f"{public.decode()} {comment}"


def fingerprint(public_key_line):
    """SHA256 fingerprint as `ssh-keygen -lf` prints it, computed here independently."""
    blob = base64.b64decode(public_key_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def pinned_client(host, port, user, pkey, host_public_key):
    """Connect with the host key pinned: any other host key is refused (RejectPolicy)."""
    key_type, key_b64 = host_public_key.split()[:2]
    host_key = paramiko.PKey.from_type_string(key_type, base64.b64decode(key_b64))
    client = paramiko.SSHClient()
    client.get_host_keys().add(f"[{host}]:{port}", host_key.get_name(), host_key)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(host, port, username=user, pkey=pkey, allow_agent=False, look_for_keys=False, timeout=5,
                   banner_timeout=5, auth_timeout=5)
    return client


def run(client, command, stdin_text=None, timeout=20):
    stdin, stdout, stderr = client.exec_command(command, timeout=timeout)
    if stdin_text is not None:
        stdin.write(stdin_text)
    stdin.channel.shutdown_write()
    out, err = stdout.read().decode(), stderr.read().decode()
    return stdout.channel.recv_exit_status(), out, err


def write_agent(folder):
    """Write the agent's zipapp, exactly as the platform uploads it, into `folder`; return its path."""
    path = Path(folder) / "gpumarket_agent.pyz"
    path.write_bytes(agent_bundle()[0])
    return path


def upload_agent(client):
    """Upload the agent's zipapp over SFTP into the login's start folder; return its absolute remote path."""
    with client.open_sftp() as sftp:
        remote = sftp.normalize(".") + "/gpumarket_agent.pyz"
        sftp.putfo(io.BytesIO(agent_bundle()[0]), remote)
    return remote


def run_agent(client, agent_path, command, request=None):
    """Run one agent command with a JSON request; return (exit status, the one JSON answer)."""
    status, out, err = run(client, f"python3 {agent_path} {command}", json.dumps(request or {}))
    lines = out.splitlines()
    assert len(lines) == 1, f"agent must print exactly one line, got {out!r} (stderr {err!r})"
    return status, json.loads(lines[0])
