"""A per-process background batcher: callers hand it items and return at once; one daemon thread takes everything
handed in so far and passes it to `handle` as one batch.

For work that must not hold up a request and that a durable record covers if the process dies first (the job
outbox: a job row nobody sent is sent by the dispatcher). Nothing here is durable: an item still queued when
the process is killed is lost, and a clean exit tries to finish what is queued (atexit, bounded).
"""
import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class BackgroundBatcher:
    def __init__(self, name: str, handle: Callable[[list[Any]], None], *, max_batch: int = 200,
                 idle_s: float = 1.0, on_idle: Callable[[], None] | None = None):
        """`handle` runs in the thread, once per batch, and must not raise (it is logged if it does).
        `on_idle` runs in the thread after `idle_s` without items, and when it stops (e.g. to close the thread's
        database connection, so that an idle process holds none)."""
        self.name, self.handle, self.max_batch, self.idle_s, self.on_idle = name, handle, max_batch, idle_s, on_idle
        self._lock = threading.Lock()
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child starts with no thread and no items
        atexit.register(self.stop, timeout=5)

    def _reset(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._done = threading.Condition()
        self._submitted = self._handled = 0

    def submit(self, item: Any) -> None:
        with self._done:
            self._submitted += 1
        self._queue.put(item)
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()

    def flush(self, timeout: float = 10) -> bool:
        """Wait until every item submitted so far was handled; False on timeout."""
        with self._done:
            target = self._submitted
            return self._done.wait_for(lambda: self._handled >= target, timeout=timeout)

    def stop(self, timeout: float = 5) -> bool:
        """Finish what is queued, then end the thread (it runs `on_idle` on its way out)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return True
        flushed = self.flush(timeout)
        self._queue.put(_STOP)
        thread.join(timeout)
        return flushed and not thread.is_alive()

    def _run(self) -> None:
        idle = True
        while True:
            try:
                first = self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                if not idle:
                    self._idle()
                    idle = True
                continue
            if first is _STOP:
                self._idle()
                return
            idle = False
            batch = [first]
            stop = False
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
            try:
                self.handle(batch)
            except Exception:  # noqa: BLE001 (the thread must live on; the durable record covers the batch)
                log.exception("%s: a batch of %d failed", self.name, len(batch))
            with self._done:
                self._handled += len(batch)
                self._done.notify_all()
            if stop:
                self._idle()
                return

    def _idle(self) -> None:
        if self.on_idle is not None:
            try:
                self.on_idle()
            except Exception:  # noqa: BLE001
                log.exception("%s: on_idle failed", self.name)


_STOP = object()
