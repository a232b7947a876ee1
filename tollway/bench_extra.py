"""What `tollway bench`, `compare`, `report` of bench files and the simulator need beyond the
server: the `bench` extra. The server never imports them, so a plain install leaves them out."""
from __future__ import annotations

import importlib

PACKAGES = ("aiohttp", "rich", "matplotlib")  # the HTTP client, the live view, the report's plots
COMMANDS = ("bench", "compare", "simulate", "plan", "advise")


def check_bench_extra(command: str) -> None:
    """A one-line error naming the extra, before the command imports what is missing."""
    missing = [name for name in PACKAGES if not _importable(name)]
    if missing:
        raise ValueError(f"tollway {command} needs the bench extra ({', '.join(missing)} missing): "
                         "pip install 'tollway[bench]'")


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
