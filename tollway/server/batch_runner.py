"""Runs Batch API jobs in the batch lane: each line becomes a request through the same code as
the HTTP endpoints, its result is committed as soon as it is known, and a job picks up where
it left off after a restart."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from tollway.server.batch_store import BatchStore, new_id
from tollway.server.errors import APIError, error_body

Complete = Callable[[str, dict], Awaitable[dict]]


class BatchRunner:
    def __init__(self, store: BatchStore, complete: Complete, concurrency: int = 64):
        """complete(url, body): the response body of one line, or raises APIError."""
        self.store, self.complete, self.concurrency = store, complete, concurrency
        self._tasks: dict[str, asyncio.Task] = {}

    def resume(self) -> None:
        """Restart every job a previous server left unfinished."""
        for batch_id in self.store.unfinished():
            self.start(batch_id)

    def start(self, batch_id: str) -> None:
        self._tasks[batch_id] = asyncio.create_task(self._run(batch_id), name=f"batch {batch_id}")

    async def cancel(self, batch_id: str) -> dict:
        batch = self.store.update(batch_id, status="cancelling", cancelling_at=int(time.time()))
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()  # in-flight lines are aborted; what finished stays in the output
            try:
                await task
            except asyncio.CancelledError:
                pass
            self._finish(batch_id, "cancelled")
        return self.store.batch(batch_id) or batch

    async def shutdown(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _run(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        if batch["status"] == "cancelling":
            self._finish(batch_id, "cancelled")
            return
        if batch["status"] == "validating":
            self.store.update(batch_id, status="in_progress", in_progress_at=int(time.time()))
        gate = asyncio.Semaphore(self.concurrency)

        async def line(line_no: int, custom_id: str, url: str, body: dict) -> None:
            async with gate:
                try:
                    response = await self.complete(url, body)
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
        except TimeoutError:
            for line_no, custom_id, _, _ in self.store.pending_lines(batch_id):
                self.store.record(batch_id, line_no, False, _line(custom_id, None, _EXPIRED))
            self._finish(batch_id, "expired")
            return
        self._finish(batch_id, "completed")

    def _finish(self, batch_id: str, status: str) -> None:
        """status: completed, cancelled or expired."""
        now = int(time.time())
        self.store.update(batch_id, status="finalizing", finalizing_at=now)
        output, error = self.store.write_results(batch_id)
        self.store.update(batch_id, status=status, output_file_id=output, error_file_id=error, **{f"{status}_at": now})
        self._tasks.pop(batch_id, None)


# What OpenAI writes to the error file for each line an expired batch never ran.
_EXPIRED = {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}


def _line(custom_id: str, response: dict | None, error: dict | None) -> dict:
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": response, "error": error}
