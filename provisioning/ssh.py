"""The platform's SSH client to nodes (paramiko), and the agent protocol over it.

- Key auth with the node's own ed25519 key, decrypted in memory only.
- Host key pinned: the fingerprint the provider gave, or the one recorded on first
  contact. A different key raises HostKeyMismatch before anything is sent.
- Only to addresses the platform may connect to (checked_connection: public, or in the operator's
  NODE_ADDRESS_ALLOWED_NETWORKS), checked at every connection and connected to as checked: AddressRefused else.
- Connect/command timeouts, keepalive, bounded retries with backoff on transient
  failures only (a refused key or a changed host key is not retried). A channel request (exec, the sftp
  subsystem) waits for the node's answer at most the connect timeout (_channel_request): paramiko waits for it
  with no bound of its own.
- One connection for all the steps of a task (use NodeSession as a context manager).
- The agent (a package) is uploaded over SFTP as one zipapp under a name derived
  from its hash, so it is re-uploaded only when it changes. Commands come from a fixed set; the request
  travels as JSON on stdin, never inside the command line.

The errors (each with a stable code) are in ssh_errors.py, the interactive channels (AgentExchange, the
long-lived `serve` agent) in ssh_channels.py, kept connections in ssh_pool.py.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import paramiko

from core import untrusted_json
from core.addresses import AddressNotAllowed, node_address_targets
from provisioning.agent.gpumarket_agent.bundle import build_zipapp
from provisioning.ssh_channels import MAX_ANSWER_BYTES, AgentExchange, AgentServe
from provisioning.ssh_errors import (
    AddressRefused,
    AgentAnswerRefused,
    AgentEnded,
    AgentFailed,
    AgentGarbage,
    AgentTimeout,
    AuthFailed,
    HostKeyMismatch,
    NodeError,
    NodeUnreachable,
    PlatformKeyUnreadable,
    missing_agent,
)

log = logging.getLogger(__name__)

AGENT_PATH = Path(__file__).resolve().parent / "agent" / "gpumarket_agent"  # the package, shipped as a zipapp
REMOTE_AGENT_DIR = ".gpumarket/agent"
AGENT_COMMANDS = {
    ("inventory",), ("health",), ("benchmark",), ("challenge",), ("memproof",),
    ("vm", "create"), ("vm", "start"), ("vm", "stop"), ("vm", "destroy"), ("vm", "list"), ("vm", "status"),
    ("volume", "create"), ("volume", "delete"), ("volume", "list"),
    ("vm", "logs"),
    ("serve",),  # interactive, long-lived (NodeSession.served)
}
SERVED_COMMANDS = {"health"}  # what a long-lived `serve` agent answers (the agent's cli.SERVED)
NET_TEST_COMMAND = "cat > /dev/null"  # the platform's network test (NodeSession.upload_throughput)



def fingerprint(key: paramiko.PKey) -> str:
    """The SHA-256 fingerprint exactly as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def key_type(key: paramiko.PKey) -> str:
    """The key's type as `ssh-keygen -lf` names it, lowercased: ed25519, ecdsa, rsa (paramiko names it
    ssh-ed25519, ecdsa-sha2-nistp256, ssh-rsa)."""
    return key.get_name().removeprefix("ssh-").split("-")[0]


@lru_cache(maxsize=1)
def agent_bundle() -> tuple[bytes, str]:
    """The agent's zipapp (built in memory, deterministic) and the remote path named after its hash."""
    data = build_zipapp(str(AGENT_PATH))
    digest = hashlib.sha256(data).hexdigest()[:16]
    return data, f"{REMOTE_AGENT_DIR}/gpumarket_agent-{digest}.pyz"


class _PinnedHostKey(paramiko.MissingHostKeyPolicy):
    """Accept exactly the pinned key; with no pin yet, accept and remember what was seen."""

    def __init__(self, pinned: str):
        self.pinned = pinned
        self.seen: str | None = None
        self.seen_type = ""

    def missing_host_key(self, client, hostname, key):
        self.seen, self.seen_type = fingerprint(key), key_type(key)
        if self.pinned and self.seen != self.pinned:
            raise HostKeyMismatch(self.pinned, self.seen, self.seen_type)


Target = tuple[socket.AddressFamily, tuple[Any, ...]]


