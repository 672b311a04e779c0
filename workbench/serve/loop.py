"""The engine loop: one thread owns the engine; every other thread sends it commands.

The engine is not thread-safe, so ``add_request``/``step``/``abort`` and every read of engine
state happen on this thread. Front ends talk to it through a FIFO of commands:

- ``submit(prompt, sampling, sink)`` → the loop admits the request between two steps and answers
  on ``sink`` with :class:`Admitted` or :class:`Rejected` (the engine's RequestError), then, for a
  streaming request, one :class:`Chunk` per step that produced tokens, and always a final
  ``Chunk(finished=True)`` carrying the engine's :class:`RequestOutput`;
- ``abort(ticket)`` → the engine frees the request's KV now (a client went away);
  ``abort_all()`` → the same for every request admitted so far;
- ``call(fn)`` → ``fn(engine)`` runs between steps; its result comes back in a Future (metrics,
  server info, KV usage).

Commands are FIFO, so an abort always sees its own submit first. One loop iteration: drain the
commands (block briefly when nothing can step), then one ``engine.step()``.

Faults. A request's own numeric failure (non-finite logits, no valid sampling distribution), or
one the engine cannot admit, is that request's alone. If ``engine.step()`` raises, the loop
records the error, finishes every live request with ``finish_reason="error"``, refuses new work
(``error`` is set, /health turns 503), calls ``on_fatal(error)`` (``workbench serve`` then exits
non-zero) and re-raises on its thread: a broken engine never keeps serving.

Liveness: :meth:`EngineLoop.heartbeat` says how long ago the loop last came round and how long
the current step or command has run; the server's /health turns red when that exceeds a bound.
Backpressure: with ``max_pending`` set, :meth:`EngineLoop.submit` raises :class:`QueueFull`
once that many requests are outstanding (503 + Retry-After); a stream whose client does not
read is held (no engine steps) while its backlog is high (:mod:`workbench.serve.backpressure`).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from workbench.config import SamplingParams
from workbench.core import LogprobParams
from workbench.engine.stops import hold_back, text_stops
from workbench.serve.backpressure import Backpressure
from workbench.serve.messages import (  # the loop's API: front ends import them from here too
    Admitted,
    Chunk,
    LoopClosed,
    QueueFull,
    Rejected,
    Sink,
    Ticket,
)
from workbench.serve.sglang_metrics import ServeMetrics
from workbench.serve.step_profile import StepProfile

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    """Owns ``engine`` on one background thread (module doc). Start with :meth:`start`.

    Queue shares: a request that is one choice of several (OpenAI ``n`` / several prompts, a
    batched ``/generate``) counts against the ``"fanout"`` share, which may hold at most
    ``FANOUT_SHARE`` of ``max_pending``; single requests may use every slot, so a flood of
    ``n=16`` requests can fill at most that share and never starves single requests of
    slots. With ``max_running`` set, the loop hands the engine at most that many requests
    (held streams not counted) and keeps the rest itself, one queue per share, admitted in
    turn (:meth:`_admit_waiting`, :meth:`_fanout_room`; docs/SERVING.md)."""

    FANOUT_SHARE = 0.5
    FANOUT_RAMP_S = 0.1

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05, max_pending: int | None = None,
                 on_fatal: Callable[[str], None] | None = None,
                 max_running: int | None = None, metrics: ServeMetrics | None = None) -> None:
        if max_pending is not None and (not isinstance(max_pending, int) or max_pending < 1):
            raise ValueError(f"max_pending: must be an integer >= 1 or None, got {max_pending!r}")
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.max_pending = max_pending
        if max_running is not None and (not isinstance(max_running, int) or max_running < 1):
            raise ValueError(f"max_running: must be an integer >= 1 or None, got {max_running!r}")
        self.max_running = max_running
        # submitted, not yet handed to the engine (max_running set): one queue per share
        self._waiting: dict[str, collections.deque[Ticket]] = {
            "single": collections.deque(), "fanout": collections.deque()}
        self._single_next = True  # whose turn it is when both shares wait
        self._fan_admitted = -1e9  # monotonic time a fan-out choice was last admitted
        self._single_seen = -1e9  # monotonic time a single request was last live or waiting
        self.on_fatal = on_fatal
        self.error: str | None = None  # set when engine.step raised; the loop is then dead
        self.error_id: str | None = None  # names that failure in the log (5xx bodies show it)
        self.rejected_full = 0  # submits refused with QueueFull
        self._pending = 0  # submitted and not done (guarded by _lock)
        self._fanout_pending = 0  # of which in the "fanout" share
        self._beat = time.monotonic()  # the loop last came round (between steps/commands)
        self._busy_since: float | None = None  # a step or command is running since
        self.prompt_tokens_total = 0
        self.requests_total = 0
        self.finished_total: dict[str, int] = {}
        # gen_throughput (this thread); the latency histograms (the HTTP side: serve/latency.py)
        self.metrics = metrics or ServeMetrics()
        self.profile = StepProfile()  # step time by batch kind (loop thread only)
        self.backpressure = Backpressure()  # held streams (loop thread only)
        self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._live: dict[int, Ticket] = {}
        self._lock = threading.Lock()  # guards _closed against a racing submit
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- any thread ------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        if self._thread is not None:
            raise RuntimeError("engine loop already started")
        self._thread = threading.Thread(target=self._run, name="workbench-engine-loop",
                                        daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    @property
    def num_running(self) -> int:
        """Admitted requests not finished yet (waiting or running in the engine)."""
        return len(self._live)

    @property
    def num_pending(self) -> int:
        """Submitted requests not finished yet (admitted or still queued for admission)."""
        return self._pending

    def heartbeat(self) -> dict[str, Any]:
        """``alive``; ``since_beat_s``: since the loop last came round; ``busy_s``: how long
        the step or command now running has run (0 between them)."""
        now = time.monotonic()
        busy = self._busy_since
        return {"alive": self.alive, "since_beat_s": now - self._beat,
                "busy_s": 0.0 if busy is None else now - busy, "pending": self._pending,
                "running": len(self._live)}

    def submit(self, prompt: Any, sampling: SamplingParams, sink: Sink,
               stream: bool = False, logprobs: LogprobParams | None = None,
               share: str = "single", group: object = None) -> Ticket:
        """Queue a request for admission; answers arrive on ``sink`` (module doc). Raises
        :class:`QueueFull` when ``max_pending`` requests are outstanding, or, for ``share``
        ``"fanout"``, when that share is full (class doc)."""
        if share not in ("single", "fanout"):
            raise ValueError(f"share: 'single' or 'fanout', got {share!r}")
        ticket = Ticket(prompt, sampling, sink, stream, logprobs=logprobs, share=share,
                        group=group)
        with self._lock:
            if self._closed:
                raise LoopClosed(self.error or "engine loop is stopped")
            if self.max_pending is not None and self._pending >= self.max_pending:
                self.rejected_full += 1
                raise QueueFull(f"server: {self._pending} requests are queued or running (the "
                                f"limit is {self.max_pending}); retry later")
            cap = self.fanout_cap
            if share == "fanout" and cap is not None and self._fanout_pending >= cap:
                self.rejected_full += 1
                raise QueueFull(f"server: choices of requests with several choices hold "
                                f"{self._fanout_pending} of the {cap} slots they share; retry "
                                "later")
            self._pending += 1
            self._fanout_pending += share == "fanout"
            self._cmds.put(("add", ticket))
        return ticket

    @property
    def fanout_cap(self) -> int | None:
        """Slots the "fanout" share may hold (None: unbounded)."""
        return None if self.max_pending is None else max(int(self.max_pending *
                                                             self.FANOUT_SHARE), 1)

    def _done(self, t: Ticket) -> None:
        """Mark ``t`` finished (once) and release its pending slot."""
        with self._lock:
            if not t.done:
                t.done = True
                self._pending -= 1
                self._fanout_pending -= t.share == "fanout"

    def abort(self, ticket: Ticket) -> None:
        """Abort a submitted request (no-op once finished or if the loop is gone)."""
        if ticket.done:
            return
        try:
            self._put(("abort", ticket))
        except LoopClosed:
            pass  # the loop finished every request when it closed

    def abort_all(self) -> None:
        """Abort every request admitted so far (no-op if the loop is gone)."""
        try:
            self._put(("abort_all",))
        except LoopClosed:
            pass  # the loop finished every request when it closed

    def call(self, fn: Callable[[Any], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread between steps."""
        fut: Future[T] = Future()
        self._put(("call", fn, fut))
        return fut

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every live request, stop the thread and wait for it (idempotent)."""
        try:
            self._put(("stop",))
        except LoopClosed:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _put(self, cmd: tuple[Any, ...]) -> None:
        with self._lock:
            if self._closed:
                raise LoopClosed(self.error or "engine loop is stopped")
            self._cmds.put(cmd)

    # -- loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain(block=not self._runnable()):
                if self.max_running is not None:
                    self._admit_waiting()  # slots freed by the last step
                self._beat = time.monotonic()
                if self._runnable():
                    self._busy_since = self._beat
                    t0, before = time.perf_counter(), self.engine.stats.generated_tokens
                    sched = self.engine.scheduler
                    self.profile.before([] if sched is None else [
                        r for r in [*sched.running, *sched.waiting] if not r.held])
                    self._step()
                    self.profile.after(self.engine.stats.generated_tokens - before)
                    self.metrics.on_step(t0, time.perf_counter(), before,
                                         self.engine.stats.generated_tokens,
                                         not self.engine.has_unfinished())
                    self._busy_since = None
                self._beat = time.monotonic()
        except Exception as e:
            self.error = f"engine loop failed: {type(e).__name__}: {e}"
            self.error_id = uuid.uuid4().hex[:12]
            log.exception("engine loop failed (error id %s); finishing every live request with "
                          "an error", self.error_id)
            self._close(self.error)
            if self.on_fatal is not None:
                self.on_fatal(self.error)
            raise
        self._close(None)

    def _runnable(self) -> bool:
        """Hold/release streams by backlog; True if a step has work that is not held."""
        self.backpressure.update(self._live, self.engine.requests)
        sched = self.engine.scheduler
        # a held request preempted for its KV waits for its client, not for a step
        return sched is not None and (sched.num_active() > 0
                                      or any(not r.held for r in sched.waiting))

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False once asked to stop."""
        try:
            cmd = self._cmds.get(timeout=self.idle_wait_s) if block else self._cmds.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._run_command(cmd):
                return False
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _run_command(self, cmd: tuple[Any, ...]) -> bool:
        kind = cmd[0]
        self._busy_since = time.monotonic()
        try:
            if kind == "add":
                if self.max_running is None:
                    self._admit(cmd[1])
                else:
                    self._waiting[cmd[1].share].append(cmd[1])
                    self._admit_waiting()
            elif kind == "abort":
                self._abort(cmd[1])
            elif kind == "abort_all":
                for t in [*self._live.values(), *self._waiting["single"],
                          *self._waiting["fanout"]]:
                    self._abort(t)
            elif kind == "call":
                fn, fut = cmd[1], cmd[2]
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except Exception as e:  # noqa: BLE001 (handed to the caller, who re-raises)
                        fut.set_exception(e)
            elif kind == "stop":
                return False
        finally:
            self._busy_since = None
        return True

    def _admit(self, t: Ticket) -> None:
        try:
            rid = self.engine.add_request(t.prompt, t.sampling, logprobs=t.logprobs)
        except (ValueError, TypeError) as e:  # RequestError is a ValueError; bad input only
            self._done(t)
            t.sink.put(Rejected(str(e)))
            return
        except Exception:  # request-scoped: this prompt alone is refused, the loop goes on
            eid = uuid.uuid4().hex[:12]
            log.exception("admitting a request failed (error id %s)", eid)
            self._done(t)
            t.sink.put(Rejected(f"could not admit the request (error id {eid})", status=500))
            return
        t.rid = rid
        self._live[rid] = t
        n = len(self.engine.output(rid).prompt_ids)
        self.prompt_tokens_total += n
        self.requests_total += 1
        t.sink.put(Admitted(rid, n))

    def _admit_waiting(self) -> None:
        """Hand waiting requests to the engine while it runs fewer than ``max_running``: the
        shares in turn; a choice of a several-choice request only while such choices fill
        less than ``FANOUT_SHARE`` of the batch or no single request waits."""
        singles, fanout = self._waiting["single"], self._waiting["fanout"]
        assert self.max_running is not None
        held = self.backpressure.held  # take no slot
        while (singles or fanout) and len(self._live) - len(held) < self.max_running:
            fan_ok = bool(fanout) and self._fanout_room()
            if singles and (self._single_next or not fan_ok):
                t = singles.popleft()
            elif fan_ok:
                t = fanout.popleft()
            else:
                break
            self._single_next = t.share != "single"
            if t.share == "fanout":
                self._fan_admitted = time.monotonic()
            self._admit(t)

    def _fanout_room(self) -> bool:
        """May one more choice of a several-choice request run? While single requests run or
        wait, every HTTP request holds about one slot of the running batch: such choices
        never outnumber the single requests, nor the several-choice requests they belong to
        (a flood of n=16 requests from 8 clients holds 8 slots beside 40 single requests, not
        40: the batch every single request shares stays near its own size); otherwise they
        grow by one per ``FANOUT_RAMP_S`` up to ``FANOUT_SHARE`` of it, starting
        ``FANOUT_RAMP_S`` after the last single request left: the gap between a client's
        back-to-back requests does not let a flood grow into the batch that client's next
        request will share."""
        assert self.max_running is not None
        held = self.backpressure.held  # count in neither share
        fan = [t for r, t in self._live.items() if t.share == "fanout" and r not in held]
        running = len(fan)
        singles = len(self._live) - len(held) - running + len(self._waiting["single"])
        now = time.monotonic()
        if singles:
            self._single_seen = now
            clients = {id(t) if t.group is None else id(t.group)
                       for t in [*fan, *self._waiting["fanout"]]}
            return running < min(singles, len(clients))
        return (now - max(self._fan_admitted, self._single_seen) >= self.FANOUT_RAMP_S
                and running < max(int(self.max_running * self.FANOUT_SHARE), 1))

    def _abort(self, t: Ticket) -> None:
        if t.rid is None:
            q = self._waiting[t.share]
            if t not in q:
                return
            # still waiting in the loop: admitted and aborted at once, so whoever waits for
            # it gets what an aborted request gets (finish_reason "abort")
            q.remove(t)
            self._admit(t)
            if t.rid is None:
                return  # refused at admission: its sink has the answer
        if t.rid not in self._live:
            return
        self.engine.abort(t.rid)
        self._finish(t.rid, None)

    def _step(self) -> None:
        for o in self.engine.step():
            t = self._live.get(o.rid)
            if t is None:
                continue
            if o.finished:
                self._finish(o.rid, o.error)
            elif t.stream and o.new_token_ids:
                out = self.engine.output(o.rid)
                # a partial stop string may still complete: not shown until it cannot
                text = hold_back(out.text, text_stops(t.sampling))
                t.sink.put(Chunk(out.token_ids, text, self._num_draft_tokens(), False,
                                 output=out))
        if self._live and not self.engine.has_unfinished():
            # Safety net: the engine holds no work, so nothing live can progress any more.
            for rid in list(self._live):
                self._finish(rid, None)

    def _finish(self, rid: int, error: str | None) -> None:
        t = self._live.pop(rid)
        self.backpressure.forget(rid)
        if t.share == "single":
            self._single_seen = time.monotonic()
        out = self.engine.output(rid)
        reason = out.finish_reason or "abort"
        self.finished_total[reason] = self.finished_total.get(reason, 0) + 1
        # The engine keeps every request it has seen (there is no Engine.release(rid) yet);
        # forget finished ones so a long-running server does not grow without bound.
        self.engine.requests.pop(rid, None)
        self._done(t)
        t.sink.put(Chunk(out.token_ids, out.text, self._num_draft_tokens(), True, reason,
                         error or out.error, out, out.matched_stop))

    def _num_draft_tokens(self) -> int:
        return 0 if self.engine.spec is None else int(self.engine.spec.num_draft_tokens)

    def _close(self, error: str | None) -> None:
        """Refuse new work; finish live requests (aborted, or failed with ``error``)."""
        with self._lock:
            self._closed = True
        for rid, t in list(self._live.items()):
            if error is None:
                self.engine.abort(rid)
                self._finish(rid, None)
            else:
                self._live.pop(rid)
                self._done(t)
                t.sink.put(Chunk([], "", 0, True, "error", error, internal=True))
        for q in self._waiting.values():  # never handed to the engine
            while q:
                t = q.popleft()
                self._done(t)
                t.sink.put(Rejected(error or "server is shutting down", status=503))
        # Answer whatever was queued before _closed was set.
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._done(cmd[1])
                cmd[1].sink.put(Rejected(error or "server is shutting down", status=503))
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(LoopClosed(error or "engine loop is stopped"))
