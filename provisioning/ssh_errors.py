"""What can go wrong talking to a node (provisioning.ssh and its channels): each error has a stable `code` for
jobs, findings and the API, a message for people, and says whether a retry may help (`transient`)."""
from __future__ import annotations

from typing import Any


class NodeError(Exception):
    """Something went wrong talking to a node. `code` is stable; the message is for people."""

    code = "node_error"
    transient = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class NodeUnreachable(NodeError):
    code = "unreachable"
    transient = True


class AddressRefused(NodeUnreachable):
    """The node's address is, or now resolves to, an address the platform does not connect to (core.addresses:
    not public, nor in settings.NODE_ADDRESS_ALLOWED_NETWORKS). No connection was opened. Not retried: it stays so
    until the name's DNS records (or the operator's setting) change; a health check counts it as a failed check,
    with this message as the node's last error."""

    code = "address_refused"
    transient = False


class HostKeyMismatch(NodeError):
    code = "host_key_changed"

    def __init__(self, expected: str, seen: str, key_type: str = ""):
        super().__init__(
            f"The node's SSH host key changed: expected {expected}, got {seen}. Nothing was sent. "
            "If the server was reinstalled, an operator must confirm the new key."
        )
        # key_type: the kind of key the server showed (ed25519, ecdsa, rsa), where known.
        self.expected, self.seen, self.key_type = expected, seen, key_type


class AuthFailed(NodeError):
    code = "auth_failed"


class PlatformKeyUnreadable(AuthFailed):
    """The platform's own private key for this node cannot be read (a broken row, a key the encryption settings no
    longer open): nothing was asked of the node, so not its failure (provisioning.services.faults)."""

    code = "platform_key_unreadable"


class AgentTimeout(NodeError):
    code = "agent_timeout"
    transient = True


class AgentGarbage(NodeError):
    code = "agent_garbage"


class AgentAnswerRefused(AgentGarbage):
    """The answer is JSON but holds what no answer may (core.untrusted_json: NaN, a number out of range, a NUL, too
    deep); `reason` says which. A verification takes it as a malformed answer (a rejection naming it)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class AgentMissing(AgentGarbage):
    """The agent file is not on the node (removed, or the node was reinstalled): upload it again."""

    code = "agent_missing"


class AgentFailed(NodeError):
    """The agent answered {"ok": false, "error": {...}}. The error is the node's: anything else than an object
    (a bare string, a list) is taken as its message, never an AttributeError of ours."""

    def __init__(self, error: Any):
        if not isinstance(error, dict):
            error = {"message": f"the agent reported an error: {str(error)[:500]}" if error else ""}
        self.code = str(error.get("code") or "agent_error")[:64]
        field = error.get("field")
        self.field = field if isinstance(field, str) else None
        super().__init__(str(error.get("message") or "the agent reported an error")[:2000])


class AgentEnded(AgentGarbage):
    """The long-lived agent's output ended without the answer (its process stopped)."""

    code = "agent_ended"



def missing_agent(err: bytes | bytearray) -> AgentMissing | None:
    """The agent's file is gone, from the words python3 prints on stderr for a missing script."""
    if b"can't open file" in err:
        return AgentMissing(f"The agent is not on the node (stderr: {bytes(err[-300:])!r}).")
    return None
