"""Dynamic batching for `dz serve`: requests of different sessions that arrive close together are solved in one
batched forward (`DreamZeroPolicy.predict_batch`), so one GPU serves several robots at once.

The rules, each tested in tests/serve/test_batching.py:
- a batch holds at most `max_batch` requests, and at most one per session: a session's second request waits for
  the next batch, so a session's requests are solved in the order they came;
- after the oldest waiting request arrived, the batcher waits at most `window_s` for more, and only while another
  client could still send one (`clients`: the server's connections, each of which has at most one request in
  flight): a lone robot never waits for company, however many sessions it opened;
- requests that arrive while a batch is being solved form the next one as soon as it ends;
- every request gets its own answer or its own error: a failure of the batched call as a whole is every one of its
  requests' error; a request whose waiting task was cancelled is left out; if the batcher itself stopped, every
  request still waiting gets that error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BatchStats:
    batches: int = 0
    requests: int = 0
    sizes: dict[int, int] = field(default_factory=dict)   # batch size -> how many batches had it

    def add(self, size: int) -> None:
        self.batches += 1
        self.requests += size
        self.sizes[size] = self.sizes.get(size, 0) + 1

    def as_dict(self) -> dict:
        return {"batches": self.batches, "requests": self.requests,
                "mean_size": round(self.requests / self.batches, 2) if self.batches else None,
                "sizes": {str(k): v for k, v in sorted(self.sizes.items())}}


@dataclass
class _Waiting:
    session: Hashable
    payload: Any
    future: asyncio.Future
    arrived: float


@dataclass
class Answer:
    """One request's share of a batch: its result (or `error`), the batch's size and its solve time."""
    result: Any
    batch_size: int
    solve_ms: float
    queue_ms: float


class DynamicBatcher:
    """`solve(payloads) -> results` (one result per payload, in order; a result that is an exception is that
    request's error) runs in a worker thread, one batch at a time. Create it inside a running event loop, then
    `await submit(session, payload)` from any number of tasks; `close()` stops it and fails what still waits."""

    def __init__(self, solve: Callable[[list], list], max_batch: int, window_s: float,
                 clients: Callable[[], int] | None = None, clock: Callable[[], float] = time.perf_counter):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not window_s >= 0:
            raise ValueError(f"the batching window must be >= 0 seconds, got {window_s}")
        self.solve, self.max_batch, self.window_s = solve, max_batch, window_s
        self.clients = clients
        self.clock = clock
        self.stats = BatchStats()
        self._waiting: list[_Waiting] = []
        self._solving: list[_Waiting] = []
        self._arrival = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._task.add_done_callback(self._stopped)

    def wake(self) -> None:
        """Look again whether a batch is complete (a client left, so fewer may join)."""
        self._arrival.set()

    def _stopped(self, task: asyncio.Task) -> None:
        error = RuntimeError("the server is shutting down") if task.cancelled() else \
            RuntimeError(f"the batcher stopped: {task.exception()!r}")
        for w in self._waiting + self._solving:
            if not w.future.done():
                w.future.set_exception(error)
        self._waiting.clear()

    async def submit(self, session: Hashable, payload: Any) -> Answer:
        if self._task.done():
            raise RuntimeError("the batcher is closed")
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(session, payload, future, self.clock()))
        self._arrival.set()
        return await future

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._stopped(self._task)

    def _next_batch(self) -> list[_Waiting]:
        """The oldest waiting request of each session, oldest first, up to max_batch; gone clients dropped."""
        self._waiting = [w for w in self._waiting if not w.future.done()]
        batch, sessions = [], set()
        for w in self._waiting:
            if w.session not in sessions:
                batch.append(w)
                sessions.add(w.session)
                if len(batch) == self.max_batch:
                    break
        return batch

    def _may_grow(self, batch: list[_Waiting]) -> bool:
        """Whether another request could still join: fewer in the batch than there are clients."""
        if self.clients is None:
            return True
        return len(batch) < self.clients()

    async def _run(self) -> None:
        while True:
            await self._arrival.wait()
            self._arrival.clear()
            batch = self._next_batch()
            while batch and len(batch) < self.max_batch and self._may_grow(batch):
                left = batch[0].arrived + self.window_s - self.clock()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._arrival.wait(), left)
                except TimeoutError:
                    pass
                self._arrival.clear()
                batch = self._next_batch()
            if not batch:
                continue
            taken = {id(w) for w in batch}
            self._waiting = [w for w in self._waiting if id(w) not in taken]
            if self._waiting:
                self._arrival.set()  # what is left (or arrives meanwhile) forms the next batch
            await self._solve(batch)

    async def _solve(self, batch: list[_Waiting]) -> None:
        start = self.clock()
        self._solving = batch
        try:
            results = await asyncio.to_thread(self.solve, [w.payload for w in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the batched call gave {len(results)} answers for {len(batch)} requests")
        except Exception as exc:  # the call as a whole failed: that is each request's error
            results = [exc] * len(batch)
        solve_ms = (self.clock() - start) * 1e3
        self._solving = []
        self.stats.add(len(batch))
        for w, result in zip(batch, results):
            if w.future.done():  # its client went away meanwhile
                continue
            if isinstance(result, BaseException):
                w.future.set_exception(result)
            else:
                w.future.set_result(Answer(result, len(batch), solve_ms, (start - w.arrived) * 1e3))
