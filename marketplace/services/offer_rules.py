"""Whether a node takes new load now (a booking, a volume, the start of a stopped instance): the offers' rule
(models.nodes.offerable) in words a renter can act on, checked by each under the node's lock."""
from django.conf import settings

from marketplace.models import Node, NodeState, Runtime
from marketplace.models.nodes import LISTABLE_VERDICTS

NODE_STATE_REASONS: dict[str, str] = {
    NodeState.PENDING: "its node has not been verified yet",
    NodeState.VERIFYING: "its node is being verified",
    NodeState.REJECTED: "its node did not pass the benchmark check",
    NodeState.MAINTENANCE: "its node is in maintenance",
    NodeState.OFFLINE: "its node is offline",
    NodeState.QUARANTINED: "its node is quarantined",
    NodeState.RETIRED: "its node was retired by its provider",
}

# A node whose last health check failed: its jobs would not reach it, and once NODE_INTERRUPT_AFTER_FAILED_CHECKS
# fail in a row its renters are interrupted (the offers leave it out: models.nodes.ANSWERING).
NODE_NOT_ANSWERING = "its node did not answer its last health check"


# Where the platform takes no simulated GPUs (settings.SIM_NODES_ALLOWED off), a sim node registered before takes
# no new load: neither a booking (models.nodes.offerable, node_refusal) nor the start of a stopped instance, which
# takes GPUs again (instances.lifecycle.instance_start).
SIMULATED_NOT_TAKEN = "its node's GPUs are simulated, which this platform does not take"


def node_simulated_not_taken(node: Node) -> bool:
    """Whether `node`'s GPUs are simulated where the platform takes none (SIMULATED_NOT_TAKEN)."""
    return node.runtime == Runtime.SIM and not settings.SIM_NODES_ALLOWED


def node_refusal(node: Node, *, provider_active: bool) -> str | None:
    """Why `node` takes no new rentals now; None when it does. `provider_active`: its provider's account, read
    by the caller (a booking reads it under the account row's key-share lock: instances.allocation)."""
    if not provider_active:
        return "its provider's account was deactivated by the platform's operators"
    if node.state != NodeState.ACTIVE:
        return NODE_STATE_REASONS.get(node.state, f"its node is {node.state}")
    if node.health_failures:  # models.nodes.ANSWERING; the start of a stopped instance refuses it in these words
        return NODE_NOT_ANSWERING
    if node.verdict not in LISTABLE_VERDICTS:
        return "its node has not passed the benchmark check"
    if not node.listed:
        return "its provider has unlisted it"
    if node_simulated_not_taken(node):
        return SIMULATED_NOT_TAKEN
    return None
