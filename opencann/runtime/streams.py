"""Running the streams of a multi-stream schedule at once, on threads of their own.

The code generator (`opencann.runtime.codegen`) writes one function per stream,
``_s<k>(inputs, _V)``: its nodes in order, a wait ``_W(e)`` before a node that needs a
value made on another stream, the value handed over in the per-call slot list ``_V``,
and a record ``_E[e].set()`` after the producer. `StreamRunner.run` runs stream 0 of a
call on the calling thread and every other stream function on a worker thread of its
own (ATen kernels release the GIL, so kernels of different streams overlap), and waits
for all of them. The caller running stream 0 itself saves a thread wake-up at the start
of each call and, when stream 0 ends last (it holds the critical path), one at the end:
each costs tens of µs on an idle core and milliseconds on a loaded machine (measured
under load 8 on 2 cores: a woken worker started its stream ~3 ms late, after the other
stream had ended; docs/performance.md, "Streams").

Events are `threading.Event`s made once per runner and cleared at the start of each
call: an executor runs one call at a time (`ExecutorPool` gives concurrent calls an
executor, hence a runner and worker threads, each), and a call returns only after all
its streams have ended, so nothing still waits on an event when it is cleared.

A failing stream sets the abort flag and every event before it reports; a stream
waiting on an event then stops with `StreamAborted` instead of waiting forever, and
`run` raises the first real error (the caller names the node, as on one stream).

Intra-op threads: each worker sets its own count, ``threads_per_stream`` (default: the
starting caller's ``torch.get_num_threads()`` divided by the number of streams, at least
1), and the calling thread runs stream 0 with that count and gets its own back when
stream 0 ends, all through `opencann.runtime.thread_count.set_this_thread`, which sets
the calling thread's OpenMP and MKL counts only. Never ``torch.set_num_threads``: it also
sets ATen's process default, which every thread copies on its first parallel region, so a
caller thread that started during another call's stream 0 kept 1 intra-op thread for good
(measured: tests/integration/test_stream_threads.py). With no OpenMP runtime found
(`thread_count.available` False) the counts stay as they are.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Callable, List, Optional, Sequence

import torch

from .thread_count import restore_this_thread, set_this_thread

_START_LOCK = threading.Lock()  # a runner's workers start once


def threads_per_stream(nstreams: int, total: Optional[int] = None) -> int:
    """Intra-op threads each of ``nstreams`` stream workers gets: ``total`` (default the
    calling thread's ``torch.get_num_threads()``) // ``nstreams``, at least 1."""
    return max(1, (total or torch.get_num_threads()) // max(1, nstreams))


class StreamAborted(Exception):
    """Raised in a stream waiting on an event when another stream of the call failed."""


def _worker(jobs: "queue.SimpleQueue", done: "queue.SimpleQueue", nthreads: int,
            ready: "queue.SimpleQueue") -> None:
    set_this_thread(nthreads)  # this worker's count only (never restored: it owns the thread)
    ready.put(None)
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, inputs, slots, fail = job
        job = None
        try:
            fn(inputs, slots)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            fail()
            done.put(e)
        else:
            done.put(None)
        fn = inputs = slots = fail = None


def _stop(jobs: List["queue.SimpleQueue"]) -> None:
    for q in jobs:
        q.put(None)


class StreamRunner:
    """Worker threads and events for the ``nstreams`` stream functions of one executor.

    ``nevents`` events, ``nslots`` value slots per call; ``fns`` (the stream functions,
    set after the generated code is compiled) take ``(inputs, slots)``. Workers start on
    the first `run` and end when the runner is garbage-collected."""

    def __init__(self, nstreams: int, nevents: int, nslots: int,
                 threads_per_stream: Optional[int] = None):
        self.nstreams, self.nslots = nstreams, nslots
        self.events = [threading.Event() for _ in range(nevents)]
        self.fns: List[Callable] = []
        self.threads_per_stream = threads_per_stream
        self._aborted = False
        self._jobs = [queue.SimpleQueue() for _ in range(nstreams - 1)]  # streams 1..
        self._done: "queue.SimpleQueue" = queue.SimpleQueue()
        self._started = False

    def copy(self) -> "StreamRunner":
        """A runner of the same shape with its own events, slots and threads (for
        `Executor.clone`); ``fns`` is left empty for the caller to set."""
        return StreamRunner(self.nstreams, len(self.events), self.nslots, self.threads_per_stream)

    def start(self) -> None:
        """Start the worker threads of streams 1.. (once; `run` does it on its first
        call), each with its intra-op thread count."""
        with _START_LOCK:
            if self._started:
                return
            n = self.threads_per_stream or threads_per_stream(self.nstreams)
            ready: "queue.SimpleQueue" = queue.SimpleQueue()
            for s, jobs in enumerate(self._jobs, 1):
                threading.Thread(target=_worker, args=(jobs, self._done, n, ready),
                                 name=f"opencann-stream-{s}", daemon=True).start()
            for _ in self._jobs:
                ready.get()
            self.threads_per_stream = n
            self._started = True
            weakref.finalize(self, _stop, list(self._jobs))

    def wait(self, k: int) -> None:
        """Block until event ``k`` is recorded; raises `StreamAborted` when another
        stream failed instead."""
        self.events[k].wait()
        if self._aborted:
            raise StreamAborted("another stream of this call failed")

    def _fail(self) -> None:
        self._aborted = True
        for e in self.events:
            e.set()

    def run(self, inputs: Sequence[torch.Tensor]) -> list:
        """Run every stream function on ``inputs`` at once (stream 0 on this thread);
        returns the call's value slots. Raises the first error a stream raised (not
        `StreamAborted`) after all streams have ended."""
        if not self._started:
            self.start()
        for e in self.events:
            e.clear()
        self._aborted = False
        slots = [None] * self.nslots
        for q, fn in zip(self._jobs, self.fns[1:]):
            q.put((fn, inputs, slots, self._fail))
        own = self._run_here(inputs, slots)
        first = self._collect(len(self.fns) - 1)
        if own is not None and (first is None or not isinstance(own, StreamAborted)):
            first = own
        if first is not None:
            raise first
        return slots

    def _run_here(self, inputs: Sequence[torch.Tensor], slots: list) -> Optional[BaseException]:
        """Stream 0 on the calling thread with the streams' intra-op thread count (the
        caller's restored after); returns what it raised, or None."""
        saved = set_this_thread(self.threads_per_stream)
        try:
            self.fns[0](inputs, slots)
        except BaseException as e:  # noqa: BLE001 - raised once the other streams end
            self._fail()
            return e
        finally:
            restore_this_thread(saved)
        return None

    def _collect(self, left: int) -> Optional[BaseException]:
        """Wait for ``left`` worker streams to end; the first error one raised that is
        not `StreamAborted`, or None."""
        first = None
        try:
            while left:
                r = self._done.get()
                left -= 1
                if r is not None and first is None and not isinstance(r, StreamAborted):
                    first = r
        except BaseException:  # interrupted while waiting: stop the streams, then re-raise
            self._fail()
            for _ in range(left):
                self._done.get()
            raise
        return first
