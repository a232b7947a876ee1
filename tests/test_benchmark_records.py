"""The benchmarks' records: a run with tollway forced to a lower instruction set (TOLLWAY_ISA)
never stands for this CPU's own record, and says how it ran."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import common  # noqa: E402
from tollway.model.native.qmatmul import q8_library  # noqa: E402

pytestmark = pytest.mark.skipif(q8_library() is None, reason="no C compiler: tollway runs no native kernels to force")


def test_a_run_forced_to_a_lower_path_keeps_a_record_of_its_own(monkeypatch):
    monkeypatch.delenv("TOLLWAY_ISA", raising=False)
    own = common.cpu_kind_suffix()
    assert "forced" not in own and common.command_line("engine.py") == "python benchmarks/engine.py"
    best = q8_library().supported[-1]
    monkeypatch.setenv("TOLLWAY_ISA", best)  # forcing the best path is no forcing
    assert common.forced_isa() is None and common.cpu_kind_suffix() == own
    if best != "portable":
        monkeypatch.setenv("TOLLWAY_ISA", "portable")
        assert common.forced_isa() == "portable" and common.cpu_kind_suffix() == "-forced-portable"
        assert common.command_line("engine.py", " --quick") == "TOLLWAY_ISA=portable python benchmarks/engine.py --quick"
        assert common.machine_info()["forced_isa"] == "portable"
    for wrong in ("sse9", "avx512vnni" if best != "avx512vnni" else None):
        if wrong:
            monkeypatch.setenv("TOLLWAY_ISA", wrong)
            with pytest.raises(SystemExit, match=f"TOLLWAY_ISA={wrong}: .*this CPU runs: portable"):
                common.forced_isa()
