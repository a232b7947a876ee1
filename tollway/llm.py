"""The offline Python API: LLM(model=...).generate(prompts, SamplingParams)."""
from __future__ import annotations

import dataclasses

import torch
from tqdm import tqdm

from tollway.config import EngineConfig, SchedulerConfig
from tollway.engine import Engine
from tollway.outputs import RequestOutput
from tollway.request import SamplingParams

_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"scheduler", "model"}


class LLM:
    """LLM(model=None, kernel="auto", max_num_seqs=64, ...): any EngineConfig or SchedulerConfig field."""

    def __init__(self, model: str | None = None, progress: bool = True, **options):
        unknown = set(options) - _SCHEDULER_FIELDS - _ENGINE_FIELDS
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
        sched = SchedulerConfig(**{k: v for k, v in options.items() if k in _SCHEDULER_FIELDS})
        config = EngineConfig(model=model or EngineConfig.model, scheduler=sched,
                              **{k: v for k, v in options.items() if k in _ENGINE_FIELDS})
        self.engine = Engine(config, progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        # inference mode once for the loop, not once a step (ModelRunner.execute)
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate", unit="req") as bar, torch.inference_mode():
            while len(results) < len(ids):
                if not self.engine.has_unfinished():
                    raise RuntimeError("the engine stopped with requests unfinished")
                for out in self.engine.step().outputs:
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]
