"""A provider moves a node to a new address, SSH port or SSH user (the server renumbered, moved rack, a typo).

Before, nothing could change them (the API answered "cannot be changed here", the admin was read-only): a server
whose IP changed stayed offline, and retiring it ended its renters' stopped instances and deleted their volumes as
lost although the server and its data were intact at the new address (found by review, r54).

The new endpoint is checked as at registration (marketplace.services.nodes.node_endpoint_check: the address rule,
a name resolved within its bound, the provider's own same-address 409), then, for a node the platform reached, the
platform connects there and accepts it only if the server presents the node's PINNED host key and accepts the
node's own key: proof it is the same server. Only then is it stored (node_endpoint_set); until then the old one
stays, whatever fails. A wrong host key there does not quarantine the node: the server at the old address is
unchanged, and the new address is simply not this node's. A pending node never contacted has nothing to prove
with: its endpoint is stored at once, its `last_error` (the old endpoint's failed first contact) is cleared, and
its first contact at the new one is queued once that commits (node_verify_request, as the Verify button): since
5141fb1 a failed first contact is not retried, and the pending beat skips a node whose retries stopped, so before,
the provider who fixed a typo had to find Verify (review r55 LOW-6).

Two changes of the same node at once: each is checked and proven from the endpoint it read, and stored only if the
node is still there (node_endpoint_set's `was`, under the node's lock); the later one is refused (409), not stored
over the first.

In the request (the provider waits for the answer, a clear 400 naming what failed), bounded: one connection
attempt, ENDPOINT_PROOF_TIMEOUT_S for each of connecting, the SSH banner and the login, the name's lookups bounded
as at registration (core.addresses.NODE_LOOKUP_TIMEOUT_S). Nothing runs on the server: only the SSH handshake and
the login, so no agent, no per-node slot, and no job.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from core.errors import ApplicationError, ValidationFailed
from marketplace.models import Node
from marketplace.services.nodes import (
    node_endpoint_check,
    node_endpoint_needs_proof,
    node_endpoint_set,
    node_private_key,
    node_update,
    node_update_check,
)
from provisioning.services.verification import node_verify_request
from provisioning.ssh import Endpoint, NodeSession, Timeouts
from provisioning.ssh_errors import AddressRefused, AuthFailed, HostKeyMismatch, NodeError, PlatformKeyUnreadable

log = logging.getLogger(__name__)

ENDPOINT_PROOF_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ProvenEndpoint:
    """A new endpoint checked (and proven, for a node that needs it), not yet stored: node_endpoint_set's arguments."""

    address: str
    ssh_port: int
    ssh_user: str
    proven_with: str | None
    was: tuple[str, int, str]  # the endpoint it was checked and proven from: stored only if the node is still there


def node_endpoint_changes(*, node: Node, address: str | None = None, ssh_port: int | None = None,
                          ssh_user: str | None = None) -> bool:
    """Whether the given endpoint (None: as it is) differs from `node`'s stored one."""
    current = Node.objects.get(pk=node.pk)
    return ((current.address if address is None else address, current.ssh_port if ssh_port is None else ssh_port,
             current.ssh_user if ssh_user is None else ssh_user) != (current.address, current.ssh_port,
                                                                       current.ssh_user))


def node_endpoint_prove(*, node: Node, address: str | None = None, ssh_port: int | None = None,
                        ssh_user: str | None = None) -> ProvenEndpoint | None:
    """Check and prove `node`'s new endpoint (see the module), storing nothing; None when it is the stored one.
    Outside any transaction (the SSH handshake takes seconds: no row is locked meanwhile). Its refusals are
    node_endpoint_change's."""
    current = Node.objects.get(pk=node.pk)
    address = current.address if address is None else address
    ssh_port = current.ssh_port if ssh_port is None else ssh_port
    ssh_user = current.ssh_user if ssh_user is None else ssh_user
    was = (current.address, current.ssh_port, current.ssh_user)  # what the new one is checked and proven against
    if (address, ssh_port, ssh_user) == was:
        return None
    current = node_endpoint_check(node=current, address=address, ssh_port=ssh_port, ssh_user=ssh_user)
    proven_with = None
    if node_endpoint_needs_proof(current):
        endpoint_prove(node=current, address=address, ssh_port=ssh_port, ssh_user=ssh_user)
        proven_with = current.host_key_fingerprint
    return ProvenEndpoint(address=address, ssh_port=ssh_port, ssh_user=ssh_user, proven_with=proven_with, was=was)


def node_endpoint_change(*, node: Node, address: str | None = None, ssh_port: int | None = None,
                         ssh_user: str | None = None) -> Node:
    """Move `node` to `address`:`ssh_port` as `ssh_user` (None: as it is), proven first (see the module). Returns the
    node as stored. ValidationFailed (400) naming what failed, nothing stored: the address rule, the server there
    unreachable (`address`), another host key there (`address`), the node's key refused (`ssh_user`). Conflict
    (409): a node that cannot move now (its state, or a check of it under way), or the address and port of another
    live node."""
    return node_change(node=node, endpoint={"address": address, "ssh_port": ssh_port, "ssh_user": ssh_user})


