"""When each waiting batch request falls due, kept in a heap: a step finds the ones that have
come due in O(due log n) rather than scanning a batch queue that may hold 100k requests."""
from __future__ import annotations

import heapq
import itertools


class Deadlines:
    def __init__(self):
        self._heap: list[tuple[float, int, str]] = []
        self._due_at: dict[str, float] = {}  # the live entry per request; others in the heap are stale
        self._order = itertools.count()  # ties go first come, first served

    def __len__(self) -> int:
        return len(self._due_at)

    def set(self, request_id: str, due: float) -> None:
        self._due_at[request_id] = due
        heapq.heappush(self._heap, (due, next(self._order), request_id))

    def discard(self, request_id: str) -> None:
        self._due_at.pop(request_id, None)
        # Stale entries are dropped when popped; a batch window can be a day, so do not let them
        # pile up that long.
        if len(self._heap) > 2 * len(self._due_at) + 64:
            self._heap = [(due, n, rid) for due, n, rid in self._heap if self._due_at.get(rid) == due]
            heapq.heapify(self._heap)

    def pop_due(self, now: float) -> list[str]:
        """The requests due by `now`, earliest first; they are no longer tracked."""
        due_now = []
        while self._heap and self._heap[0][0] <= now:
            due, _, rid = heapq.heappop(self._heap)
            if self._due_at.get(rid) == due:
                del self._due_at[rid]
                due_now.append(rid)
        return due_now
