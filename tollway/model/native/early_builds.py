"""Starting every native source's build at the start of a load.

On a machine's first start the compiles take seconds each; started together at once,
they run beside one another and beside reading the model and converting its tokenizer, and
the parts of the load that need a library join its build (build.start_build)."""
from __future__ import annotations

import os

from tollway.checkpoint import cache_root
from tollway.model.native.build import native_code_enabled
from tollway.model.native.qmatmul import q8_build
from tollway.model.row_ops import row_ops_build
from tollway.model.sampling import sampling_build
from tollway.model.sentencepiece_bpe import sentencepiece_build


def start_native_builds(cache_dir: str | os.PathLike | None = None) -> None:
    """Starts the builds a CPU engine will ask for; a cached build is found in moments."""
    if not native_code_enabled():
        return
    q8_build(cache_dir)
    sentencepiece_build(cache_dir)
    # A forced instruction set builds the other sources for that CPU kind (build.native_flags),
    # known once the q8 library says what this CPU runs best: those builds then start on demand.
    if not os.environ.get("TOLLWAY_ISA"):
        row_ops_build(cache_root(cache_dir) / "native")
        sampling_build(cache_dir, None)
