"""Measurements that depend only on the model and the machine, taken once and remembered.

Keyed by the model, the CPU (or GPU) name, the thread count and the torch version, so a
different machine or setting measures afresh. The file is safe to delete.
"""
from __future__ import annotations

import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def remembered(cache_file: Path, key: str, measure: Callable[[], Any]) -> Any:
    """measure()'s JSON-able result for `key` on this machine, measured at most once."""
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    entry = f"{key}|{device_name()}|{torch.get_num_threads()}|{torch.__version__}"
    if entry not in known:
        known[entry] = measure()
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache_file)
    return known[entry]


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    # Not platform.processor(): it runs `uname -p` in a subprocess.
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.machine()
