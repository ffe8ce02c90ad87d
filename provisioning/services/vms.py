"""Driving an instance's VM on its node: create, start, stop, restart, destroy; and reading its logs.

Each function runs on a worker for one job, opens one SSH session for all its steps,
and reports through marketplace's instance services, which own the instance states
and the GPU allocations. Every step is idempotent on the node (the agent's `vm`
commands are), so a retried or redelivered job finishes what an earlier one began,
and a command whose answer was lost is confirmed by the VM's state (_vm_command).
"""
from __future__ import annotations

import ipaddress
import logging
import re
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from core import addresses as core_addresses
from core import dispatch
from core.addresses import Address, address_kind, getaddrinfo_within, node_address_allowed
from core.errors import Conflict, Unavailable
from core.transitions import InvalidTransition
from marketplace.models import (
    GpuAllocation,
    GpuStatus,
    Instance,
    InstanceStatus,
    InterruptionCause,
    MigSliceAllocation,
    Node,
    NodeState,
    SliceStatus,
    Verdict,
)
from marketplace.models.nodes import LISTABLE_VERDICTS
from marketplace.services import instances as instance_svc
from marketplace.services import volumes as volume_svc
from marketplace.services.instances.options import PORTS_MAX
from marketplace.services.instances.worker import (
    QUARANTINE_INTERRUPTION,
    START_ON_QUARANTINED_NODE,
    STOPPED_ON_QUARANTINED_NODE,
)
from marketplace.validators import VM_PORT_NAME, is_port_number, validate_address, validate_ssh_user
from provisioning.concurrency import NodeBusy
from provisioning.models import OPEN, VM_JOB_KINDS, Job, JobFault, JobKind, JobStatus, NodeEvent, VerificationRun
from provisioning.services.faults import error_fault
from provisioning.services.jobs import JOB_DEADLINES, SUPERSEDED
from provisioning.services.nodes import VM_MISSING, disk_limit_not_enforced_noted, node_event, node_session
from provisioning.services.runner import MAX_LOG_LINES, job_finish, job_step
from provisioning.ssh import NodeSession, Timeouts, checked_addresses
from provisioning.ssh_errors import (
    AddressRefused,
    AgentFailed,
    AgentGarbage,
    AgentTimeout,
    AuthFailed,
    HostKeyMismatch,
    NodeError,
    NodeUnreachable,
)
from provisioning.verification.health_answer import HOST_SEES_GPUS

SSH_READY_TIMEOUT_S = 120
# Logs are read while the renter waits (GET .../logs/): one short SSH call, bounded everywhere.
LOGS_TIMEOUTS = Timeouts(connect=5.0, command=15.0, attempts=1)
LOGS_SLOT_WAIT_S = 5.0
log = logging.getLogger(__name__)


def _request(instance: Instance, **extra: Any) -> dict[str, Any]:
    return {"runtime": instance.node.runtime, "vm_id": instance.vm_id, **extra}


def _instance_id(job: Job) -> int:
    """The instance a VM job drives (job_create gives every instance job one)."""
    assert job.instance_id is not None, f"job {job.pk} ({job.kind}) has no instance"
    return job.instance_id


def wait_for_ssh(host: str, port: int, timeout: float = SSH_READY_TIMEOUT_S) -> None:
    """Wait until an SSH server answers on host:port with its banner, as a renter's client would see."""
    deadline = time.monotonic() + timeout
    last, reached = "", False
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=3) as sock:
                reached = True
                sock.settimeout(3)
                if sock.recv(4).startswith(b"SSH-"):
                    return
                last = "no SSH banner"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.5)
    silent = VmSshSilent(f"The VM's SSH server at {host}:{port} did not answer within {timeout:.0f}s ({last}).")
    silent.reached = reached
    raise silent


class VmSshSilent(NodeError):
    """The VM the node made never opened its SSH server to renters: the node's failure (faults.error_fault)."""

    code = "vm_ssh_silent"
    fault = JobFault.NODE
    # Whether a connection to the port was accepted at least once: the way from the platform to it works, and what
    # listens there (or nothing: docker's proxy accepts for the container) never said SSH.
    reached = False


class AgentBusy(AgentFailed):
    """The agent answered `busy` to a VM command: it waited (60 s for its node-wide allocate or volumes lock, 300 s
    for the VM's) for a lock another agent run held, which for the platform's VM jobs is another of its own jobs on
    the node (a create pulling under the VM's lock, a start or create checking the GPUs). The platform's contention,
    not the node's failure: retried as an unreachable node is (transient), and the platform's failure once the
    retries run out. Taken so only where the platform's jobs drive VMs (_vm_command); elsewhere `busy` stays an
    AgentFailed, the node's (faults.error_fault)."""

    transient = True
    fault = JobFault.PLATFORM


# ------------------------------------------------------------------ where renters log in: the node's word, checked
#
# The `vm create`/`vm start` answer says where renters log in (ssh_host, ssh_port, ssh_user) and where the VM's
# ports are mapped (ports[*].host/port). It is the provider's word: the platform shows it to renters as a command
# they paste into their shell (marketplace.selectors.instance_ssh_command) and its worker connects to ssh_host to
# wait for the VM's SSH server. So it is checked before any use, and anything else is AgentGarbage:
#
# - ssh_user is a POSIX user name (the rule for a node's own SSH user);
# - ssh_port and every ports[*].port a TCP port, 1 to 65535;
# - ssh_host and every ports[*].host an IP address or a hostname; null (the agent's answer where the node has no
#   GPUMARKET_PUBLIC_HOST) is the node's own address. A host other than the node's own address must be (resolve
#   to) public unicast addresses, or addresses of the same kind as the node's own: loopback for a node on
#   loopback (simulated nodes, tests), private for a node registered at a private address (a lab or on-premises
#   platform, which reaches that network already), and in any case where the platform connects to nodes at all
#   (core.addresses.node_address_allowed: public, or in NODE_ADDRESS_ALLOWED_NETWORKS). Never link-local
#   (169.254.169.254, a cloud's metadata service), multicast, unspecified or reserved. The node's own address is
#   checked again as every connection to a node is (provisioning.ssh.checked_addresses). The worker then connects
#   to the address it checked, not to the name again (whose next answer could be another address).

_ANSWER = "The node's answer about the VM is unusable"


@dataclass(frozen=True)
class VmAddress:
    """Where renters log in to a VM, checked; `probe` is the address the worker waits on for its SSH server."""

    host: str
    port: int
    user: str
    probe: str
    ports: dict[str, dict[str, Any]] | None = field(default=None)  # the answer's mapped ports, None if it had none


def _shown(value: Any) -> str:
    return repr(value if isinstance(value, int | type(None)) else str(value)[:40])


def _resolve(host: str) -> list[Address]:
    """The IP addresses `host` names (itself for an IP address). OSError (or UnicodeError) when it does not resolve."""
    found: list[Address] = []
    # bounded: a name server may be slow (an IP address is answered at once)
    for *_, sockaddr in getaddrinfo_within(host, None, core_addresses.NODE_LOOKUP_TIMEOUT_S):
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in found:
            found.append(address)
    if not found:
        raise OSError("no address")
    return found


