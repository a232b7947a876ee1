"""Runs Batch API jobs in the batch lane: each line becomes a request through the same code as
the HTTP endpoints, its result is committed as soon as it is known, and a job picks up where
it left off after a restart.

Servers that share a database share its jobs, and each job runs on one of them at a time: the
server running it holds a claim in the store and renews it every SWEEP seconds. Each sweep
also takes up unfinished jobs whose claim lapsed (their server died or stopped), and notices
jobs another server was asked to cancel. A claim names its server's host, process namespace and
pid, so a server restarted on the same host takes over at once from one that was killed there,
rather than after its lease.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable

from tollway.server.batch_store import BatchStore, new_id
from tollway.server.errors import APIError, error_body

Complete = Callable[[str, dict, str], Awaitable[dict]]
SWEEP = 10.0  # seconds between claim renewals
LEASE = 3 * SWEEP  # a claim not renewed for this long has lost its server

_log = logging.getLogger(__name__)


class BatchRunner:
    def __init__(self, store: BatchStore, complete: Complete, concurrency: int = 64):
        """complete(url, body, owner): the response body of one line, run as the request of the
        key that owns the batch (batch_store.owner), or raises APIError."""
        self.store, self.complete, self.concurrency = store, complete, concurrency
        self.owner = f"{_this_process()}/{uuid.uuid4().hex}"  # this server, in the claims it holds
        self._tasks: dict[str, asyncio.Task] = {}
        self._sweeper: asyncio.Task | None = None

    def resume(self) -> None:
        """Take up every unfinished job no other server is running, now and at every sweep."""
        self.sweep()
        self._sweeper = asyncio.create_task(self._sweep_while_running(), name="batch sweep")

    def start(self, batch_id: str) -> None:
        """Run the job here, unless another live server has claimed it."""
        if self.store.claim(batch_id, self.owner, time.time(), LEASE) or self._take_from_dead(batch_id):
            self._tasks[batch_id] = asyncio.create_task(self._run(batch_id), name=f"batch {batch_id}")

    def sweep(self) -> None:
        """Renew this server's claims, stop what another server was asked to cancel, and start
        the jobs whose claim lapsed."""
        for batch_id, status in self.store.unfinished().items():
            task = self._tasks.get(batch_id)
            if task is None or task.done():  # a task that ended with its job unfinished died: rerun it
                self.start(batch_id)
            elif status == "cancelling":
                task.cancel()  # _run finishes it as cancelled
            elif not self.store.claim(batch_id, self.owner, time.time(), LEASE):
                self._tasks.pop(batch_id).cancel()  # this server stalled past its lease: another took over

    def _take_from_dead(self, batch_id: str) -> bool:
        """Claim the job if its claim is held by a process of this host that no longer exists."""
        holder = self.store.claimant(batch_id)
        if holder is None or not _died_here(holder):
            return False
        self.store.release(batch_id, holder)
        return self.store.claim(batch_id, self.owner, time.time(), LEASE)  # False if a peer was quicker

    async def cancel(self, batch_id: str) -> dict:
        """Cancel the job; if another server runs it, that server stops it at its next sweep."""
        batch = self.store.update(batch_id, status="cancelling", cancelling_at=int(time.time()))
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()  # in-flight lines are aborted; what finished stays in the output
            try:
                await task
            except asyncio.CancelledError:
                pass
            self._finish_if_cancelling(batch_id)  # a task cancelled before it began never ran _run
        return self.store.batch(batch_id) or batch

    async def shutdown(self) -> None:
        tasks = [*self._tasks.values(), *([self._sweeper] if self._sweeper else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self.store.unclaim(self.owner)  # another server may take them up at its next sweep

    async def _sweep_while_running(self) -> None:
        while True:
            await asyncio.sleep(SWEEP)
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 -- the database is away: try again next sweep
                _log.exception("batch sweep failed")

    async def _run(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        if self._finish_if_cancelling(batch_id):
            return
        if batch["status"] == "validating":
            self.store.update(batch_id, status="in_progress", in_progress_at=int(time.time()))
        gate = asyncio.Semaphore(self.concurrency)
        owner = self.store.owner(batch_id)

        async def line(line_no: int, custom_id: str, url: str, body: dict) -> None:
            async with gate:
                try:
                    response = await self._complete_within_limits(url, body, owner)
                    result = {"status_code": 200, "request_id": response.get("id"), "body": response}
                    self.store.record(batch_id, line_no, True, _line(custom_id, result, None))
                except APIError as e:
                    result = {"status_code": e.status, "request_id": None,
                              "body": error_body(e.status, e.message, e.param, e.code)}
                    error = {"code": e.code or "invalid_request", "message": e.message}
                    self.store.record(batch_id, line_no, False, _line(custom_id, result, error))

        lines = asyncio.gather(*(line(*x) for x in self.store.pending_lines(batch_id)))
        try:
            # Past its completion window a batch expires; its in-flight lines are aborted.
            await asyncio.wait_for(lines, timeout=max(0.0, batch["expires_at"] - time.time()))
        except asyncio.CancelledError:
            self._finish_if_cancelling(batch_id)  # or it is a shutdown, or another server took over
            raise
        except TimeoutError:
            for line_no, custom_id, _, _ in self.store.pending_lines(batch_id):
                self.store.record(batch_id, line_no, False, _line(custom_id, None, _EXPIRED))
            self._finish(batch_id, "expired")
            return
        self._finish(batch_id, "completed")

    async def _complete_within_limits(self, url: str, body: dict, owner: str) -> dict:
        """A line refused by its key's rate limit waits for room and goes again: a batch is
        throttled to the key's rate, not failed by it."""
        while True:
            try:
                return await self.complete(url, body, owner)
            except APIError as e:
                if e.code != "rate_limit_exceeded" or "Retry-After" not in (e.headers or {}):
                    raise  # one that could never fit has no Retry-After
                await asyncio.sleep(int(e.headers["Retry-After"]))

    def _finish_if_cancelling(self, batch_id: str) -> bool:
        if self.store.batch(batch_id)["status"] != "cancelling":
            return False
        self._finish(batch_id, "cancelled")
        return True

    def _finish(self, batch_id: str, status: str) -> None:
        """status: completed, cancelled or expired."""
        now = int(time.time())
        self.store.update(batch_id, status="finalizing", finalizing_at=now)
        output, error = self.store.write_results(batch_id)
        self.store.update(batch_id, status=status, output_file_id=output, error_file_id=error, **{f"{status}_at": now})
        self._tasks.pop(batch_id, None)


# What OpenAI writes to the error file for each line an expired batch never ran.
_EXPIRED = {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}


def _this_process() -> str:
    """host/pid namespace/pid: two servers in different containers of one host differ in the
    namespace, so neither takes the other's pid for its own."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: the pid alone, on this host
        namespace = 0
    return f"{socket.gethostname()}/{namespace}/{os.getpid()}"


def _died_here(owner: str) -> bool:
    """True when `owner` (a claim's) was a process of this host and namespace that is gone.
    Anything else, including a claim of this very process or a pid now reused, counts as alive:
    its lease then decides."""
    host_ns_pid, _, _ = owner.rpartition("/")
    here, _, _ = _this_process().rpartition("/")
    where, _, pid = host_ns_pid.rpartition("/")
    if where != here or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, as another user's process
        return False
    return False


def _line(custom_id: str, response: dict | None, error: dict | None) -> dict:
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": response, "error": error}
