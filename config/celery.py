"""The Celery application, and the one place where tasks are routed to queues.

Broker and beat schedule come from Django settings (CELERY_*). Work is split into three queues by kind, so that
one kind of work never waits behind another (docs/SCALING.md):

- `ssh`: jobs that drive one node over SSH for seconds to minutes (verify, spot check, provision, start, stop,
  restart, destroy, volume create/delete).
  A node stuck in a 5-minute benchmark holds an `ssh` worker slot, nothing else.
- `fleet`: periodic upkeep of the whole fleet (health checks and reconciles in batches, re-checks that queue
  verifications, the job outbox's sender, the reaper) and users' notifications (e-mail, outgoing webhooks).
- `money`: metering ticks and balance enforcement (zero-balance stops), the stops of deactivated accounts'
  instances, top-up charges and the follow-up of top-ups whose webhook never came, payouts.

Every task of the project is named in TASK_ROUTES below (tests/test_queues.py fails for a registered task
without a route). Beat and `core.dispatch.send` queue by task name, and Celery routes a name sent with
`send_task` through the same table, so a route here is the only thing that decides where a task runs. Run one
worker per queue group (`scripts/run-worker ssh`, ...) or one worker on all three (`scripts/run-worker`).
"""
import functools
import os
from collections.abc import Iterator, Mapping
from typing import Any

from celery import Celery
from django.core.signals import setting_changed
from kombu import Exchange, Queue

from core.logging_context import bind_celery_task_signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")

SSH, FLEET, MONEY = "ssh", "fleet", "money"
QUEUES = (SSH, FLEET, MONEY)

_SSH_TASKS = (
    "provisioning.tasks.node_verify",
    "provisioning.tasks.node_spot_check",
    "provisioning.tasks.instance_provision",
    "provisioning.tasks.instance_start",
    "provisioning.tasks.instance_stop",
    "provisioning.tasks.instance_restart",
    "provisioning.tasks.instance_destroy",
    "provisioning.tasks.volume_create",
    "provisioning.tasks.volume_delete",
)
_FLEET_TASKS = (
    "provisioning.tasks.nodes_health_check",
    "provisioning.tasks.nodes_reconcile",
    "provisioning.tasks.nodes_verify_pending",
    "provisioning.tasks.nodes_reverify_due",
    "provisioning.tasks.jobs_dispatch",
    "provisioning.tasks.jobs_reap",
    "provisioning.tasks.fleet_health_batch",
    "provisioning.tasks.fleet_reconcile_batch",
    # Users' notifications: e-mail and outgoing webhooks wait on other people's servers (seconds each), so not
    # on the money queue, where they could delay a metering tick.
    "notifications.tasks.email_send",
    "notifications.tasks.webhook_deliver",
    "notifications.tasks.deliveries_resend",
    "notifications.tasks.emails_resend",
    "notifications.tasks.deliveries_prune",
)
_MONEY_TASKS = (
    "billing.tasks.usage_meter_tick",
    "billing.tasks.top_up_charge",
    "billing.tasks.top_ups_reconcile",
    "billing.tasks.payouts_run",
    "marketplace.tasks.accounts_deactivated_sweep",
)

TASK_ROUTES: dict[str, dict[str, str]] = {
    **{name: {"queue": SSH} for name in _SSH_TASKS},
    **{name: {"queue": FLEET} for name in _FLEET_TASKS},
    **{name: {"queue": MONEY} for name in _MONEY_TASKS},
}

class DjangoCeleryConfig(Mapping):
    """Django's CELERY_* settings as Celery's configuration source, read live.

    Celery reads its options through its source by two names each (`CELERY_TASK_SERIALIZER`, `task_serializer`),
    about ten per `send_task`. On Django's settings object each name it does not define is an AttributeError
    raised through LazySettings: 42 µs a lookup, half of a task's publish (bench/booking.py, the job relay).
    Here such a name is a set miss. The set of CELERY_* names is read again whenever a test overrides a setting
    (Django's setting_changed)."""

    def __getitem__(self, key: str) -> Any:
        if key not in _celery_names():
            raise KeyError(key)
        from django.conf import settings

        try:
            return getattr(settings, key)
        except AttributeError:  # deleted by a test's override without Django's signal
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(_celery_names()))

    def __len__(self) -> int:
        return len(_celery_names())


@functools.cache
def _celery_names() -> frozenset[str]:
    from django.conf import settings

    return frozenset(name for name in dir(settings) if name.startswith("CELERY_"))


def _forget_names(**_: Any) -> None:
    _celery_names.cache_clear()


setting_changed.connect(_forget_names, weak=False)

app = Celery("gpumarket")
app.config_from_object(DjangoCeleryConfig(), namespace="CELERY")
app.conf.task_queues = tuple(Queue(name, Exchange(name, type="direct"), routing_key=name) for name in QUEUES)
app.conf.task_routes = TASK_ROUTES
# A task sent without a route (a bug tests/test_queues.py catches) still reaches a worker rather than a queue
# nobody reads: the fleet queue, which every deployment runs.
app.conf.task_default_queue = FLEET
app.autodiscover_tasks()
# Log records made while a task runs carry its name and id (core/logging_context.py).
bind_celery_task_signals()
