"""Engine: the synchronous step loop that ties scheduler, runner and text together."""
from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
import os
import time

import torch
from tqdm import tqdm

from tollway.config import EngineConfig, kv_pool_blocks
from tollway.model.host_memory import available_memory, return_freed_memory
from tollway.model.runner import ModelRunner, kv_dtype_for
from tollway.text.tokenizer import IncrementalDetokenizer
from tollway.model.grammar import Grammars
from tollway.output_follower import TextAndGrammar
from tollway.model.kernel_profile import cached_int8_crossover
from tollway.model.measured import remembered
from tollway.model.native.early_builds import start_native_builds
from tollway.model.step_profile import profile_key, profile_step_times, samples_from_json, samples_to_json
from tollway.checkpoint import cache_root, derived_cache_file
from tollway.model.weights import LoadedModel, load_weights
from tollway.outputs import RequestOutput
from tollway.request import InvalidRequest, Request, SamplingParams, Submission
from tollway.scheduler.occupancy import Occupancy
from tollway.scheduler.plan import StepPlan, StepResult
from tollway.scheduler.scheduler import Scheduler
from tollway.scheduler.step_model import StepTimeModel
from tollway.step_report import StepReport
from tollway.text.stream import TextStream


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but no CUDA GPU is available")
    return torch.device(name)


