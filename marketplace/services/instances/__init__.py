"""Renting: book GPUs as an instance, and every move of an instance through its lifecycle.

All instance rules live here. Two kinds of callers:

- the API (renters) and the admin (operators): `instance_create` and the verbs `instance_stop`,
  `instance_start`, `instance_restart`, `instance_destroy`. They move the instance into an
  "*ing" state and queue a job (provisioning.services.jobs.job_create, sent to Celery on commit);
- the provisioning tasks (workers): the `instance_mark_*` functions, which record what the node
  did. Each runs in its own short transaction, locks the instance row, and is idempotent.

GPU allocation: one transaction locks the node row FOR SHARE (so a provider's change of the node,
which takes FOR NO KEY UPDATE, waits for bookings in flight, while bookings on the same node run side by
side) and the free GPUs it takes with FOR UPDATE SKIP LOCKED (concurrent bookings never wait for
each other's GPUs, and never take the same one). The partial unique constraint
`gpu_in_at_most_one_live_allocation` makes a double allocation impossible even if this code had
a bug. Duplicate requests with one Idempotency-Key are decided by the unique constraint
`instance_unique_idempotency_key`, never by "check, then insert".

A node's row is locked for a change FOR NO KEY UPDATE, never FOR UPDATE (nothing changes its id): FOR UPDATE
also blocks every insert of a row that names the node (a job, an event, an instance, a volume), whose foreign key
takes FOR KEY SHARE on it. A transaction holding another lock and then inserting such a row deadlocked with the
node's holder wanting that lock next: enforcement at zero balance (the renter's billing profile, then a stop job)
against a verification raising that renter's price back (the node, then the profile).

Money (billing.services): booking and starting need one hour of the renter's whole burn rate with the
new instance (every instance of theirs running or about to: COMMITTED_STATUSES) in their balance, checked
under the wallet's row lock (InsufficientFunds, 402; `funds_for` gives the figures to pages); a booking
snapshots the price and the platform fee; and wherever an instance leaves `running` (stop, restart,
destroy, failure) its last usage interval is charged in the same transaction that changes its state
(`_leave_running`). The per-minute meter bills the rest.
"""
from core.idempotency import request_fingerprint
from marketplace.models import Image, Instance  # noqa: F401 (callers reach the models through here)
from marketplace.services.funds import (
    COMMITTED_STATUSES,
    Funds,
    InsufficientFunds,
    committed_rate_micros,
    funds_for,
    funds_of,
)

from .booking import PriceChanged, instance_create
from .common import (
    MAX_DISK_GB,
    WAITING,
    instance_for_idempotency_key,
    instance_gpu_indices,
    instance_gpu_uuids,
    instance_on_one_nvlink_island,
    instance_release_gpus,
    instances_for_user,
)
from .interruptions import (
    instance_interrupt,
    instance_restart_interrupted,
    instance_resume,
    lost_disk_give_back,
    lost_usage_give_back,
    node_instances_interrupt,
    vm_last_seen_at,
)
from .lifecycle import (
    instance_destroy,
    instance_end_by_operator,
    instance_label,
    instance_restart,
    instance_start,
    instance_stop,
)
from .mig import instance_slice_uuids
from .pricing import (
    instance_price_cut,
    instance_price_follow,
    node_instances_price_cut,
    node_instances_price_follow,
    score_share,
)
from .secrets import ENV_VALUE_MASK, env_masked, instance_env, instance_registry_auth
from .worker import (
    instance_cleanup_done,
    instance_mark_destroyed,
    instance_mark_failed,
    instance_mark_provisioning,
    instance_mark_running,
    instance_mark_running_again,
    instance_mark_stopped,
    instance_set_status_message,
    instance_vm_gone,
)

__all__ = [
    "instance_slice_uuids", "score_share",
    "COMMITTED_STATUSES", "MAX_DISK_GB", "WAITING", "Funds", "InsufficientFunds", "committed_rate_micros",
    "funds_for", "funds_of", "instance_create", "PriceChanged",
    "instance_destroy", "instance_end_by_operator", "instance_for_idempotency_key", "instance_cleanup_done",
    "instance_interrupt", "instance_label",
    "instance_price_cut", "node_instances_price_cut", "instance_price_follow", "node_instances_price_follow",
    "instance_restart_interrupted", "instance_resume", "lost_usage_give_back", "node_instances_interrupt",
    "lost_disk_give_back", "vm_last_seen_at",
    "instance_gpu_indices", "instance_gpu_uuids", "instance_on_one_nvlink_island",
    "instance_mark_destroyed", "instance_mark_failed", "instance_mark_provisioning",
    "instance_mark_running", "instance_mark_running_again", "instance_mark_stopped", "instance_release_gpus",
    "instance_restart",
    "instance_registry_auth", "instance_env", "env_masked", "ENV_VALUE_MASK",
    "instance_set_status_message", "instance_vm_gone", "instance_start", "instance_stop", "instances_for_user",
    "request_fingerprint",
]
