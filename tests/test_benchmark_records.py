"""The benchmarks' records: a run with tollway forced to a lower instruction set (TOLLWAY_ISA)
never stands for this CPU's own record, and says how it ran."""
from __future__ import annotations

import subprocess
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


@pytest.mark.slow  # a process of its own
def test_a_run_forced_to_avx2_runs_torch_as_an_avx2_cpu_would(monkeypatch):
    """transformers and the torch floors are what a forced run stands against: on an AVX-512 CPU
    they must not keep AVX-512 (nor its bf16) while tollway's kernels are held to AVX2."""
    def run() -> str:  # what torch runs in a fresh benchmark process
        probe = "import common, torch; print(torch.backends.cpu.get_cpu_capability())"
        return subprocess.run([sys.executable, "-c", probe], cwd=Path(common.__file__).parent, capture_output=True,
                              text=True, check=True).stdout.strip()

    for name in common.TORCH_LIMITS["avx2"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TOLLWAY_ISA", raising=False)
    own = run()
    monkeypatch.setenv("TOLLWAY_ISA", "avx2")
    assert run() == ("AVX2" if own in ("AVX2", "AVX512") else own)