def device_memory(device: torch.device) -> int:
    """Bytes of memory on `device` (RAM for the CPU), which a kv_cache_memory share is of."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _refuse_what_cannot_fit(loaded: LoadedModel, sched, kv_itemsize: int) -> None:
    """ValueError, before any weight is packed or KV page taken, where the weights and the KV pool
    need more memory than the machine has available: refused at start, not killed halfway."""
    available = available_memory()
    kv = sched.num_blocks * sched.block_size * loaded.config.kv_bytes_per_token(kv_itemsize)
    need = loaded.resident_bytes(packed="q8" in sched.kernels_to_load()) + kv
    if available is not None and need > available:
        raise ValueError(f"{loaded.source}: needs {need / 2**30:.1f} GiB ({kv / 2**30:.1f} of them the KV cache), "
                         f"{available / 2**30:.1f} GiB available")


class Engine:
    def __init__(self, config: EngineConfig | None = None, progress: bool = True, loaded: LoadedModel | None = None):
        """`loaded` reuses weights already in memory (tests build several engines on one model)."""
        config = config or EngineConfig()
        sched = config.scheduler
        sched.validate()
        started = time.perf_counter()
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        if self.device.type == "cpu":
            start_native_builds(config.cache_dir)  # compiled beside the load, on a machine's first start
        with tqdm(total=4, desc="loading model", unit="stage", disable=not progress, leave=False) as bar:
            loaded = loaded or load_weights(config.model, cache_dir=config.cache_dir)
            bar.update()
            self.model_config = loaded.config
            if self.device.type == "cuda" and sched.kernel == "auto":
                sched.int8_max_tokens, sched.dense_kernel = 0, "bf16"  # the int8 matmul here is a CPU kernel
            if config.kv_cache_memory is not None:
                kv_dtype = kv_dtype_for(self.device, config.kv_cache_dtype, sched.kernels_to_load())
                sched.num_blocks = kv_pool_blocks(config.kv_cache_memory, device_memory(self.device),
                                                  self.model_config.kv_bytes_per_token(kv_dtype.itemsize),
                                                  sched.block_size)
            sched.fit_context(self.model_config.max_position_embeddings)
            sched.validate()
            if self.device.type == "cpu":
                _refuse_what_cannot_fit(loaded, sched, kv_dtype_for(self.device, config.kv_cache_dtype,
                                                                   sched.kernels_to_load()).itemsize)
            with ThreadPoolExecutor(1) as pool:
                # Converting (a GGUF's first load) and parsing the tokenizer overlap with building the runner.
                tokenizer = pool.submit(loaded.load_tokenizer, config.chat_template)
                self.runner = ModelRunner(
                    self.model_config, loaded.tensors, sched, self.device, sched.kernels_to_load(),
                    int8_cache=derived_cache_file(loaded.source, config.cache_dir, "int8.safetensors"),
                    cache_dir=config.cache_dir, kv_cache_dtype=config.kv_cache_dtype)
                loaded.release_pages()  # packed now: the file's pages are read again only for embedding rows
                bar.update()
                if sched.kernel == "auto" and sched.int8_max_tokens is None:
                    bar.set_description("int8/dense crossover")
                    sched.int8_max_tokens = cached_int8_crossover(
                        self.runner.model, sched.dense_kernel, cache_root(config.cache_dir) / "kernel-profile.json",
                        key=str(loaded.source))
                self.tokenizer = tokenizer.result()
                if self.tokenizer is not None:
                    self.runner.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
            bar.update()
            self.step_model = None
            if config.profile_steps:  # after the tokenizer thread: it would skew the timings
                bar.set_description("profiling steps")
                samples = remembered(
                    cache_root(config.cache_dir) / "step-profile.json",
                    f"{loaded.source}|{self.runner.model.ops.build}|{self.runner.kv_dtype}|{profile_key(sched)}",
                    lambda: samples_to_json(profile_step_times(self.runner, sched, progress=progress)))
                self.step_model = StepTimeModel.fit(samples_from_json(samples))
            bar.update()
        self.config = config
        sched.pause_layers = self.model_config.num_layers if sched.pause_for_fast and self.runner.model.ops.pauses else 0
        self.scheduler = Scheduler(sched, self.step_model)
        self._ids = itertools.count()
        self.load_seconds = time.perf_counter() - started
        self._paused_plan: StepPlan | None = None  # the plan of the step paused between layers
        self._fast_turn = False  # beside a paused step: a fast step goes next (else the paused step)
        self.steps_paused = 0  # steps that stopped for a fast arrival
        self._abort_after_paused: set[str] = set()  # requests of the paused step withdrawn meanwhile
        # The file's metadata (a vocabulary's strings) goes before the heap is trimmed: what the
        # engine keeps of a load is its tensors.
        del loaded, tokenizer
        # What loading built lives as long as the engine: frozen out of the collector's way, so
        # full collections mid-run skip the tokenizer's tables, which they would walk every time.
        gc.freeze()
        return_freed_memory()

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, tier: str = "standard",
                    request_id: str | None = None) -> str:
        """The Python caller's edge: text or token ids, checked, then submitted."""
        return self.submit(self.check(prompt, params or SamplingParams()), tier, request_id)

    def check(self, prompt: str | list[int], params: SamplingParams) -> Submission:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt token ids instead of text")
            prompt = self.tokenizer.encode(prompt)
        return Submission.check(list(prompt), params, self.model_config.vocab_size, self.max_model_len)

    def submit(self, submission: Submission, tier: str = "standard", request_id: str | None = None,
               tab: object | None = None, listener: Callable[[RequestOutput], None] | None = None) -> str:
        """A request checked at the edge, taken on trust; the scheduler still refuses what only it
        knows (QueueFullError, or InvalidRequest where a lane's KV share cannot hold the prompt).
        `tab`: the meter's, charged each step the request is in (meter/tab.py); `listener`: called
        with each of its outputs as it is made, the last included, on the engine thread."""
        params = submission.params
        grammar = None
        if params.grammar is not None:
            if self.runner.grammars is None:
                raise InvalidRequest("this model has no tokenizer, so it cannot follow a grammar", "response_format")
            grammar = self.runner.grammars.start(params.grammar)
        request = Request(request_id or f"req-{next(self._ids)}", submission.prompt_token_ids, params, tier=tier,
                          eos_token_ids=tuple(self.tokenizer.eos_token_ids if self.tokenizer else ()), grammar=grammar,
                          tab=tab, listener=listener)
        if self.tokenizer is not None or grammar is not None:
            stream = TextStream(IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
                                params.stop, params.include_stop_str_in_output) if self.tokenizer else None
            request.follower = TextAndGrammar(stream, grammar)
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Withdraw an unfinished request, waiting or running: its blocks and slot are freed
        now. Returns its final output (finish_reason "abort"), which ends it as a finish would;
        None if no unfinished request has this id (it finished already, or was never added).
        A request in a step paused between layers is withdrawn once that step ends (None now;
        its final output comes with the step's): the step still writes its KV, and its share
        of the step is billed to it, as of any step it was in."""
        if self._paused_plan is not None and any(s.request_id == request_id for s in self._paused_plan.seqs) \
                and self.scheduler.get(request_id) is not None:
            self._abort_after_paused.add(request_id)
            return None
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return self._output(request, [], time.monotonic())

    def abort_all(self) -> list[RequestOutput]:
        """abort() of every unfinished request: the final outputs of those withdrawn now."""
        return [out for out in map(self.abort, self.scheduler.request_ids()) if out is not None]

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or a paused step to end (its requests may all have been
        aborted meanwhile, but it holds their blocks until it ends)."""
        return self.scheduler.has_unfinished() or self.runner.paused_step is not None

    # -- what the server and the fleet read (on the engine thread: AsyncEngine.run or an observer) --
    @property
    def max_model_len(self) -> int:
        """The longest context a request may reach: prompt plus output tokens."""
        return self.config.scheduler.max_model_len

    def occupancy(self) -> Occupancy:
        return Occupancy.of(self.scheduler)

    def running(self) -> list[Request]:
        """The requests running, in admission order."""
        return list(self.scheduler.running.values())

    def unfinished(self) -> list[Request]:
        """Every request waiting or running."""
        return [self.scheduler.get(rid) for rid in self.scheduler.request_ids()]

    def tier_of(self, request_id: str) -> str | None:
        """The lane of an unfinished request; None for an unknown or finished one."""
        request = self.scheduler.get(request_id)
        return request.tier if request is not None else None

    def outstanding_tokens(self) -> int:
        """Prompt tokens still to prefill plus output tokens still allowed (max_tokens) over
        every unfinished request: the work queued here, in tokens."""
        total = 0
        for request_id in self.scheduler.request_ids():
            r = self.scheduler.get(request_id)
            total += max(0, len(r.prompt_token_ids) - r.num_computed_tokens)
            total += max(0, r.params.max_tokens - len(r.output_token_ids))
        return total

    def unstarted(self) -> list[Request]:
        """Every waiting request that has never run: refusing one loses no work (a preempted
        request has run, and has output or cache to show for it)."""
        return [r for q in self.scheduler.waiting.values() for r in q
                if not r.num_preemptions and not r.output_token_ids and not r.num_computed_tokens]

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """One step: its plan, result and outputs. A step without a fast request may stop
        between two layers where the runner's step_yield asks (a fast request arrived: the
        server asks as it hands one over); its report is then `paused`, with no plan, and the
        next calls run fast steps beside it and it in slices, turn about, until it ends (see
        _beside_paused)."""
        if self.runner.paused_step is not None:
            return self._beside_paused()
        plan = self.scheduler.plan()
        if not plan.seqs:
            return self._report(None, None, [])
        result = self.runner.execute(plan, pausable=self.scheduler.may_pause(plan))
        if result is None:
            self.scheduler.suspend()
            self._paused_plan, self._fast_turn = plan, True
            self.steps_paused += 1
            return self._report(None, None, [], paused=True)
        return self._commit(plan, result)

    def _beside_paused(self) -> StepReport:
        """A step paused between layers: first a step of the fast requests not in it (the
        scheduler plans only those while it is suspended); then the paused step runs on, while
        fast requests run only until the next of their tokens is due (the fast TPOT target
        after the last one, less the fast step's own time), and on to its end once none do."""
        pause = self.runner.step_yield
        if self._fast_turn:
            self._fast_turn = False
            plan = self.scheduler.plan()
            if plan.seqs:
                result = self.runner.execute(plan)
                report = self._commit(plan, result)
                tpot = self.scheduler.tiers["fast"].tpot_target
                fast_running = tpot is not None and self.scheduler.running_in("fast")
                pause.deadline = time.monotonic() + max(0.0, tpot - result.seconds) if fast_running else None
                return report
            pause.deadline = None
        result = self.runner.resume()
        if result is None:  # another slice of the paused step; it was counted when it first stopped
            self._fast_turn = True
            return self._report(None, None, [])
        pause.deadline = None
        self.scheduler.resume()
        plan, self._paused_plan = self._paused_plan, None
        withdrawn, self._abort_after_paused = self._abort_after_paused, set()
        return self._commit(plan, result, withdrawn)

    def _commit(self, plan: StepPlan, result: StepResult, withdraw: set[str] = frozenset()) -> StepReport:
        """`withdraw`: requests aborted while the step ran, withdrawn once it has committed."""
        now = time.monotonic()
        changes = self.scheduler.commit(plan, result)  # several tokens each where drafts held
        outputs = [self._output(req, new_ids, now) for req, new_ids in changes]
        outputs += [out for out in map(self.abort, sorted(withdraw)) if out is not None]
        return self._report(plan, result, outputs)

    def _report(self, plan: StepPlan | None, result: StepResult | None, outputs: list[RequestOutput],
                paused: bool = False) -> StepReport:
        preempted = tuple(t for t in map(self.tier_of, plan.preempted) if t is not None) \
            if plan is not None and plan.preempted else ()
        return StepReport(plan, result, outputs, self.occupancy(), preempted, self.step_model, paused)

    def _output(self, req: Request, new_ids: list[int], now: float) -> RequestOutput:
        """The request's output as of now; the last one when it has finished."""
        finished = req.finished
        out = RequestOutput(
            request_id=req.request_id, tier=req.tier, prompt_token_ids=req.prompt_token_ids,
            new_token_ids=new_ids, new_logprobs=req.output_logprobs[-len(new_ids):] if new_ids else [],
            num_output_tokens=len(req.output_token_ids),
            token_ids=req.output_token_ids if finished else [], logprobs=req.output_logprobs if finished else [],
            finished=finished, finish_reason=req.finish_reason,
            num_cached_prompt_tokens=req.num_cached_prompt_tokens, arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time, first_token_time=req.first_token_time,
            time=now, previous_token_time=req.last_output_time, num_steps=req.num_steps,
            steps_to_first_token=req.steps_to_first_token,
        )
        if req.params.prompt_logprobs is not None and (finished or len(new_ids) == len(req.output_token_ids) > 0):
            out.prompt_logprobs = [None, *req.prompt_logprobs]
        if new_ids:
            req.last_output_time = now
        stream = req.follower.stream if req.follower is not None else None
        if stream is not None:
            out.new_text = stream.release(finished)
            if finished:
                out.text = stream.text[: stream.released]
        if req.listener is not None:
            req.listener(out)
        return out
