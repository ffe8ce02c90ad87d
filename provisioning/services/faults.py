"""Whose failure a failed job is (provisioning.models.JobFault): the one rule, used where a failure is decided
(provisioning.tasks, the failure handlers, the reaper) and by whatever counts failures (reliability, spot checks,
verifications, pending retries).

A failure is the node's only when the node did it: it could not be reached, stayed silent, answered garbage or
refused, refused the platform's key, showed another host key. Anything else is not held against it:

- the platform's: every SSH session the platform allows per node taken by its own work (NodeBusy), the agent's
  own lock held by another of its jobs on the node once the retries are spent (`busy` to a VM command:
  vms.AgentBusy; elsewhere `busy` stays the node's), its worker lost, its own exception (a bug, a database
  error), its time running out while it waited on itself, a node key of its own it cannot read, a request its own
  agent called invalid; and any error it cannot place (the benefit of the doubt goes to the provider);
- the renter's: set where the platform knows it (their own image failing to pull, their destroy superseding the
  job), as the error's `fault`;
- the changed host key the node is quarantined for already, met again by a job opened before the quarantine
  (JobFault.HOST_KEY, nodes.HostKeyStillChanged): the node's doing, counted once by the quarantine, not again.
"""
from __future__ import annotations

from types import TracebackType

from provisioning.models import JobFault
from provisioning.ssh_errors import (
    AgentFailed,
    AgentGarbage,
    AgentTimeout,
    AuthFailed,
    HostKeyMismatch,
    NodeError,
    NodeUnreachable,
)


class PlatformError(NodeError):
    """A job failure of the platform's own making (a lost worker, its own exception, its time spent waiting on
    itself): said in words, never counted against the node."""

    code = "platform_error"
    fault = JobFault.PLATFORM


# Errors the platform raises on its own side, by their stable code (provisioning.ssh_errors, concurrency): nothing
# was asked of the node, or the node was not at fault. By code, not class: an error keeps its code wherever it is
# declared. Never read from an AgentFailed, whose code is the node's own word (below).
PLATFORM_CODES = frozenset({"node_busy", "platform_key_unreadable", "platform_error"})
# The node's doing. AddressRefused (a NodeUnreachable) is too: the provider registered the address, or points its
# name at, one the platform does not connect to, and only the provider can change that (were it the platform's, a
# pending node would be retried forever, and a listed node could dodge spot checks by pointing its name inside).
NODE_ERRORS = (NodeUnreachable, AgentTimeout, AgentGarbage, AgentFailed, AuthFailed, HostKeyMismatch)


def error_fault(error: BaseException) -> str:
    """Whose failure `error` is: an error's own `fault` when it declares one (a class, or the instance where the
    failure was decided), else by its kind (above). The platform's agent answering invalid_request says the
    platform's request was wrong (verification.node_at_fault reads it so too)."""
    declared = getattr(error, "fault", "")
    if declared in JobFault.values:
        return declared
    if isinstance(error, AgentFailed):
        return JobFault.PLATFORM if error.code == "invalid_request" else JobFault.NODE
    if getattr(error, "code", None) in PLATFORM_CODES:
        return JobFault.PLATFORM
    if isinstance(error, NODE_ERRORS):
        return JobFault.NODE
    return JobFault.PLATFORM


def counts_against_node(error: BaseException) -> bool:
    return error_fault(error) == JobFault.NODE


# ------------------------------------------------------------------------ a task's time limit: who spent it
#
# Celery's soft time limit raises SoftTimeLimitExceeded wherever the task is when the time runs out. Every step
# that waits for the node has its own bound well inside the task's limit, so the limit is reached by steps adding
# up, and the step it lands in says who was being waited for at the end:
#
# - an exchange with the node (connecting, a command, its answer, the VM's SSH server coming up): the node was
#   answering, too slowly, and used the time up. The node's (as a silent node's: AgentTimeout);
# - one of the platform's own SSH slots for the node (taken by its own work), its database (a lock held by
#   another of its transactions), or its own code: the time ran out on the platform's side. Not the node's.
#
# In doubt (a frame of neither kind, the platform's code between two steps) it is not the node's: a node that
# really is too slow spends nearly all the time in exchanges, so the limit lands in one nearly always.

# Where the platform waits for the node: (module or package, function or None for any).
_WAITING_FOR_NODE = (("provisioning.ssh", None), ("provisioning.ssh_channels", None),
                     ("provisioning.ssh_round_trip", None), ("paramiko", None),
                     ("provisioning.services.vms", "wait_for_ssh"))
ON_DATABASE = "waited on its database"
# Where the platform waits on itself, and how that is said.
_WAITING_ON_PLATFORM = (
    ("provisioning.concurrency", "waited for one of the SSH sessions it allows per node (its own work held them)"),
    ("django.db", ON_DATABASE),
    ("psycopg", ON_DATABASE),
)


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def time_ran_out_on(traceback: TracebackType | None) -> tuple[str, str]:
    """(fault, what the platform was doing) for a time limit raised with `traceback`: the innermost frame that is
    an exchange with the node (JobFault.NODE) or a wait of the platform's own (JobFault.PLATFORM); the platform's
    own work when neither is found."""
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    for frame in reversed(frames):  # innermost first
        module, function = frame.f_globals.get("__name__", ""), frame.f_code.co_name
        if any(_in(module, package) and name in (None, function) for package, name in _WAITING_FOR_NODE):
            return JobFault.NODE, "waited for the node's answer"
        for package, said in _WAITING_ON_PLATFORM:
            if _in(module, package):
                return JobFault.PLATFORM, said
    return JobFault.PLATFORM, "did its own work"


# Said after the error of a failed job that is not the node's (runner.job_finish), to provider and renter alike.
NOT_COUNTED: dict[str, str] = {
    JobFault.PLATFORM: "This was the platform's failure, not the node's: it does not count against the node.",
    JobFault.RENTER: "This was not the node's failure: it does not count against the node.",
    JobFault.HOST_KEY: ("The node's host key change was counted once, by its quarantine: this does not count against "
                        "the node again."),
}