def _same_host(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.rstrip(".").lower() == b.rstrip(".").lower()


class _HostRule:
    """The hosts one node may name for its VMs (see above), each checked once."""

    def __init__(self, node: Node):
        self.node = node
        self._probes: dict[str, str] = {}
        self._node_kinds: set[str] | None = None

    def node_kinds(self) -> set[str]:
        if self._node_kinds is None:
            try:
                self._node_kinds = {address_kind(address) for address in _resolve(self.node.address)}
            except (OSError, UnicodeError, ValueError):
                self._node_kinds = set()
            self._node_kinds &= {"loopback", "private"}
        return self._node_kinds

    def host(self, value: Any, what: str) -> str:
        """The host renters are shown (null: the node's own address), checked; AgentGarbage otherwise."""
        if value is None:
            return self.node.address
        try:
            if not isinstance(value, str) or "%" in value:  # an IPv6 zone (fe80::1%eth0) is the node's own
                raise ValidationError("not an address")
            validate_address(value)
        except ValidationError:
            raise AgentGarbage(f"{_ANSWER}: its {what} {_shown(value)} is neither an IP address nor a hostname "
                               "(null means the node's own address).") from None
        self.probe(value, what)
        return value

    def probe(self, host: str, what: str) -> str:
        """The address the worker may connect to for `host`: the one address `host` resolves to that was checked
        (the node's own address: by the rule of every connection to a node, provisioning.ssh.checked_addresses).
        AgentGarbage for an address the node may not name; AddressRefused for the node's own address where the
        platform does not connect (any more); NodeUnreachable for a name that does not resolve (now)."""
        if host in self._probes:
            return self._probes[host]
        if _same_host(host, self.node.address):
            try:
                probe = str(checked_addresses(self.node.address, 0)[0][1][0])
            except AddressRefused as exc:
                raise AddressRefused(f"Waiting for the VM's {what}, the node's own address: {exc.message}") from None
        else:
            try:
                addresses = _resolve(host)
            except (OSError, UnicodeError, ValueError) as exc:
                raise NodeUnreachable(f"The VM's {what} {host} does not resolve ({exc}). GPUMARKET_PUBLIC_HOST on "
                                      "the node names the address renters reach; unset, the node's own address "
                                      "is used.") from None
            allowed = {"public"} | self.node_kinds()
            for address in addresses:
                kind = address_kind(address)
                # Of its own kind, and where the platform connects to nodes at all (core.addresses): a node in an
                # allowed private network names no other private address.
                if kind not in allowed or not node_address_allowed(address):
                    named = f"{host}, which resolves to {address}," if str(address) != host else str(address)
                    article = "an" if kind[0] in "aeiou" else "a"
                    outside = "" if kind not in allowed else (
                        " (outside the networks the platform connects to: public addresses and those its operator "
                        "allows)")
                    raise AgentGarbage(
                        f"{_ANSWER}: its {what} {named} is {article} {kind} address, which a node at "
                        f"{self.node.address} may not name{outside}. Set GPUMARKET_PUBLIC_HOST on the node to the "
                        "public address renters reach, or leave it unset for the node's own address.")
            probe = str(addresses[0])
        self._probes[host] = probe
        return probe


def _port(value: Any, what: str) -> int:
    if not is_port_number(value):
        raise AgentGarbage(f"{_ANSWER}: its {what} {_shown(value)} is not a port number (1 to 65535).")
    return int(value)


def vm_address(node: Node, answer: dict[str, Any]) -> VmAddress:
    """Where renters log in to the VM, from a `vm create`/`vm start` answer, checked (see above); AgentGarbage
    for an answer the platform may not use, NodeUnreachable for a host name that does not resolve."""
    rule = _HostRule(node)
    user = answer.get("ssh_user")
    try:
        if not isinstance(user, str):
            raise ValidationError("not text")
        validate_ssh_user(user)
    except ValidationError:
        raise AgentGarbage(f"{_ANSWER}: its ssh_user {_shown(user)} is not a POSIX user name (lower-case letters, "
                           "digits, '_' or '-', starting with a letter or '_', at most 32).") from None
    port = _port(answer.get("ssh_port"), "ssh_port")
    host = rule.host(answer.get("ssh_host"), "ssh_host")
    ports = answer.get("ports")
    mapped: dict[str, dict[str, Any]] | None = None
    if ports is not None:
        if not isinstance(ports, dict) or len(ports) > PORTS_MAX:
            raise AgentGarbage(f"{_ANSWER}: its ports are not an object of at most {PORTS_MAX} mapped ports.")
        mapped = {}
        for name, target in ports.items():
            if not (isinstance(name, str) and VM_PORT_NAME.fullmatch(name) and isinstance(target, dict)):
                raise AgentGarbage(f"{_ANSWER}: its ports hold {_shown(name)}, not a mapped port "
                                   "(\"8888/tcp\": {\"host\": ..., \"port\": ...}).")
            mapped[name] = {"host": rule.host(target.get("host"), f"ports[{name}].host"),
                            "port": _port(target.get("port"), f"ports[{name}].port")}
    return VmAddress(host=host, port=port, user=user, probe=rule.probe(host, "ssh_host"), ports=mapped)


# Steps logged just before a command that changes the VM goes to the node. A job whose log has none of them never
# touched the VM, which is as it was before the job: its failure needs nothing confirmed by the node.
_CREATING = "pulling the image and creating the VM"
_STARTING = "starting the VM"
_STOPPING = "stopping the VM (the disk is kept)"
_RESTART_STOPPING = "stopping the VM for a restart"
_TOUCHING = frozenset({_CREATING, _STARTING, _STOPPING, _RESTART_STOPPING, "starting the VM again"})


def _touched_vm(job: Job) -> bool:
    log = Job.objects.filter(pk=job.pk).values_list("log", flat=True).first() or []
    if not isinstance(log, list):  # a stored log of another shape (jsonb keeps any) tells nothing: assume it did
        return True
    # A full log may have lost its first lines: then assume it did.
    return len(log) >= MAX_LOG_LINES or any(isinstance(line, dict) and line.get("message") in _TOUCHING
                                             for line in log)


def _progress(job: Job, instance: Instance, message: str) -> None:
    job_step(job=job, message=message)
    # Only while the instance is where the job acts: "waiting for SSH on the VM" stayed on an instance stopped
    # meanwhile (found by review).
    instance_svc.instance_set_status_message(instance_id=instance.pk, message=message, only_in=_ACTS_IN[job.kind])


# ------------------------------------------------------------------------ only the instance's latest job speaks
#
# An instance's jobs follow one another: each is queued with the state that asks for it, and that state is left
# only by the job (or a destroy). But a job can stay open after its work is done (its worker lost after it marked
# the instance running, before it closed the job), and the dispatcher sends it again once its heartbeat is stale.
# By then the instance may have moved on through later jobs and be in "its" state again because of one of them:
# START and RESTART both act in `starting` (one job of each kind may be open at a time, not one of the two). The
# old job, run again, took that state for its own: it stopped the VM a later START was starting, and when it
# failed marked the instance stopped and freed its GPUs while the START ran the VM on them (found by review). So,
# as the reaper does (maintenance.jobs_reap), a job of which a later job of the same instance exists is superseded:
# it is closed with a note, and touches neither the instance, its GPUs, the VM, nor its node's fault record.



def job_superseded(job: Job) -> bool:
    """Does a later job of the job's instance exist (then that one, not this, speaks for the instance)?"""
    return job.instance_id is not None and Job.objects.filter(instance_id=job.instance_id, id__gt=job.pk).exists()


def _closed_as_superseded(job: Job, error: str = "", fault: str = "") -> bool:
    """Close the job if a later job of its instance exists: True when it did (nothing else to do). Without an
    `error`, as done with a note. A failure stays a failure (operators and the node's record read it; the second
    review round found a node's own failure closed as succeeded): the node's or whoever's `fault` says when only a
    destroy came after (it did not cause it), the platform's when another job took the instance over (the two
    raced: START and RESTART both act in `starting`)."""
    later = set(Job.objects.filter(instance_id=job.instance_id, id__gt=job.pk).values_list("kind", flat=True)) \
        if job.instance_id is not None else set()
    if not later:
        return False
    if not error:
        job_finish(job=job, note=SUPERSEDED)
    else:
        whose = fault if later == {JobKind.INSTANCE_DESTROY} else JobFault.PLATFORM
        job_finish(job=job, error=f"{error.rstrip()} ({SUPERSEDED}.)", fault=whose)
    return True


# ------------------------------------------------------------------------ a VM command whose answer is lost
#
# An answer can be lost on its way back: the connection drops after the node ran the command (the platform then
# reads that the agent "printed nothing", or that the connection broke), or the node answers after the command's
# time ran out. The command may have run to its end, in part, or not at all; the error does not say which. Taken
# as a failure, a start that had started the VM was undone and told "did not go through", a create that had made
# the VM was destroyed and the instance failed, and a stop or destroy that had done its work failed its job and
# kept the GPUs held until the reconciler came by (tests/marketplace/test_renting_lost_answers.py).
#
# Every `vm` command is idempotent on the agent, and the VM's state can be read (`vm status`). So before a command
# is taken as failed, the platform reads the VM's state over a new connection: a VM where the command brings it
# (running after a create or a start, stopped after a stop, gone after a destroy) is the command done, and its
# state is the answer; anywhere else the command is sent once more, and that answer is the command's. Only when
# the node cannot be asked either does the command fail, as a node that cannot be reached: the job's task tries
# again later (each step of a job is idempotent too), and once its tries are spent its failure handler decides.

_ANSWER_LOST = (NodeUnreachable, AgentTimeout, AgentGarbage)  # errors that can come after the node ran the command
# Where each command brings the VM, in the words of `vm status` (None: no such VM on the node any more).
_BRINGS_VM_TO: dict[str, str | None] = {"create": "running", "start": "running", "stop": "stopped", "destroy": None}


# What the agent answers for a card it was given that is not where it was (agent allocation.cards_now).
_CARD_GONE = ("gpu_missing", "gpu_moved")
# Declared here, not imported from fleet (whose reconcile imports this module): the node's health batch, by name.
_HEALTH_NOW = dispatch.task_name("provisioning.tasks.fleet_health_batch")


def _vm_command(job: Job, instance: Instance, session: NodeSession, verb: str,
                request: dict[str, Any]) -> dict[str, Any]:
    """`vm <verb>` with `request` over `session`: the agent's answer or, when it was lost, the VM's state confirmed
    over a new connection (above). A command sent afterwards over a session whose connection dropped fails at once,
    and is confirmed the same way. Raises what the agent answered (AgentFailed; `not_found` for a VM the node does
    not have, but for a destroy, or has only as a record whose container or domain is gone: VM_MISSING; `busy`
    as AgentBusy, retried), and NodeUnreachable (transient) when the node could not be asked again."""
    try:
        try:
            answer = session.agent("vm", verb, request)
        except _ANSWER_LOST as lost:
            answer = _vm_confirmed(job, instance, verb, request, lost)  # may send it again: its refusal counts too
        if verb in ("start", "stop") and answer.get("state") == VM_MISSING:
            # Started or stopped, a VM the node lists as missing is nowhere: taken as ok, its instance was stopped
            # again ("start it again", at every start) and its absent disk billed (found by review).
            raise AgentFailed({"code": "not_found", "message": f"The VM {instance.vm_id} is no longer on the node "
                                                               "(its container or domain was removed there)."})
        return answer
    except AgentFailed as exc:
        if exc.code == "busy" and not isinstance(exc, AgentBusy):
            raise AgentBusy({"code": "busy", "message": f"The node's agent waited for a lock that another run on the "
                                                        f"node held ({exc.message}): the platform's own jobs on the "
                                                        "node contend for it."}) from None
        if exc.code in _CARD_GONE and instance.node.runtime in HOST_SEES_GPUS:  # else its check cannot judge cards
            # The agent saw a card of this node gone (or numbered anew) before the health check did: the node's
            # check now, not at the next beat, marks it lost (gpu_presence), so that no other booking lands on it.
            job_step(job=job, message=f"a GPU is gone or moved ({exc.code}): the node's health check is queued")
            dispatch.enqueue_on_commit(_HEALTH_NOW, [instance.node_id])
        raise


def _vm_confirmed(job: Job, instance: Instance, verb: str, request: dict[str, Any],
                  lost: NodeError) -> dict[str, Any]:
    job_step(job=job, message=f"no answer to vm {verb} ({lost.message[:200]}); reading the VM's state")
    goal = _BRINGS_VM_TO[verb]
    try:
        with node_session(instance.node) as session:
            # A destroy is done only once the record of a missing VM is gone too: sent again for it.
            status = _vm_status(session, instance, missing_is_gone=verb != "destroy")
            if (status.get("state") if status else None) == goal:
                job_step(job=job, message=f"the VM is {goal or 'gone'}: vm {verb} was done")
                return status or {"vm_id": instance.vm_id, "state": "destroyed", "existed": None}
            if status is None and verb in ("start", "stop"):
                raise AgentFailed({"code": "not_found", "message": f"There is no VM {instance.vm_id} on the node."})
            now = str(status.get("state"))[:40] if status else "not there"
            job_step(job=job, message=f"the VM is {now}: vm {verb} again")
            return session.agent("vm", verb, request)
    except _ANSWER_LOST as exc:
        if not exc.transient:  # garbage again (a node that cannot answer), or a refusal of the platform's own
            raise
        # The next try sends the command again, which undoes nothing done already.
        raise NodeUnreachable(f"No answer to vm {verb}: {lost.message} The VM's state could not be read either: "
                              f"{exc.message}") from None


def _vm_status(session: NodeSession, instance: Instance, *, missing_is_gone: bool = True) -> dict[str, Any] | None:
    """The node's `vm status` of the instance's VM; None when it has no such VM, or (`missing_is_gone`) has only
    its record (its container or domain removed on the node: VM_MISSING). AgentGarbage for an answer without a
    state (a text): the node's garbage, as any answer the platform cannot use."""
    try:
        status = session.agent("vm", "status", _request(instance))
    except AgentFailed as exc:
        if exc.code == "not_found":
            return None
        raise
    state = status.get("state")
    if not isinstance(state, str):  # read, said and compared below: {"ok": true} alone was a KeyError (a crash)
        raise AgentGarbage(f"{_ANSWER}: its answer to vm status gives no state ({_shown(state)}, not a word such as "
                           "\"running\").")
    return None if missing_is_gone and state == VM_MISSING else status


# The renter destroyed the instance while a job created, started, restarted or stopped its VM.
_DESTROYED_MEANWHILE = (InstanceStatus.DESTROYING, InstanceStatus.DESTROYED)


def _destroyed_meanwhile(job: Job, instance: Instance) -> bool:
    """After this job drove the VM, is the instance being destroyed? Then the job leaves it so, and it is not a
    failure (which would fail the instance, and its destroy then do nothing). A destroy job waits for this one
    and removes the VM; an instance destroyed at once (its node was away, or its destroy job gave up) had its
    GPUs kept for this VM, which this job removes now, in a session of its own, before they are freed."""
    now = Instance.objects.filter(pk=instance.pk).values_list("status", flat=True).first()
    if now not in _DESTROYED_MEANWHILE:
        return False
    if now == InstanceStatus.DESTROYING:
        job_step(job=job, message="a destroy was asked meanwhile: the VM is left to its job")
        return True
    job_step(job=job, message="the instance was destroyed meanwhile: removing the VM")
    try:
        with node_session(instance.node) as session:
            session.agent("vm", "destroy", _request(instance))
    except NodeError as exc:  # the reconciler removes it when the node answers (its GPUs are still held)
        job_step(job=job, message=f"the VM could not be removed now: {exc.message}")
    else:
        instance_svc.instance_cleanup_done(instance_id=instance.pk)
    return True


def _ssh_answers_on_node(instance: Instance) -> bool | None:
    """Whether the VM's SSH server answers on its node itself (`vm status` with probe_ssh); None when the node
    cannot say (unreachable, a refusal, a runtime that cannot tell)."""
    try:
        with node_session(instance.node) as session:
            status = session.agent("vm", "status", _request(instance, probe_ssh=True))
    except NodeError:
        return None
    answers = status.get("ssh_answers")
    return answers if isinstance(answers, bool) else None


# A second look from the platform, once the node has seen the VM's SSH answer on the node itself.
SSH_LOOK_AGAIN_S = 10


# Where the renter's own doing can silence the VM's SSH server before the platform judges it, the silence is
# judged by the renter's rule (_renters_silence), not taken as the node's:
# - their own image (it may have no sshd at all);
# - a catalogue image given an onstart script: it runs as root right after sshd starts (`pkill sshd`). Before, a
#   catalogue image's silence was always the node's, and any renter took 0.02 of any node's reliability per booking
#   at no cost (found by review);
# - any image after a start or restart: the renter had root on the VM, its disk is theirs (an sshd stopped,
#   disabled or reconfigured there stays so).
# The env and volumes no longer count: the env is no part of the entry wrapper's environment nor the image's command's
# (the node agent's runtimes/dockerbox.py: only onstart and SSH sessions get it; before, PATH=/nowhere left the
# wrapper without ssh-keygen, and BASH_ENV ran code in the image's bash entrypoint), and no volume is mounted over a
# folder sshd needs (marketplace.services.volumes._SYSTEM_MOUNT_ROOTS, refused at booking and by the agent; before,
# one over /etc/ssh hid its configuration). Counted, they put a node's own fault (a catalogue image's sshd silent)
# on any renter who gave an env or a volume, the node not blamed (found by review).
# A catalogue image without an onstart script, at its provision, runs only what the platform chose: its silence is
# the node's, and the node is asked nothing.
_AGAIN = {JobKind.INSTANCE_START: "start", JobKind.INSTANCE_RESTART: "restart"}


def _renter_inputs(instance: Instance) -> list[str]:
    """What the renter gave the VM that runs or takes effect in it before its SSH server is judged (above), each as
    said to them: only the onstart script."""
    return ["your onstart script runs as root right after it starts"] if instance.onstart else []


def _renters_part(job: Job, instance: Instance) -> str | None:
    """Said to the renter when the silence is judged theirs: what of theirs can have silenced the VM's SSH server;
    None when nothing of theirs ran before it was judged (above: then the silence is the node's)."""
    again = _AGAIN.get(JobKind(job.kind))
    if again is not None:
        return (f"The VM's disk is yours: an SSH server stopped, disabled, removed or reconfigured on it stays so "
                f"after a {again}. See the instance's logs.")
    if instance.image is None:
        return ("Your own image must start an SSH server (OpenSSH's sshd installed in the image; the platform starts "
                "it and adds your keys).")
    given = _renter_inputs(instance)
    if not given:
        return None
    return (f"The image's SSH server is started by the platform; {'; '.join(given)}: that can stop it (an onstart "
            "that ends sshd). See the instance's logs.")


def _renters_silence(instance: Instance, answer: dict[str, Any], address: VmAddress, silent: VmSshSilent) -> str:
    """Whose failure is it that a VM the renter could silence (above) never answered SSH: "renter", "node", or
    "late" (a second look found it answering: no failure)? The renter's when the VM never started an SSH server
    (ubuntu:24.04 has none; an onstart ended it), as an image that cannot be pulled: before, any renter could take a
    node's reliability to 0 at no cost (a failed provision is not billed; found by review). The node's when the way
    to the VM is shut (a firewall, a port not published).

    What tells them apart cannot be up to the VM, whose server can answer some clients and not others (found by
    review: the image's own host key file, then a server that answered the node's probe only):
    - the platform reached the port (a connection accepted, no banner): the way works, the silence is the VM's;
    - else the node's own look at the VM's port (`vm status` probe_ssh): no SSH there is the VM's; SSH there is
      the node's unless a second look from here finds it answering (then it was late, not silent);
    - where the node cannot say, a host key read from the VM makes it the node's, as before."""
    if silent.reached:
        return "renter"
    answers = _ssh_answers_on_node(instance)
    if answers is None:
        return "node" if answer.get("ssh_host_key") else "renter"
    if not answers:
        return "renter"
    try:
        wait_for_ssh(address.probe, address.port, timeout=SSH_LOOK_AGAIN_S)
    except VmSshSilent:
        return "node"
    return "late"


def _node_moved_meanwhile(instance: Instance, host: str, vm: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The SSH host and the VM's mapped ports to record, the node's address as it is now: the job read the node at
    its start, and its provider may have moved it since (marketplace.services.nodes.node_endpoint_set), which moves
    only the instances whose stored host is the old address: before, a provision (an image pull: minutes), start or
    restart under way stored the old one for good (review r55). Read under the instance's lock, in the transaction
    that records it: a move that committed first is read here; one under way waits on this lock, then finds the
    old address stored and moves it."""
    Instance.objects.select_for_update().filter(pk=instance.pk).exists()
    old = instance.node.address
    now = Node.objects.filter(pk=instance.node_id).values_list("address", flat=True).first()
    if now is None or now == old:
        return host, vm
    ports = vm.get("ports")
    if isinstance(ports, dict):
        vm = {**vm, "ports": {name: ({**target, "host": now} if isinstance(target, dict) and target.get("host") == old
                                     else target) for name, target in ports.items()}}
    return (now if host == old else host), vm


def _running(job: Job, instance: Instance, answer: dict[str, Any], message: str) -> None:
    address = vm_address(instance.node, answer)
    _progress(job, instance, "waiting for SSH on the VM")
    try:
        wait_for_ssh(address.probe, address.port)
    except VmSshSilent as exc:
        theirs = _renters_part(job, instance)
        whose = "node" if theirs is None else _renters_silence(instance, answer, address, exc)
        if whose == "node":
            raise
        if whose == "renter":
            renters = VmSshSilent(f"{exc.message} {theirs}")
            renters.fault = JobFault.RENTER  # read by faults.error_fault
            raise renters from None
        # "late": it answers now, which is no failure
    vm = answer if address.ports is None else {**answer, "ports": address.ports}
    try:
        with transaction.atomic():
            host, vm = _node_moved_meanwhile(instance, address.host, vm)
            instance_svc.instance_mark_running(instance_id=instance.pk, ssh_host=host, ssh_port=address.port,
                                               ssh_user=address.user, message=message, vm=vm)
    except InvalidTransition:
        if not _destroyed_meanwhile(job, instance):
            raise
    job_finish(job=job)


def create_request(instance: Instance) -> dict[str, Any]:
    """The agent's `vm create` request, from the instance's validated fields only (JSON; nothing is a shell
    string). The env and the registry login, when given, are decrypted here for this request and kept nowhere."""
    image = instance.image
    if image is not None:
        images = {"docker": image.docker_image, "libvirt": image.libvirt_image}
    else:  # the renter's own OCI reference (container runtimes only: booking refuses it on libvirt)
        images = {"docker": instance.image_ref}
    request = _request(
        instance,
        gpu_indices=instance_svc.instance_gpu_indices(instance=instance),
        gpu_uuids=instance_svc.instance_gpu_uuids(instance=instance),  # the cards, wherever nvidia-smi numbers them
        ssh_public_keys=list(instance.ssh_public_keys),
        image=images,
        disk_gb=instance.disk_gb,
    )
    if instance.mig_profile:  # its MIG slices only: the VM sees those devices and no other part of the card
        request["mig_uuids"] = instance_svc.instance_slice_uuids(instance=instance)
    env = instance_svc.instance_env(instance=instance)
    if env:
        request["env"] = env
    if instance.onstart:
        request["onstart"] = instance.onstart
    if image is None:
        # The renter's own image: its command gets the env (a vLLM, TGI or Jupyter image reads MODEL_ID, HF_TOKEN or
        # JUPYTER_TOKEN from it), as its SSH server is theirs (_renters_part). A catalogue image's command runs
        # without it (the agent's entry wrapper, dockerbox.py).
        request["image_env"] = True
    if instance.ports_requested:
        request["ports"] = list(instance.ports_requested)
    volumes = volume_svc.volume_agent_specs(instance=instance)
    if volumes:  # [{"name": "vol-...", "mount": "/data"}]: created on this node before (marketplace.services.volumes)
        request["volumes"] = volumes
    auth = instance_svc.instance_registry_auth(instance=instance)
    if auth is not None:
        request["registry_auth"] = auth
    return request


# The agent's answers to a pull that failed (runtimes/dockerpull.py pull_fault): the registry refused the reference
# (the renter's to fix when the reference is their own), or the node could not pull it (its disk full, its docker
# daemon gone, its network to a public registry: the node's failure, whatever the image; review r54 #1: every
# failed pull of an own image was the renter's). A disk that filled while the image was unpacked is pull_failed:
# a full node and an image far bigger unpacked than downloaded (a decompression bomb) read the same, so it counts
# against the node for a catalogue image only; for a renter's own image it is a node event (review r54 own MEDIUM-1).
PULL_REFUSED, PULL_NODE_FAILED = "pull_failed", "pull_node_failed"
_PULL_NO_SPACE = re.compile(r"no space left on device|disk quota exceeded", re.IGNORECASE)


def _pull_failure(instance: Instance, exc: AgentFailed) -> AgentFailed:
    """The error a failed pull ends the job with, worded for the renter: their image's (its registry refused it)
    or the server's (nothing said against the image)."""
    if exc.code == PULL_REFUSED:  # the registry's own reason, for the renter to act on
        failed = AgentFailed({"code": exc.code, "message": f"The image could not be pulled: {exc.message}"})
        if instance.image is None:  # the renter's own reference: theirs to fix, not the node's failure
            failed.fault = JobFault.RENTER  # type: ignore[attr-defined]  # read by faults.error_fault
            if _PULL_NO_SPACE.search(exc.message):  # the node's disk or the image's size: told, not counted
                node_event(node=instance.node, kind="pull_no_space", level=NodeEvent.Level.WARNING, message=(
                    f"The disk filled while instance {instance.pk}'s own image was pulled: {exc.message}"))
                failed = AgentFailed({"code": exc.code, "message": (
                    f"The image could not be pulled: the server's disk filled while it was unpacked ({exc.message}). "
                    "An image much larger unpacked than its download can do this; if yours is not, booking it on "
                    "another server may work.")})
                failed.fault = JobFault.RENTER  # type: ignore[attr-defined]
        return failed
    # The node's failure (faults.error_fault: an AgentFailed without a declared fault counts against the node).
    return AgentFailed({"code": exc.code, "message": (
        f"The server could not download the image: {exc.message} This is the server's failure, not a fault of the "
        "image; booking it on another server may work.")})


# ------------------------------------------------------------------------ a check testing the node's free cards
#
# A spot check (services.spot_checks) runs the platform's challenge and memory proof (>= 95 % of each card's memory)
# on the cards, whole GPUs and MIG slices, that were free when it read them, without allocating them: the node stays
# bookable. So does a re-verification of an active node (services.verification: the benchmark, the challenge and
# the memory proof on its free cards, for minutes). A booking (or a start, which takes GPUs again) committed after
# that read rents a card under test, so the job that would create or start its VM there waits until the check ends
# (review r54 #4): the booking is accepted at once, nothing is billed until the VM runs (instance_mark_running),
# and the renter is told why. A node that is not active (verifying for the first time, or back from maintenance or
# offline) takes no booking and no start (lifecycle: an offerable node is active; a start's node must be), and
# turns active only as its verification closes (node_verify_conclude, one transaction with its job_finish).
#
# Why no booking slips between the two reads: the check's job is marked running (runner.job_begin commits) before
# it reads the free cards (spot_checks.free_cards_now, free_slices_now; verification's gpu_holders_by_uuid,
# held_cards, rented_slice_uuids, read after the inventory: each one statement, which sees what had committed when
# it began). A booking that committed before that read rented the card: the check sees it rented and leaves it
# alone. One that committed after it queued this job in the same transaction as its allocation, so this job's read
# below comes after that commit, after the check's job was marked running: it sees that job open (or closed, the
# testing over). The reverse, a VM job already under way when a check starts, holds its cards since its booking or
# start committed: the check does not test them.
#
# A check is waited for while it runs and its worker beats (_CHECK_BEATING: running, its heartbeat younger than
# JOB_HEARTBEAT_STALE_S). Its execution's heartbeat thread (runner.JobHeartbeat) renews it every
# JOB_HEARTBEAT_INTERVAL_S whatever step it is in, the benchmark's and the memory proof's minutes over SSH included,
# and one waiting for its retry has it dated when the retry is due (runner.job_release); job_begin dates it in the
# commit that marks it running, before it reads the free cards. So a check that started late works past its
# deadline and is still waited for, and one whose worker was lost holds bookings only until its heartbeat is stale,
# before its deadline too (the reaper's rule, jobs.job_alive, spares it until its deadline: not this one's).
#
# What the check found is read once the wait ends (_failed_while_waiting): a booking or start committed after it read
# the free cards had its card tested, and the check's verdict may reject the node or a card may be lost meanwhile. A
# rejected node stays active for its renters, the waiting instance counted among them (verification.
# node_verify_conclude), so nothing else stops the VM from being made there, perhaps on the card that failed. Only a
# job that waited is failed so: a start on a node rejected before it was asked is the renter's to make (lifecycle
# refuses none for the verdict), and without a wait nothing was tested on its cards. And no wait is endless: a check
# that runs on (retries after retries) fails the waiting job after NODE_CHECK_WAIT_MAX_S from its creation rather
# than create the VM on a card it may be testing.

# What the renter is told while their VM job waits, by the kind of check; the first words also name it in the step.
CHECK_WAITS: dict[str, tuple[str, str]] = {
    JobKind.NODE_SPOT_CHECK: (
        "the server's spot check",
        "Waiting for the server's spot check (the platform's check of its idle GPUs) to end, about a minute"),
    JobKind.NODE_VERIFY: (
        "the server's re-check of its GPUs",
        "Waiting for the server's re-check of its GPUs (the platform's benchmark and checks of its idle GPUs) to "
        "end, a few minutes"),
}
SPOT_CHECK_WAIT = CHECK_WAITS[JobKind.NODE_SPOT_CHECK][1]
# The longest a VM job waits for its node's checks, from its creation: twice a verification's allowance, more than
# one whole execution of either kind of check (the task's time limit, 900 s) takes.
NODE_CHECK_WAIT_MAX_S = 2 * JOB_DEADLINES[JobKind.NODE_VERIFY]
_WAITED = frozenset(f"{told}." for _, told in CHECK_WAITS.values())
# What the renter is told when a job that waited is failed (vm_failed's renter_message), and the job's error.
CHECK_FAILED_TOLD: dict[str, str] = {
    JobKind.INSTANCE_PROVISION: "The server failed its check while your VM waited to be created ({why}); nothing "
                                "was charged. Book another offer.",
    JobKind.INSTANCE_START: "The start did not go through: the server failed its check while your VM waited to "
                            "start ({why}); nothing was charged for it. It is stopped, its disk kept; start it "
                            "again, or move your work to another server.",
}
CHECK_TOO_LONG_TOLD: dict[str, str] = {
    JobKind.INSTANCE_PROVISION: "The server's check of its GPUs went on too long while your VM waited to be "
                                "created; nothing was charged. Book another offer, or try this one again later.",
    JobKind.INSTANCE_START: "The start did not go through: the server's check of its GPUs went on too long while "
                            "your VM waited to start; nothing was charged for it. It is stopped, its disk kept; "
                            "start it again later.",
}


def _check_beating(now: datetime) -> Q:
    fresh = now - timedelta(seconds=settings.JOB_HEARTBEAT_STALE_S)
    return Q(status=JobStatus.RUNNING, heartbeat_at__gte=fresh)


def _node_check_under_way(job: Job, instance: Instance) -> bool:
    """Raise NodeBusy (the task tries again in NODE_BUSY_RETRY_S, uncounted) while a spot check or a verification
    of the instance's node runs with its worker beating (_check_beating). The job's own deadline is moved to its
    whole allowance after the check's deadline, or after now where that passed (a destroy waiting for a VM job
    moves its own too: vm_destroy), up to NODE_CHECK_WAIT_MAX_S after its creation: the wait is nobody's failure
    and leaves the job its time for its work. Any such check is waited for, whether or not it tests this
    instance's cards (which cannot be told before it read them): a spot check lasts about a minute, once a day or
    so per node; a re-verification a few minutes, rarer.

    False when the job was failed here (vm_failed, nothing billed, its GPUs freed): it waited NODE_CHECK_WAIT_MAX_S
    and the check still runs, or it waited and the check's outcome leaves the VM nowhere to go (_failed_while_waiting).
    True: the job goes on."""
    now = timezone.now()
    check = (Job.objects.filter(_check_beating(now), node_id=instance.node_id, kind__in=tuple(CHECK_WAITS))
             .only("pk", "kind", "deadline").first())
    if check is None:
        why = _failed_while_waiting(job, instance) if _waited(job) else ""
        if why:
            vm_failed(job=job, error=f"The node failed its check while this job waited ({why}): the VM was not "
                                     f"{'created' if job.kind == JobKind.INSTANCE_PROVISION else 'started'}.",
                      fault=JobFault.NODE, renter_message=CHECK_FAILED_TOLD[job.kind].format(why=why))
            return False
        return True
    what, told = CHECK_WAITS[check.kind]
    given_up = job.created_at + timedelta(seconds=NODE_CHECK_WAIT_MAX_S)
    if now >= given_up:
        vm_failed(job=job, error=f"This job waited {NODE_CHECK_WAIT_MAX_S} s for {what} (job {check.pk}), which "
                                 "still runs: it was given up.",
                  fault=JobFault.PLATFORM, renter_message=CHECK_TOO_LONG_TOLD[job.kind])
        return False
    wait_until = min(max(check.deadline, now), given_up) + timedelta(seconds=JOB_DEADLINES[job.kind])
    if wait_until > job.deadline:
        Job.objects.filter(pk=job.pk).update(deadline=wait_until)
        job.deadline = wait_until
    _progress(job, instance, f"{told}.")
    until = (f"its deadline {check.deadline:%H:%M:%S} UTC" if check.deadline > now else
             f"past its deadline ({check.deadline:%H:%M:%S} UTC), its worker still at work")
    raise NodeBusy(f"{what} (job {check.pk}) runs, {until}; "
                   f"the VM {'is created' if job.kind == JobKind.INSTANCE_PROVISION else 'starts'} once it ends.")


def _waited(job: Job) -> bool:
    """Did the job wait for a check of its node (its log says so: _progress's line at each wait)? A full log keeps
    its latest lines, the wait's when it just ended."""
    log = Job.objects.filter(pk=job.pk).values_list("log", flat=True).first() or []
    return isinstance(log, list) and any(isinstance(line, dict) and line.get("message") in _WAITED for line in log)


def _failed_while_waiting(job: Job, instance: Instance) -> str:
    """Why the VM must not be made after the job waited for a check ('' when it may): a verification concluded
    since the job was queued and the node's verdict is not listable now (the offers' rule, OFFERABLE: a booking
    would be refused), or a GPU or MIG slice the instance holds was lost (fallen off the bus) or is out of service."""
    verdict = Node.objects.filter(pk=instance.node_id).values_list("verdict", flat=True).first()
    if verdict not in LISTABLE_VERDICTS and VerificationRun.objects.filter(
            node_id=instance.node_id, created_at__gte=job.created_at).exists():
        return "the check rejected it" if verdict == Verdict.REJECTED else f"its verdict is {verdict}"
    gpus = set(GpuAllocation.objects.filter(instance_id=instance.pk, released_at__isnull=True)
               .filter(Q(gpu__lost_at__isnull=False) | Q(gpu__status=GpuStatus.UNAVAILABLE))
               .values_list("gpu__index", flat=True))
    gpus |= set(MigSliceAllocation.objects.filter(instance_id=instance.pk, released_at__isnull=True)
                .filter(Q(mig_slice__status=SliceStatus.UNAVAILABLE) | Q(mig_slice__gpu__lost_at__isnull=False)
                        | Q(mig_slice__gpu__status=GpuStatus.UNAVAILABLE))
                .values_list("mig_slice__gpu__index", flat=True))
    if gpus:
        cards = ", ".join(map(str, sorted(gpus)))
        return f"GPU{'s' if len(gpus) > 1 else ''} {cards} booked for it, lost or out of service"
    return ""


def vm_provision(*, job: Job) -> None:
    if _closed_as_superseded(job):
        return
    instance = instance_svc.instance_mark_provisioning(instance_id=_instance_id(job))
    if instance is None:
        job_finish(job=job, note="the instance is no longer waiting to be provisioned; nothing to do")
        return
    if not _node_check_under_way(job, instance):
        return
    _progress(job, instance, f"connecting to node {instance.node_id}")
    with node_session(instance.node) as session:
        _progress(job, instance, _CREATING)
        try:
            answer = _vm_command(job, instance, session, "create", create_request(instance))
        except AgentFailed as exc:
            if exc.code not in (PULL_REFUSED, PULL_NODE_FAILED):
                raise
            raise _pull_failure(instance, exc) from None
    if answer.get("disk_limit") == "not_enforced":  # the node's word: operators see it (once per node)
        disk_limit_not_enforced_noted(node=instance.node, what=f"Instance {instance.pk}'s disk ({instance.disk_gb} GB)")
    _running(job, instance, answer, "Running")


def _instance_in(job: Job, status: str, doing: str) -> Instance | None:
    """The job's instance if it is still `status` and the job still speaks for it; otherwise close the job as
    having nothing to do (superseded by a later job of the instance, the renter's destroy among them, or done by
    an earlier delivery whose worker died before closing it: no failure)."""
    if _closed_as_superseded(job):
        return None
    instance = Instance.objects.select_related("node").get(pk=_instance_id(job))
    if instance.status != status:
        job_finish(job=job, note=f"the instance is {instance.status}, not {doing}; nothing to do")
        return None
    return instance


def _start(job: Job, session: NodeSession, instance: Instance) -> dict[str, Any]:
    # The GPUs it holds now: after a stop they may differ from the ones the VM had before. With their UUIDs, the
    # agent refuses to start the VM on another card at one of those indices (one fallen off the bus renumbers them).
    return _vm_command(job, instance, session, "start", _request(
        instance, gpu_indices=instance_svc.instance_gpu_indices(instance=instance),
        gpu_uuids=instance_svc.instance_gpu_uuids(instance=instance)))


def vm_start(*, job: Job) -> None:
    if (instance := _instance_in(job, InstanceStatus.STARTING, "starting")) is None:
        return
    if not _node_check_under_way(job, instance):  # a start takes GPUs again (lifecycle.instance_start): free ones
        return
    with node_session(instance.node) as session:
        _progress(job, instance, _STARTING)
        answer = _start(job, session, instance)
    _running(job, instance, answer, "Running")


def vm_restart(*, job: Job) -> None:
    if (instance := _instance_in(job, InstanceStatus.STARTING, "restarting")) is None:
        return
    with node_session(instance.node) as session:
        _progress(job, instance, _RESTART_STOPPING)
        _vm_command(job, instance, session, "stop", _request(instance))
        _progress(job, instance, "starting the VM again")
        answer = _start(job, session, instance)
    _running(job, instance, answer, "Running (restarted)")


def vm_stop(*, job: Job) -> None:
    if (instance := _instance_in(job, InstanceStatus.STOPPING, "stopping")) is None:
        return
    with node_session(instance.node) as session:
        _progress(job, instance, _STOPPING)
        _vm_command(job, instance, session, "stop", _request(instance))
    try:
        instance_svc.instance_mark_stopped(instance_id=instance.pk, message="Stopped; the disk is kept.")
    except InvalidTransition:
        if not _destroyed_meanwhile(job, instance):
            raise
    job_finish(job=job)


def vm_destroy(*, job: Job) -> None:
    if (instance := _instance_in(job, InstanceStatus.DESTROYING, "destroying")) is None:
        return
    # A job still creating or starting the VM would make it after this destroy found none, on GPUs this freed.
    other = Job.objects.filter(OPEN, instance_id=instance.pk, kind__in=VM_JOB_KINDS).exclude(pk=job.pk).first()
    if other is not None:
        # It waits as long as that job may run (a provision's deadline is longer than a destroy's): the node is
        # not at fault for the wait, and its end is not "the server could not be reached".
        wait_until = other.deadline + timedelta(seconds=60)
        if wait_until > job.deadline:
            Job.objects.filter(pk=job.pk).update(deadline=wait_until)
            job.deadline = wait_until
        raise NodeBusy(f"job {other.pk} ({other.get_kind_display().lower()}) is still under way; the destroy "
                       "follows it.")
    with node_session(instance.node) as session:
        _progress(job, instance, "destroying the VM and its disk")
        _vm_command(job, instance, session, "destroy", _request(instance))
    instance_svc.instance_mark_destroyed(instance_id=instance.pk)
    job_finish(job=job)


def vm_destroy_failed(*, job: Job, error: NodeError) -> None:
    """A destroy that could not reach the node: the renter's side ends all the same (nothing is billed after
    the request); the instance keeps its GPUs until the reconciler removes the VM when the node answers. One
    superseded by a later job of the instance (a destroy asked again) is closed with a note: that one speaks."""
    fault = error_fault(error)
    if _closed_as_superseded(job, error.message, fault):
        return
    instance = Instance.objects.get(pk=_instance_id(job))
    if instance.status != InstanceStatus.DESTROYING:  # it moved on meanwhile (e.g. an operator's action)
        job_finish(job=job, error=error.message, fault=fault)
        return
    instance_svc.instance_mark_destroyed(instance_id=instance.pk, cleanup_pending=True)
    job_finish(job=job, error=f"{error.message} The instance was destroyed for its renter; the VM is removed when "
                          "the node answers again.", fault=fault)


# What each instance job waits on (the instance states it acts in), and what it brings about.
WAITING_ON: dict[str, tuple[str, ...]] = {
    JobKind.INSTANCE_PROVISION: (InstanceStatus.REQUESTED, InstanceStatus.PROVISIONING),
    JobKind.INSTANCE_START: (InstanceStatus.STARTING,),
    JobKind.INSTANCE_RESTART: (InstanceStatus.STARTING,),
    JobKind.INSTANCE_STOP: (InstanceStatus.STOPPING,),
}
BRINGS_ABOUT: dict[str, str] = {
    JobKind.INSTANCE_PROVISION: InstanceStatus.RUNNING, JobKind.INSTANCE_START: InstanceStatus.RUNNING,
    JobKind.INSTANCE_RESTART: InstanceStatus.RUNNING, JobKind.INSTANCE_STOP: InstanceStatus.STOPPED,
}
# Where each instance job acts (its progress is shown to the renter only there).
_ACTS_IN: dict[str, tuple[str, ...]] = {**WAITING_ON, JobKind.INSTANCE_DESTROY: (InstanceStatus.DESTROYING,)}


# What the node said of the VM that a job giving up asked it to stop or destroy (_vm_settled).
_SETTLED, _GONE, _UNKNOWN = "settled", "gone", "unknown"
_VM_GONE = ("Its VM and disk are no longer on the server (removed there, or lost by it), so it cannot run again; "
           "nothing more is billed for it. Destroy it, and rent another instance to carry on.")


# What the renter is told of a failed VM job (review r55 MEDIUM-1). The error itself (Job.error: the provider's node
# page, node events, the admin) is worded for the node's provider and the operators: the node's SSH login and address,
# "run the node's install command", "retire this node". Its renter gets a sentence of their own, chosen by the
# error's kind and whose failure it is, in the instance's status message (the web page, the API, the Vast-compatible
# API and the renter's notifications all read that). An error of the renter's own (their image refused by its
# registry, their VM's SSH server silenced by what they gave) is worded for them already and is told as it is.
_TOLD_UNREACHABLE = "Its server could not be reached."
_TOLD_NODE = "Its server could not carry it out."
_TOLD_PLATFORM = "The platform could not carry it out (a failure of its own; its operators have been told)."
_TOLD_HOST_KEY = ("Its server's SSH host key changed, so the platform no longer connects to it until its provider "
                  "sorts it out.")
_TOLD_BY_KIND: tuple[tuple[type[NodeError], str], ...] = (
    (VmSshSilent, "The VM its server made never answered SSH."),
    (NodeUnreachable, _TOLD_UNREACHABLE),  # AddressRefused too
    (AgentTimeout, "Its server did not answer in time."),
    (AuthFailed, _TOLD_UNREACHABLE),
    (HostKeyMismatch, _TOLD_UNREACHABLE),
)
_TOLD_PULL_NODE_FAILED = ("Its server could not download the image (the server's failure, not a fault of the image); "
                          "booking it on another server may work.")
# The agent's refusals about the instance's own cards: what the renter needs to know (a card of theirs is gone),
# in the platform's words (the agent's text is the node's).
_TOLD_BY_CODE = {
    "gpu_missing": "A GPU it was given is no longer on its server (fallen off the bus?).",
    "gpu_moved": "Its server numbered its GPUs anew, so the cards it was given could not be told apart.",
}


def renter_reason(error: NodeError | str, fault: str) -> str:
    """The reason a VM job failed, said to the instance's renter (above): never the node's own words, but for an
    error of the renter's own and the registry's refusal of an image."""
    message = error.message if isinstance(error, NodeError) else error
    if fault == JobFault.RENTER:
        return message
    if isinstance(error, AgentFailed) and error.code == PULL_REFUSED:  # _pull_failure: the registry's reason
        return message
    if fault == JobFault.HOST_KEY:  # the node's doing, counted once by its quarantine: not the platform's failure
        return _TOLD_HOST_KEY
    if fault != JobFault.NODE:
        return _TOLD_PLATFORM
    if isinstance(error, AgentFailed) and error.code == PULL_NODE_FAILED:
        return _TOLD_PULL_NODE_FAILED
    if isinstance(error, AgentFailed) and error.code in _TOLD_BY_CODE:
        return _TOLD_BY_CODE[error.code]
    if isinstance(error, NodeError):
        for kind, told in _TOLD_BY_KIND:
            if isinstance(error, kind):
                return told
    return _TOLD_NODE


def _vm_settled(job: Job, instance: Instance, verb: str) -> str:
    """Ask the node to stop or destroy the VM, confirmed as every VM command is when its answer is lost: _SETTLED
    (nothing runs on the GPUs any more), _GONE (the node has no such VM: nothing runs, and no disk is left to
    keep; the node's record of it, if it kept one, is removed later by the reconciler), or _UNKNOWN (the node did not
    say)."""
    try:
        with node_session(instance.node) as session:
            try:
                _vm_command(job, instance, session, verb, _request(instance))
            except AgentFailed as exc:
                if exc.code != "not_found":
                    raise
                # The node's record of it is left: the reconciler removes it once the instance has been failed a
                # while (_forget_missing), not at once, as an engine outage may list a VM missing that comes back.
                return _GONE
    except NodeError:  # AgentFailed included
        return _UNKNOWN
    return _SETTLED


def vm_forget_missing(*, session: NodeSession, instance: Instance) -> bool:
    """Have the node remove its record of the instance's VM if, and only if, its container or domain is gone
    (`vm destroy` with only_if_missing: the agent decides under the VM's lock, and leaves a VM its engine still
    has). For an instance failed because its VM is gone: the record counted as mounting its volumes on the node, so
    the renter's volume delete was refused (volume_in_use, the volume billed again) until the instance was
    destroyed (found by review). Sent by the reconciler only for an instance failed a while ago (an engine outage
    must have time to end first). True when a record was removed; False when there was none, the VM is there, or the
    node did not answer (the reconciler asks again at its next pass)."""
    try:
        answer = session.agent("vm", "destroy", _request(instance, only_if_missing=True))
    except NodeError as exc:
        log.info("node %s kept its record of VM %s: %s", instance.node_id, instance.vm_id, exc)
        return False
    return answer.get("existed") is True


def vm_failed(*, job: Job, error: NodeError | str, fault: str, reach_node: bool = True,
              renter_message: str = "") -> None:
    """A provision, start, restart or stop job gave up (retries spent, deadline, lost worker, crash); `fault`:
    whose failure `error` is (faults.error_fault). The error, worded for the node's provider and the operators, is
    the job's (Job.error); the instance's renter is told `renter_reason` (never the node's login, address or the
    provider's fix); `renter_message`, where given, is the instance's whole status message instead (a provision
    failed or a start stopped by its wait for a node check: _node_check_under_way).

    A job superseded by a later job of its instance (job_superseded) is closed with a note: the instance, its
    GPUs and the VM are that job's, even in a state this one waits on too (START and RESTART both act in
    `starting`), and the node's record counts no failure of a job whose outcome no longer mattered.
    An instance no longer waiting on the job is left as it is: a destroy asked meanwhile stands, and one already
    where the job was to bring it (the error came after the work: a time limit, a lost worker) closes the job
    as done. Otherwise, by kind:

    - provision: failed (nothing is billed);
    - start: stopped again, its disk kept (the renter may start it again; on a node quarantined meanwhile, once the
      key is accepted: START_ON_QUARANTINED_NODE, as a restart that stopped its VM there);
    - stop and restart: running as before when the job never sent its command to the node; else stopped;
    - start, restart and stop of a VM the node no longer has: failed (its disk went with it: stopped, it was
      billed for a disk that was not there until the reconciler's pass, and offered a start that could not work).

    GPUs are freed only where no VM can use them: the job never touched the VM, or the node confirmed it
    stopped or destroyed (asked here unless `reach_node` is False: the reaper). Otherwise the instance keeps
    them (vm_cleanup_pending) until the node confirms it (instance_cleanup_done), so that no GPU its VM may
    still use is given to the next renter.
    """
    told = renter_reason(error, fault)
    error = error.message if isinstance(error, NodeError) else error
    if _closed_as_superseded(job, error, fault):
        return
    instance = Instance.objects.select_related("node").get(pk=_instance_id(job))
    kind = JobKind(job.kind)
    waiting_on = WAITING_ON[kind]
    if instance.status == BRINGS_ABOUT[kind]:
        job_finish(job=job, note=f"the instance is {instance.status} already ({error})")
        return
    if instance.status not in waiting_on:
        if instance.status in _DESTROYED_MEANWHILE:
            # Its destroy job follows this one and removes the VM; destroyed at once, the reconciler does (the
            # instance keeps its GPUs until then).
            later = ("its destroy job removes the VM" if instance.status == InstanceStatus.DESTROYING
                     else "the reconciler removes the VM")
            job_finish(job=job, error=f"{error} The instance was being destroyed meanwhile: {later}.", fault=fault)
        else:
            job_finish(job=job, error=error, fault=fault)
        return
    touched = _touched_vm(job)
    if not touched and kind in (JobKind.INSTANCE_STOP, JobKind.INSTANCE_RESTART):
        if instance.node.state == NodeState.QUARANTINED:
            _unreached_on_quarantined_node(instance, kind, waiting_on)
            job_finish(job=job, error=error, fault=fault)
            return
        what = "stop" if kind == JobKind.INSTANCE_STOP else "restart"
        instance_svc.instance_mark_running_again(
            instance_id=instance.pk, only_in=waiting_on,
            message=f"The {what} did not reach the server: {told} It is still running (and billed); "
                    f"{what} it again.")
        job_finish(job=job, error=error, fault=fault)
        return
    provision = kind == JobKind.INSTANCE_PROVISION
    quarantined = instance.node.state == NodeState.QUARANTINED
    if not touched:
        outcome = _SETTLED
    elif reach_node and not quarantined:  # no session reaches a quarantined node: it would meet the key again
        outcome = _vm_settled(job, instance, "destroy" if provision else "stop")
    else:
        outcome = _UNKNOWN
    settled = outcome != _UNKNOWN
    if provision:
        # Settled, the node destroyed its VM (record and all) or none was made: nothing of it is left there.
        # It never ran: nothing of it was billed (GPU time is metered from running on; a disk only while stopped).
        instance_svc.instance_mark_failed(instance_id=instance.pk,
                                          message=renter_message or f"{told} It never ran: nothing was billed.",
                                          only_in=waiting_on,
                                          cleanup_pending=not settled, vm_gone=settled)
    elif outcome == _GONE:
        # Not marked vm_gone here: the node may keep its record of the VM (missing), which counts as mounting its
        # volumes there; the reconciler marks it once the node no longer lists it, or has forgotten that record.
        instance_svc.instance_mark_failed(instance_id=instance.pk, message=_VM_GONE, only_in=waiting_on)
    else:
        failed_verb = {JobKind.INSTANCE_START: "The start", JobKind.INSTANCE_RESTART: "The restart"}.get(kind)
        message = renter_message or (
            f"{failed_verb} did not go through: {told} It is stopped, its disk kept; start it again."
            if failed_verb else "Stopped; the disk is kept.")
        if failed_verb and quarantined:
            # A start there is refused until the key is accepted: not "start it again" (found in r47).
            message = START_ON_QUARANTINED_NODE.format(verb=failed_verb)
        if not settled:
            message += " (Its server did not confirm it yet: it is stopped there when it answers again.)"
        instance_svc.instance_mark_stopped(instance_id=instance.pk, message=message, cleanup_pending=not settled,
                                           only_in=waiting_on)
    job_finish(job=job, error=error, fault=fault)


def _unreached_on_quarantined_node(instance: Instance, kind: JobKind, waiting_on: tuple[str, ...]) -> None:
    """A stop or restart that never reached the VM, whose node is quarantined now (its SSH host key changed: the
    job, opened before, met the new key). Not running again, "stop it again": on a node no check and no job talks
    to until an operator accepts the key, the renter could not stop it, was told it was billed, and it escaped the
    interruption node_quarantine gave the node's running instances (found in r47: reproduced with a sim server
    whose key changed between the renter's stop and its job). It ends as the renter's verbs there end
    (marketplace.services.instances.lifecycle): a stop is stopped, its GPUs held until the node's reconcile,
    after the key is accepted, finds the VM stopped or stops it; a restart is interrupted as the node's running
    instances were (billed up to its last healthy moment; resumed or started again by that reconcile)."""
    if kind == JobKind.INSTANCE_STOP:
        instance_svc.instance_mark_stopped(instance_id=instance.pk, message=STOPPED_ON_QUARANTINED_NODE,
                                           cleanup_pending=True, only_in=waiting_on)
        return
    with transaction.atomic():
        instance_svc.instance_mark_running_again(instance_id=instance.pk, only_in=waiting_on,
                                                 message="The restart did not reach the server.")
        instance_svc.instance_interrupt(instance_id=instance.pk, since=instance.node.last_seen_at,
                                        cause=InterruptionCause.NODE_LOST, detail=QUARANTINE_INTERRUPTION)


def vm_logs(*, instance: Instance, tail: int) -> list[str]:
    """The last `tail` lines of the VM's log (pull, boot and onstart output), read from the node now.

    A short synchronous SSH call (LOGS_TIMEOUTS), not a job: a read changes nothing, so there is nothing to
    retry or resume, and the renter is waiting for the answer. Raises Conflict (409) when the instance has no
    VM to read, Unavailable (503) when its node does not answer in time or is busy.
    """
    if instance.status in (InstanceStatus.REQUESTED, InstanceStatus.DESTROYED):
        raise Conflict("The instance has no VM to read logs from "
                       f"({'not created yet' if instance.status == InstanceStatus.REQUESTED else 'destroyed'}).")
    try:
        with node_session(instance.node, LOGS_TIMEOUTS, slot_wait_s=LOGS_SLOT_WAIT_S) as session:
            answer = session.agent("vm", "logs", {"runtime": instance.node.runtime, "vm_id": instance.vm_id,
                                                  "tail": tail}, timeout=LOGS_TIMEOUTS.command)
    except AgentFailed as exc:
        if exc.code == "not_found":
            raise Conflict("The instance's VM is not on its node (any more): there is no log to read.") from None
        raise Unavailable(f"The node could not read the logs: {exc.message}") from None
    except NodeError as exc:
        raise Unavailable(f"The instance's node did not answer: {exc.message} Try again in a moment.") from None
    lines = answer.get("lines")
    if not isinstance(lines, list):
        raise Unavailable("The node's answer had no log lines.")
    return [line if isinstance(line, str) else str(line) for line in lines][-tail:]
