"""Log lines that say which job, node, instance and task they are about, and JSON log lines for production.

Code that knows what it works on binds it for the duration of the work:

    with log_context(job_id=job.pk, node_id=job.node_id, instance_id=job.instance_id):
        ...  # every log record made here, in any module, carries these ids

The ids live in a contextvar (so threads and tasks never see each other's), `ContextFilter` copies them onto
each record (None where unbound), and the formatters print them: `JsonFormatter` (python-json-logger) one JSON
object per line with fixed keys, the plain formatter as `[job=.. node=.. instance=..]`. Celery tasks bind their
name and id by themselves (`bind_celery_task_signals`, connected in config/celery.py).

LOG_FORMAT=json (the default in production) or plain chooses the formatter (config/settings/base.py LOGGING).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

FIELDS = ("job_id", "node_id", "instance_id", "task", "task_id")

_PLAIN_LABELS = {"job_id": "job", "node_id": "node", "instance_id": "instance", "task": "task", "task_id": "task_id"}

_context: ContextVar[dict[str, Any] | None] = ContextVar("gpumarket_log_context", default=None)


def current() -> dict[str, Any]:
    """The ids bound now (a copy)."""
    return dict(_context.get() or {})


@contextmanager
def log_context(**ids: Any) -> Iterator[None]:
    """Bind ids (job_id, node_id, instance_id, ...) to every log record made inside the block; None values are
    left out, and the ids bound outside stay (an inner block adds to them)."""
    unknown = set(ids) - set(FIELDS)
    if unknown:
        raise TypeError(f"log_context: unknown field(s) {sorted(unknown)}; known: {FIELDS}")
    token = _context.set({**(_context.get() or {}), **{k: v for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class ContextFilter(logging.Filter):
    """Put the bound ids on each record (as attributes named FIELDS; None when unbound). Never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _context.get() or {}
        for name in FIELDS:
            if not hasattr(record, name):  # an explicit `extra={...}` wins
                setattr(record, name, bound.get(name))
        return True


class PlainFormatter(logging.Formatter):
    """The development format, with the bound ids (only those bound) after the logger's name."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(f"{_PLAIN_LABELS[name]}={getattr(record, name)}" for name in FIELDS
                       if getattr(record, name, None) is not None)
        if not ids:
            return line
        head, sep, rest = line.partition(f" {record.name} ")
        return f"{head}{sep}[{ids}] {rest}" if sep else f"[{ids}] {line}"


class JsonFormatter(_JsonFormatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, the FIELDS (null when unbound),
    and the exception's traceback when there is one."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("rename_fields", {"asctime": "time", "levelname": "level", "name": "logger"})
        super().__init__(fmt="%(asctime)s %(levelname)s %(name)s %(message)s", **kwargs)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (stdlib name)
        return datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")

    def add_fields(self, log_record: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        super().add_fields(log_record, record, message_dict)
        for name in FIELDS:
            log_record.setdefault(name, getattr(record, name, None))


def bind_celery_task_signals() -> None:
    """Bind each Celery task's name and id while it runs (task_prerun → task_postrun)."""
    from celery.signals import task_postrun, task_prerun

    tokens: dict[str, Any] = {}

    def _bind(task_id: str | None = None, task: Any = None, **_: Any) -> None:
        if task_id is None:
            return
        tokens[task_id] = _context.set({**(_context.get() or {}), "task": getattr(task, "name", None),
                                        "task_id": task_id})

    def _unbind(task_id: str | None = None, **_: Any) -> None:
        token = tokens.pop(task_id, None) if task_id is not None else None
        if token is not None:
            try:
                _context.reset(token)
            except ValueError:  # set in another context (a thread pool): forget it there
                _context.set(None)

    task_prerun.connect(_bind, weak=False)
    task_postrun.connect(_unbind, weak=False)
