"""The agent's interactive channels over an open SSH connection (NodeSession.exchange and .served): one JSON
object a line both ways (AgentExchange), and the long-lived `serve` agent on one of them (AgentServe)."""
from __future__ import annotations

import contextlib
import json
import time

import paramiko

from core import untrusted_json
from provisioning.ssh_errors import (
    AgentEnded,
    AgentFailed,
    AgentGarbage,
    AgentMissing,
    AgentTimeout,
    NodeError,
    NodeUnreachable,
    missing_agent,
)
from provisioning.ssh_round_trip import transport_round_trips

MAX_ANSWER_BYTES = 8 << 20  # one answer line, and one non-interactive command's whole answer


class AgentServe:
    """The long-lived agent (`serve`) on one channel: send() a request line, answer() reads its answer line.
    Any failure but the agent's own refusal (AgentFailed) closes it: what comes next on it is unknown."""

    def __init__(self, exchange: AgentExchange):
        self.exchange = exchange
        self.next_id = 0
        self.closed = False

    def send(self, command: str, request: dict) -> int:
        self.next_id += 1
        try:
            self.exchange.send({"id": self.next_id, "command": command, "request": request})
        except NodeError:
            self.close()
            raise self._ended() from None  # the agent's channel closed; the connection itself may be fine
        return self.next_id

    def answer(self, request_id: int, timeout: float) -> dict:
        try:
            line, _ = self.exchange.receive(timeout)
        except EOFError:
            self.close()
            raise self._ended() from None
        except NodeError:
            self.close()
            raise
        if line is None:
            self.close()
            raise AgentTimeout(f"The node did not answer within {timeout:.0f}s.")
        try:
            answer = untrusted_json.answer_loads(line)  # a node's nesting past the recursion limit too (it was a crash)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or answer.get("id") != request_id or "ok" not in answer:
            self.close()
            raise AgentGarbage(f"The agent's answer is not the answer to request {request_id}: {line[:200]!r}")
        del answer["id"]
        if not answer["ok"]:
            error = answer.get("error") or {}
            # its file was removed or replaced; it has stopped (an error not an object: AgentFailed takes it)
            if isinstance(error, dict) and error.get("code") == "agent_missing":
                self.close()
                raise AgentMissing(str(error.get("message") or "the agent's file is gone"))
            raise AgentFailed(error)
        return answer

    def _ended(self) -> NodeError:
        chan = self.exchange.chan
        transport = chan.get_transport()
        if transport is None or not transport.is_active():
            return NodeUnreachable("The SSH connection broke during a command.")
        err = bytearray()
        with contextlib.suppress(OSError, paramiko.SSHException, EOFError):
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
        return missing_agent(err) or AgentEnded(f"The agent stopped without answering (stderr: {bytes(err[-300:])!r}).")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.exchange.close()


class AgentExchange:
    """One interactive agent command: send() writes a JSON line, receive() reads one line (bytes) by a deadline,
    both on the time.monotonic() clock. receive() gives (None, now) on timeout and raises EOFError once the agent
    closed its output; a broken connection raises NodeUnreachable."""

    def __init__(self, chan: paramiko.Channel):
        self.chan = chan
        self.buffer = bytearray()
        self.closed = False

    def send(self, message: dict) -> float:
        try:
            self.chan.sendall(json.dumps(message).encode() + b"\n")
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise NodeUnreachable(f"The SSH connection broke during a command: {exc}") from None
        return time.monotonic()

    def receive(self, timeout: float) -> tuple[bytes | None, float]:
        deadline = time.monotonic() + timeout
        while True:
            end = self.buffer.find(b"\n")
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[:end + 1]
                return line, time.monotonic()
            if self.closed:
                raise EOFError("the agent closed its output")
            left = deadline - time.monotonic()
            if left <= 0:
                return None, time.monotonic()
            self.chan.settimeout(min(left, 1.0))
            try:
                chunk = self.chan.recv(65536)
            except TimeoutError:
                continue
            except (OSError, paramiko.SSHException, EOFError) as exc:
                raise NodeUnreachable(f"The SSH connection broke during a command: {exc}") from None
            if not chunk:
                self.closed = True
                if self.buffer:  # a last line without its newline
                    self.buffer += b"\n"
                continue
            self.buffer += chunk
            if len(self.buffer) > MAX_ANSWER_BYTES:
                raise EOFError("the agent's answer is larger than 8 MiB")

    def transport_round_trips(self, timeout: float = 5.0) -> dict[str, list[float]]:
        """Round trips the agent does not answer (the SSH server's, the platform kernel's TCP estimate): see
        ssh_round_trip.py."""
        return transport_round_trips(self.chan.get_transport(), timeout)

    def close(self) -> None:
        self.chan.close()
