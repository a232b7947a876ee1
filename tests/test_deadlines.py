"""The heap of batch deadlines: what comes due, in order, and nothing stale."""
from tollway.scheduler.deadlines import Deadlines


def test_requests_come_due_in_order_and_only_once():
    d = Deadlines()
    for rid, due in [("c", 30.0), ("a", 10.0), ("b", 20.0), ("a2", 10.0)]:
        d.set(rid, due)
    assert d.pop_due(5.0) == []
    assert d.pop_due(20.0) == ["a", "a2", "b"]  # ties first come, first served
    assert d.pop_due(20.0) == []
    assert len(d) == 1 and d.pop_due(100.0) == ["c"]


def test_a_discarded_or_moved_deadline_does_not_fire():
    d = Deadlines()
    d.set("gone", 1.0)
    d.set("moved", 2.0)
    d.discard("gone")
    d.set("moved", 50.0)  # e.g. preempted after some progress: due at a new time
    assert d.pop_due(10.0) == []
    assert d.pop_due(50.0) == ["moved"]
    d.discard("never-set")  # harmless


def test_stale_entries_do_not_pile_up():
    d = Deadlines()
    for i in range(10_000):
        d.set(f"r{i}", 1e6 + i)
        if i % 10:
            d.discard(f"r{i}")
    assert len(d) == 1000
    assert len(d._heap) <= 2 * len(d) + 64
    assert d.pop_due(2e6) == [f"r{i}" for i in range(0, 10_000, 10)]