def checked_addresses(host: str, port: int, timeout: float | None = None) -> list[Target]:
    """Where the platform may connect for a node's `host`:`port`: `host` resolved once, and every address it has
    checked (core.addresses.node_address_targets: public, or in settings.NODE_ADDRESS_ALLOWED_NETWORKS); the
    (family, sockaddr) pairs to connect to. AddressRefused (not retried) when an address is outside the rule;
    NodeUnreachable (retried) when the name does not resolve now, or not within `timeout` seconds."""
    try:
        return node_address_targets(host, port, timeout)
    except AddressNotAllowed as exc:
        again = f"Point {host} at the server's public address again, or r" if exc.by_name else "R"
        raise AddressRefused(f"The platform does not connect to {host}:{port}: {exc.message} No connection was "
                             f"opened. {again}egister the server at its public address and retire this node.") from None
    except (OSError, UnicodeError) as exc:
        raise NodeUnreachable(f"Cannot reach {host}:{port}: the name does not resolve ({exc}).") from None


def checked_connection(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to `host`:`port` at an address checked_addresses gave, never to the name again: a DNS
    answer that changes between the check and the connection (rebinding) cannot send it into the platform's own
    network. Its errors, raised before any socket is opened; else the connection's OSError (TimeoutError) when no
    address answers."""
    targets = checked_addresses(host, port, timeout)
    failure: OSError = OSError(f"no address of {host} to connect to")
    for family, sockaddr in targets:  # as socket.create_connection, over the checked addresses only
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            failure = exc
    raise failure


def _setting(name: str, default):
    from django.conf import settings

    return getattr(settings, name, default) if settings.configured else default


@dataclass
class Endpoint:
    address: str
    port: int
    user: str
    private_key: bytes = field(repr=False)  # OpenSSH format, decrypted
    host_key_fingerprint: str = ""  # empty: trust on first use, then pinned by the caller


@dataclass
class Timeouts:
    connect: float = 10.0
    command: float = 120.0
    keepalive: int = 15
    attempts: int = field(default_factory=lambda: _setting("NODE_CONNECT_ATTEMPTS", 3))
    backoff: float = field(default_factory=lambda: _setting("NODE_CONNECT_BACKOFF_S", 1.0))  # doubled each time


class NodeSession:
    """One SSH connection to a node, used for every step of a task.

    with NodeSession(endpoint) as s:
        s.seen_fingerprint     # record it if the node had none pinned
        s.agent("inventory")
    """

    def __init__(self, endpoint: Endpoint, timeouts: Timeouts | None = None):
        self.endpoint = endpoint
        self.timeouts = timeouts or Timeouts()
        self.seen_fingerprint: str | None = None
        self.seen_key_type = ""  # its type (key_type): ed25519 where the server has one (paramiko asks for it first)
        self._client: paramiko.SSHClient | None = None
        self._agent_path: str | None = None
        self._serve: AgentServe | None = None  # the long-lived agent on this connection, once started
        self.fresh = True  # False: a connection kept from before (provisioning.ssh_pool), not opened for this use

    # -- connection -------------------------------------------------------------------------------
    def __enter__(self) -> NodeSession:
        self.connect()
        return self

    def __exit__(self, *exc):
        self.close()

    def connect(self) -> None:
        delay = self.timeouts.backoff
        for attempt in range(1, self.timeouts.attempts + 1):
            try:
                self._connect_once()
                return
            except NodeError as exc:
                if not exc.transient or attempt == self.timeouts.attempts:
                    raise
                log.info("connect to %s:%s failed (%s); retry %d in %.1fs", self.endpoint.address,
                         self.endpoint.port, exc, attempt, delay)
                time.sleep(delay)
                delay *= 2

    def _connect_once(self) -> None:
        ep = self.endpoint
        try:
            pkey = paramiko.Ed25519Key.from_private_key(io.StringIO(ep.private_key.decode()))
        except (paramiko.SSHException, ValueError) as exc:
            raise PlatformKeyUnreadable(f"The platform's key for this node cannot be read: {exc}") from None
        client = paramiko.SSHClient()
        policy = _PinnedHostKey(ep.host_key_fingerprint)
        client.set_missing_host_key_policy(policy)  # no known_hosts is loaded: the policy decides
        t = self.timeouts.connect
        try:
            sock = checked_connection(ep.address, ep.port, t)
            # Without it, key exchange's small writes wait on delayed ACKs: 73 ms → 25 ms per connect.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Over the socket to the checked address; the registered name and port are what the host-key policy
            # is asked about, as before.
            client.connect(
                ep.address, port=ep.port, username=ep.user, pkey=pkey, timeout=t, banner_timeout=t,
                auth_timeout=t, channel_timeout=t, allow_agent=False, look_for_keys=False, sock=sock,
            )
        except NodeError:  # a changed host key, an address the platform does not connect to
            client.close()
            raise
        except paramiko.AuthenticationException:
            client.close()
            raise AuthFailed(
                f"{ep.user}@{ep.address}:{ep.port} refused the platform's key. "
                "Run the node's install command as that user, then verify again."
            ) from None
        except TimeoutError:
            client.close()
            raise NodeUnreachable(f"No SSH answer from {ep.address}:{ep.port} within {t:.0f}s.") from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            client.close()
            raise NodeUnreachable(f"Cannot reach {ep.address}:{ep.port} over SSH: {exc}") from None
        transport = client.get_transport()
        assert transport is not None  # connect() succeeded: the client has its transport
        transport.set_keepalive(self.timeouts.keepalive)
        self.seen_fingerprint, self.seen_key_type = policy.seen, policy.seen_type
        self._client = client

    def close(self) -> None:
        self._serve = None  # its channel closes with the connection
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- the agent --------------------------------------------------------------------------------
    def ensure_agent(self) -> str:
        """Upload the agent unless this exact version is already there; returns its absolute remote path."""
        if self._agent_path:
            return self._agent_path
        assert self._client is not None, "connect() comes first"
        data, remote = agent_bundle()
        try:
            with self._sftp() as sftp:
                try:
                    if sftp.stat(remote).st_size == len(data):
                        self._agent_path = sftp.normalize(remote)
                        return self._agent_path
                except FileNotFoundError:
                    pass
                path = ""
                for part in REMOTE_AGENT_DIR.split("/"):
                    path = f"{path}/{part}" if path else part
                    try:
                        sftp.mkdir(path, 0o700)
                    except OSError:
                        pass  # exists
                tmp = f"{remote}.part"
                sftp.putfo(io.BytesIO(data), tmp)
                sftp.chmod(tmp, 0o700)
                sftp.posix_rename(tmp, remote)
                # Absolute, as the node sees it: a session's working folder may differ from SFTP's.
                self._agent_path = sftp.normalize(remote)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise NodeUnreachable(f"Uploading the agent failed: {exc}") from None
        return self._agent_path

    def _sftp(self) -> paramiko.SFTPClient:
        """An SFTP client on a channel of its own, every step bounded. SSHClient.open_sftp() waited with no bound
        for the node's answer to the subsystem request, then for its SFTP version: a node that let the platform
        in and then stopped answering held the check (and its whole fleet batch) forever (found by review)."""
        transport = self._client.get_transport() if self._client is not None else None
        if transport is None:
            raise NodeUnreachable("The SSH connection is closed.")
        chan = transport.open_session(timeout=self.timeouts.connect)
        try:
            _channel_request(chan, lambda: chan.invoke_subsystem("sftp"), self.timeouts.connect, "SFTP")
            chan.settimeout(self.timeouts.connect)  # the server's SFTP version, read in SFTPClient()
            sftp = paramiko.SFTPClient(chan)
        except BaseException:
            chan.close()
            raise
        # Each SFTP request waits on its channel: bounded, a node that stops answering mid-upload ends it.
        chan.settimeout(self.timeouts.command)
        return sftp

    def agent(self, command: str, sub: str | None = None, request: dict | None = None,
              timeout: float | None = None) -> dict:
        """Run one agent command with `request` as JSON on stdin; return its answer (ok=true)."""
        argv = (command,) if sub is None else (command, sub)
        if argv not in AGENT_COMMANDS:
            raise ValueError(f"unknown agent command {argv}")
        remote = self.ensure_agent()
        # Only constants reach the command line: the path is hash-derived, argv is whitelisted.
        assert re.fullmatch(r"[A-Za-z0-9._/-]+", remote)
        cmd = " ".join(["python3", remote, *argv])
        payload = json.dumps(request or {}).encode()
        out = self._exec(cmd, payload, timeout or self.timeouts.command)
        try:
            answer = untrusted_json.answer_loads(out)  # a node's nesting past the recursion limit too (it was a crash)
        except untrusted_json.Refused as exc:  # JSON, but not what an answer may hold (NaN, a NUL, too deep)
            raise AgentAnswerRefused(f"The agent's answer to {' '.join(argv)} is refused: {exc}", str(exc)) from None
        except ValueError:
            raise AgentGarbage(f"The agent's answer to {' '.join(argv)} is not JSON: {out[:200]!r}") from None
        if not isinstance(answer, dict) or "ok" not in answer:
            raise AgentGarbage(f"The agent's answer to {' '.join(argv)} is not an agent answer: {out[:200]!r}")
        if not answer["ok"]:
            raise AgentFailed(answer.get("error") or {})
        return answer

    def exchange(self, command: str) -> AgentExchange:
        """Start an interactive agent command (one JSON object a line both ways); close the result when done."""
        if (command,) not in AGENT_COMMANDS:
            raise ValueError(f"unknown agent command {command}")
        remote = self.ensure_agent()
        assert re.fullmatch(r"[A-Za-z0-9._/-]+", remote)
        try:
            transport = self._client.get_transport() if self._client is not None else None
            if transport is None:
                raise NodeUnreachable("The SSH connection is closed.")
            chan = transport.open_session(timeout=self.timeouts.connect)
            _channel_request(chan, lambda: chan.exec_command(" ".join(["python3", remote, command])),
                             self.timeouts.connect, "command")
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise NodeUnreachable(f"The SSH connection broke during a command: {exc}") from None
        return AgentExchange(chan)

    # -- the long-lived agent (`serve`): a command is one line written and one line read ----------
    @property
    def serving(self) -> bool:
        """A long-lived agent is running on this connection (a command needs no channel or process start)."""
        return self._serve is not None and not self._serve.closed

    def serve_send(self, command: str, request: dict | None = None) -> int:
        """Send one command to the long-lived agent (started on first use); returns its request id. Read the
        answer with serve_answer: a batch sends to many nodes before it reads any answer."""
        if command not in SERVED_COMMANDS:
            raise ValueError(f"the agent does not serve {command!r}")
        if not self.serving:
            self._serve = AgentServe(self.exchange("serve"))
        assert self._serve is not None
        return self._serve.send(command, request or {})

    def serve_answer(self, request_id: int, timeout: float | None = None) -> dict:
        if self._serve is None:
            raise NodeUnreachable("The agent's long-lived channel is closed.")
        serve = self._serve
        try:
            return serve.answer(request_id, timeout or self.timeouts.command)
        finally:
            if serve.closed and self._serve is serve:
                self._serve = None

    def served(self, command: str, request: dict | None = None, timeout: float | None = None) -> dict:
        """One command through the long-lived agent. If the one kept from before has ended (its process was
        stopped on the node), a new one is started once on the same connection."""
        kept = self.serving
        try:
            return self.serve_answer(self.serve_send(command, request), timeout)
        except AgentEnded:
            if not kept:
                raise
        return self.serve_answer(self.serve_send(command, request), timeout)

    def upload_throughput(self, nbytes: int, timeout: float | None = None) -> float:
        """Measure the platform-to-node throughput: send `nbytes` over this SSH connection to `cat > /dev/null` on
        the node (a constant command: nothing of anyone's input) and time it until the node has read them all.
        Mbit/s of the encrypted stream, so it includes SSH's cipher cost on both ends; a floor, not the link's."""
        assert self._client is not None, "connect() comes first"
        limit = timeout or self.timeouts.command
        deadline = time.monotonic() + limit
        block = b"\0" * 65536
        try:
            transport = self._client.get_transport()
            if transport is None:
                raise NodeUnreachable("The SSH connection is closed.")
            chan = transport.open_session(timeout=self.timeouts.connect)
            chan.settimeout(max(deadline - time.monotonic(), 1.0))
            _channel_request(chan, lambda: chan.exec_command(NET_TEST_COMMAND),
                             max(min(self.timeouts.connect, deadline - time.monotonic()), 0.001), "command")
            started = time.perf_counter()
            sent = 0
            while sent < nbytes:
                if time.monotonic() > deadline:
                    chan.close()
                    raise AgentTimeout(f"The network test did not finish within {limit:.0f}s.")
                chunk = block[: min(len(block), nbytes - sent)]
                chan.sendall(chunk)
                sent += len(chunk)
            chan.shutdown_write()
            # The node has read (and discarded) every byte.
            status = _exit_status(chan, deadline, f"The network test did not finish within {limit:.0f}s.")
            elapsed = time.perf_counter() - started
            chan.close()
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise NodeUnreachable(f"The SSH connection broke during the network test: {exc}") from None
        if status != 0:
            raise AgentGarbage(f"The network test's `{NET_TEST_COMMAND}` exited {status} on the node.")
        return nbytes * 8 / 1e6 / max(elapsed, 1e-6)

    def _exec(self, cmd: str, stdin: bytes, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        try:
            transport = self._client.get_transport() if self._client is not None else None
            if transport is None:  # closed (or never connected): the same answer as a broken connection
                raise NodeUnreachable("The SSH connection is closed.")
            chan = transport.open_session(timeout=self.timeouts.connect)
            chan.settimeout(1.0)
            _channel_request(chan, lambda: chan.exec_command(cmd),
                             max(min(self.timeouts.connect, deadline - time.monotonic()), 0.001), "command")
            chan.sendall(stdin)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            while True:
                if time.monotonic() > deadline:
                    chan.close()
                    raise AgentTimeout(f"The node did not answer within {timeout:.0f}s.")
                try:
                    chunk = chan.recv(65536)
                except TimeoutError:
                    chunk = None
                while chan.recv_stderr_ready():
                    _keep_tail(err, chan.recv_stderr(65536))
                if chunk == b"":
                    break
                if chunk:
                    out += chunk
                    if len(out) > MAX_ANSWER_BYTES:
                        chan.close()
                        raise AgentGarbage("The agent's answer is larger than 8 MiB.")
            _exit_status(chan, deadline, f"The node did not answer within {timeout:.0f}s.")
            while chan.recv_stderr_ready():  # what came after the last stdout bytes
                _keep_tail(err, chan.recv_stderr(65536))
            chan.close()
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise NodeUnreachable(f"The SSH connection broke during a command: {exc}") from None
        if not out.strip():
            missing = missing_agent(err)
            if missing is not None:
                raise missing
            raise AgentGarbage(f"The agent printed nothing (stderr: {bytes(err[-300:])!r}).")
        return bytes(out)


# A command's stderr is read only for its last words (missing_agent, the "printed nothing" message): its tail is kept.
STDERR_TAIL_BYTES = 4096


def _keep_tail(err: bytearray, chunk: bytes) -> None:
    """Append `chunk` to `err`, keeping its last STDERR_TAIL_BYTES only. A node's stderr was read whole for the
    command's timeout while stdout stopped at MAX_ANSWER_BYTES: a node streaming stderr filled the worker's memory
    (214 MiB for 200 MiB of stderr; found by review)."""
    err += chunk
    if len(err) > STDERR_TAIL_BYTES:
        del err[:-STDERR_TAIL_BYTES]


def _channel_request(chan: paramiko.Channel, request: Callable[[], None], limit: float, what: str) -> None:
    """Send a channel request (`request`: exec_command, invoke_subsystem) and wait at most `limit` seconds for the
    node's answer; AgentTimeout after that, the channel closed. paramiko waits for the answer with no bound
    (Channel._wait_for_event: neither settimeout nor the keepalive, which expects no reply, covers it): a node whose
    sshd let the platform in and opened the channel, then never answered (a frozen host, a provider's fake SSH
    server), held the health check, and the whole fleet batch waiting for it, until the worker was killed (found by
    review). Closing the channel is what wakes the waiting request."""
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        with contextlib.suppress(OSError, paramiko.SSHException, EOFError):  # the connection broke meanwhile
            chan.close()

    timer = threading.Timer(limit, expire)
    timer.daemon = True
    timer.start()
    try:
        request()
    except (OSError, paramiko.SSHException, EOFError):
        if not expired.is_set():
            raise
    finally:
        timer.cancel()
    if expired.is_set():  # woken by the timer, or answered as it fired (the channel is closed either way)
        raise AgentTimeout(f"The node's SSH server let the platform in but did not answer its {what} request "
                           f"within {limit:.0f}s.")


def _exit_status(chan: paramiko.Channel, deadline: float, late: str) -> int:
    """The command's exit status, by `deadline` (time.monotonic()) or AgentTimeout(`late`). paramiko's
    recv_exit_status() waits with no bound (settimeout does not cover it): a node that read everything, or closed
    its output, but never sent a status held the check until Celery's hard limit (found by review)."""
    while not chan.exit_status_ready():
        if time.monotonic() > deadline:
            chan.close()
            raise AgentTimeout(late)
        time.sleep(0.01)
    return chan.recv_exit_status()
