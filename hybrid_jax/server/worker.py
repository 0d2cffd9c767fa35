"""The engine on a thread of its own: the only code that touches the engine and the device.

HTTP handlers (or any other thread) ``submit`` requests and ``abort`` them; both only put a
command in a thread-safe inbox. The worker thread takes commands between steps, steps the
engine while it has work (and waits on the inbox while it has none), and hands every event to
the sink of its request. A submission that the engine refuses resolves its future with the
engine's error and changes nothing; a full queue is refused at once, on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence

from hybrid_jax.engine.engine import Engine
from hybrid_jax.engine.requests import Result, StepEvent
from hybrid_jax.engine.sampling import SamplingParams

__all__ = ["EngineClosed", "EngineWorker", "QueueFull", "Sink", "WorkerStats"]

log = logging.getLogger(__name__)

type Sink = Callable[[StepEvent | BaseException], None]
"""Receives a request's events on the worker thread (the last one carries its ``result``), or
the error that ended it (``EngineClosed``). It must return quickly and never raise."""


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already; retry later."""


class EngineClosed(RuntimeError):
    """The worker stopped (shut down, or its engine failed) before the request finished."""


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    """A snapshot for ``/metrics``: requests running and waiting, slots and pages in use, the
    tokens produced so far, and the engine's traces after warm-up."""

    running: int
    waiting: int
    slots_used: int
    slots_total: int
    pages_used: int
    pages_total: int
    tokens: int
    retraces: int


@dataclasses.dataclass
class _Submit:
    prompt: str | Sequence[int]
    params: SamplingParams
    sink: Sink
    accepted: concurrent.futures.Future[int]


@dataclasses.dataclass
class _Abort:
    request_id: int


class EngineWorker:
    """Runs ``engine`` on a daemon thread. ``max_waiting``: requests that may wait for a slot
    (submitted but not yet running) before ``submit`` raises ``QueueFull``. ``on_result``
    (settable before ``start``): called on the worker thread with every finished request's
    ``Result`` (for metrics)."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int = 256,
        on_result: Callable[[Result], None] | None = None,
    ):
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting} must be >= 1")
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_result = on_result
        self._inbox: queue.SimpleQueue[_Submit | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}
        self._unadmitted = 0  # submissions still in the inbox
        self._lock = threading.Lock()
        self._tokens = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybrid-jax-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed.is_set()

    def submit(
        self, prompt: str | Sequence[int], params: SamplingParams, sink: Sink
    ) -> concurrent.futures.Future[int]:
        """Queues a request; the future resolves to its id once the engine accepted it, or to
        the engine's ``RequestError`` / ``SamplingParamsError``. Raises ``QueueFull`` or
        ``EngineClosed`` at once, with nothing queued."""
        if not self.alive:
            raise EngineClosed(self.closed_reason)
        with self._lock:
            waiting = self._unadmitted + len(self.engine.scheduler.waiting)
            if waiting >= self.max_waiting:
                raise QueueFull(
                    f"{waiting} requests are waiting (the server's limit, --max-waiting, is "
                    f"{self.max_waiting}); retry later"
                )
            self._unadmitted += 1
        accepted: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._inbox.put(_Submit(prompt, params, sink, accepted))
        return accepted

    def abort(self, request_id: int) -> None:
        """Asks the worker to stop the request and free its slot and pages (its sink gets the
        result so far). A finished or unknown id is ignored."""
        self._inbox.put(_Abort(request_id))

    def close(self, timeout: float | None = 30.0) -> None:
        """Stops the worker: requests still running end with ``EngineClosed`` and their slots
        and pages are freed. Idempotent."""
        self._closed.set()
        self._inbox.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stats(self) -> WorkerStats:
        engine = self.engine
        slots, pages = engine.slots, engine.pages
        return WorkerStats(
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting) + self._unadmitted,
            slots_used=slots.capacity - slots.num_free,
            slots_total=slots.capacity,
            pages_used=pages.capacity - pages.num_free,
            pages_total=pages.capacity,
            tokens=self._tokens,
            retraces=engine.retraces,
        )

    @property
    def closed_reason(self) -> str:
        """Why the worker takes no more requests (once it has stopped)."""
        if self.error is not None:
            return f"the engine failed: {self.error!r}"
        return "the server is shutting down"

    # ----------------------------------------------------------------- worker thread

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                self._take_commands(block=not self.engine.has_work)
                if self._closed.is_set():
                    break
                if self.engine.has_work:
                    self._deliver(self.engine.step())
        except BaseException as err:  # the engine failed: every request hears why
            log.exception("the engine worker stopped")
            self.error = err
        finally:
            self._closed.set()
            self._finish_all()

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if command is None:
                return
            self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Submit | _Abort) -> None:
        if isinstance(command, _Abort):
            result = self.engine.abort(command.request_id)
            sink = self._sinks.pop(command.request_id, None)
            if sink is not None and result is not None:
                sink(StepEvent(command.request_id, -1, "", result))
            return
        with self._lock:
            self._unadmitted -= 1
        if not command.accepted.set_running_or_notify_cancel():
            return  # the caller gave up before the engine saw it
        try:
            request_id = self.engine.add_request(command.prompt, command.params)
        except Exception as err:  # RequestError, SamplingParamsError: nothing was queued
            command.accepted.set_exception(err)
            return
        self._sinks[request_id] = command.sink
        command.accepted.set_result(request_id)

    def _deliver(self, events: list[StepEvent]) -> None:
        for event in events:
            self._tokens += 1
            sink = self._sinks.get(event.request_id)
            if event.result is not None:
                self._sinks.pop(event.request_id, None)
                if self.on_result is not None:
                    self.on_result(event.result)
            if sink is not None:
                sink(event)

    def _finish_all(self) -> None:
        """After the loop: refuse what is still in the inbox, abort what is running."""
        reason = EngineClosed(self.closed_reason)
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(reason)
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # a failed engine may not abort cleanly; the sink still hears
                log.exception("aborting request %d at shutdown", request_id)
            sink(reason)
        self._sinks.clear()