def node_change(*, node: Node, endpoint: dict[str, Any], **fields: Any) -> Node:
    """A provider's change of `node`: a new endpoint (`endpoint`: address, ssh_port, ssh_user; None or absent: as
    it is) and node_update's `fields`, all stored or none (review r55 MEDIUM-1: before, the endpoint was stored,
    its renters told and its event written, then another field refused the request). In this order:
    1. every field is checked, nothing stored (node_update_check): a refusal makes no connection;
    2. the new endpoint is checked and proven, outside any transaction (node_endpoint_prove);
    3. the endpoint and the fields are stored in one transaction (node_endpoint_set re-checks the node under its
       lock, node_update the fields): any refusal there rolls both back, and the renters' notices, sent on commit,
       are never sent. Stored only if the node's endpoint is still the one proven from: another change stored
       meanwhile is a Conflict (409), not overwritten.
    A node never contacted (no proof) gets its first contact at the new endpoint once this commits
    (first_contact_start). Returns the node as stored, read again after that."""
    endpoint = {name: value for name, value in endpoint.items() if value is not None}
    node_update_check(node=node, **fields)
    proven = node_endpoint_prove(node=node, **endpoint) if endpoint else None
    with transaction.atomic():
        if proven is not None:
            node_endpoint_set(node=node, address=proven.address, ssh_port=proven.ssh_port, ssh_user=proven.ssh_user,
                              proven_with=proven.proven_with, was=proven.was)
        stored = node_update(node=node, **fields)
        if proven is not None and proven.proven_with is None:
            node_id, where = node.pk, f"{proven.ssh_user}@{proven.address}:{proven.ssh_port}"
            transaction.on_commit(lambda: first_contact_start(node_id=node_id, where=where), robust=True)
    return stored if proven is None else Node.objects.get(pk=node.pk)


FIRST_CONTACT_REASON = "first contact at the new SSH endpoint {where}, changed by the provider"


def first_contact_start(*, node_id: int, where: str) -> None:
    """Queue the first contact of a never-contacted node whose endpoint its provider changed (after that commit):
    node_verify_request, the Verify button's service, its refusals included. A refusal (the node changed meanwhile:
    retired, a check already open) is logged, not raised: the change is stored, and Verify stays on the page."""
    try:
        node_verify_request(node=Node.objects.get(pk=node_id), reason=FIRST_CONTACT_REASON.format(where=where))
    except (ApplicationError, Node.DoesNotExist) as exc:
        log.info("endpoint change of node %s: its first contact was not queued: %s", node_id, exc)


def endpoint_prove(*, node: Node, address: str, ssh_port: int, ssh_user: str) -> None:
    """Log in at the new endpoint with the node's own key, taking only the node's pinned host key; ValidationFailed
    saying what failed otherwise. Nothing is run there and nothing is recorded: no quarantine for another key."""
    where = f"{address}:{ssh_port}"
    unchanged = f"Nothing was changed: the node stays at {node.ssh_user}@{node.address}:{node.ssh_port}."
    session = NodeSession(
        Endpoint(address=address, port=ssh_port, user=ssh_user, private_key=node_private_key(node=node),
                 host_key_fingerprint=node.host_key_fingerprint),
        Timeouts(connect=ENDPOINT_PROOF_TIMEOUT_S, attempts=1))
    try:
        session.connect()
    except HostKeyMismatch as exc:
        raise ValidationFailed(
            f"The server at {where} presented the SSH host key {exc.seen}, not this node's pinned key "
            f"{exc.expected}: it is not this node's server. {unchanged} Give the address of the server this node "
            "was verified on.", field="address") from None
    except PlatformKeyUnreadable as exc:
        log.error("endpoint change of node %s: %s", node.pk, exc.message)
        raise ValidationFailed(f"The platform could not use this node's key; an operator has been told. {unchanged}",
                               field="address") from None
    except AuthFailed:
        raise ValidationFailed(
            f"The server at {where} presented this node's host key but refused the platform's key for user "
            f"{ssh_user}. Run the node's install command there as {ssh_user}, then try again. {unchanged}",
            field="ssh_user") from None
    except AddressRefused as exc:
        raise ValidationFailed(f"{exc.message} {unchanged}", field="address") from None
    except NodeError as exc:
        # The transport's own words stay in the log: they would tell what listens at any host and port.
        log.info("endpoint change of node %s: %s unreachable: %s", node.pk, where, exc.message)
        raise ValidationFailed(
            f"Could not open an SSH session at {where} within {ENDPOINT_PROOF_TIMEOUT_S:g} s: check the address, "
            f"the SSH port and the firewall (the platform must reach it). {unchanged}", field="address") from None
    finally:
        session.close()
