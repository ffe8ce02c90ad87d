"""An SSH server that lets the platform in, opens its session channels, and then never answers a channel request
(exec, the sftp subsystem): a frozen host, or a provider's fake SSH server. paramiko's server answers requests in
its transport thread, so everything after the request waits as well, until `close()`."""
import io
import socket
import threading

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from provisioning.ssh import fingerprint


def ed25519_pem() -> str:
    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()).decode()


class _Server(paramiko.ServerInterface):
    def __init__(self, release: threading.Event):
        self.release = release

    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        return paramiko.AUTH_SUCCESSFUL

    def check_channel_request(self, kind, chanid):
        return paramiko.OPEN_SUCCEEDED

    def check_channel_subsystem_request(self, channel, name):
        self.release.wait()
        return False

    def check_channel_exec_request(self, channel, command):
        self.release.wait()
        return False


class HungNode:
    """Listens on 127.0.0.1:`port` with host key `fingerprint`; close() lets every waiting request go (refused)."""

    def __init__(self):
        self.key = paramiko.Ed25519Key.from_private_key(io.StringIO(ed25519_pem()))
        self.fingerprint = fingerprint(self.key)
        self.release = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.transports: list[paramiko.Transport] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            transport = paramiko.Transport(conn)
            transport.add_server_key(self.key)
            self.transports.append(transport)
            try:
                transport.start_server(server=_Server(self.release))
            except (paramiko.SSHException, EOFError, OSError):
                transport.close()

    def close(self):
        self.release.set()
        self.sock.close()
        for transport in self.transports:
            transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
