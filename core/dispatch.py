"""Queueing Celery tasks by name: how a service asks for follow-up work without importing a task module.

Tasks import services (they are the services' entry points), so a service that imported its tasks would close
an import circle. Instead the service declares the name of the task it needs, next to its own code:

    TOP_UP_CHARGE = dispatch.task_name("billing.tasks.top_up_charge")

the task module registers its task under that name (`@shared_task(name=TOP_UP_CHARGE)`), and the service
queues it by name (`dispatch.enqueue_on_commit(TOP_UP_CHARGE, top_up.pk)`). `declared_names()` lists every
name declared so; tests/test_import_contract.py checks that each one has a registered task.
"""
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import current_app
from django.db import transaction

log = logging.getLogger(__name__)

_DECLARED: set[str] = set()


def task_name(name: str) -> str:
    """Declare the name of a task that a service queues (the task module registers its task under it)."""
    _DECLARED.add(name)
    return name


def declared_names() -> frozenset[str]:
    return frozenset(_DECLARED)


def send(name: str, *args: object, task_id: str | None = None, producer: Any = None) -> None:
    """Hand the task to the broker now (through `producer`, e.g. one of `batch()`, when given). Raises what the broker
    raises (kombu's errors when it is down)."""
    if getattr(producer, "_gpumarket_batch", False):
        # In a batch() the queues are declared once for the batch, and a publish only fills the pipeline (the
        # flush is where the broker can fail): no declaring and no retry wrapper per message.
        current_app.send_task(name, args=list(args), task_id=task_id, producer=producer, declare=[], retry=False)
        return
    current_app.send_task(name, args=list(args), task_id=task_id, producer=producer)


@contextmanager
def batch(max_size: int = 1000) -> Iterator[Any]:
    """A producer whose publishes go out together when the block ends (kombu's publish batch: with Redis, one
    pipeline instead of a round trip and a pipeline per message; other transports publish at once). A block that
    raises discards what was not flushed yet; a flush that fails raises, and which messages went out is unknown."""
    with current_app.producer_or_acquire() as producer:
        for queue in current_app.amqp.queues.values():  # what send_task would declare per message, once
            producer.maybe_declare(queue)
        with producer.batch(max_size=max_size):
            producer._gpumarket_batch = True
            try:
                yield producer
            finally:
                producer._gpumarket_batch = False


def enqueue_on_commit(name: str, *args: object) -> None:
    """Queue the task once the caller's transaction commits. A broker that refuses it is logged, never raised:
    the caller's work has committed, and the caller has a way to pick it up again (say so where you call this)."""
    def queue() -> None:
        try:
            send(name, *args)
        except Exception as exc:  # noqa: BLE001 (kombu and the transports raise many kinds; the rows stay)
            log.warning("%s%s: could not be queued (%s); it is picked up again later", name, tuple(args), exc)

    transaction.on_commit(queue)
