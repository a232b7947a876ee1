"""The simulator runs the real Scheduler on a machine profile: deterministic for a seed, more
replicas never lose throughput, traces are honoured, the planner's choice holds when
re-simulated, and analytic profiles are labelled estimates."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tollway.cli import main
from tollway.config import SchedulerConfig
from tollway.model_config import ModelConfig
from tollway.scheduler.machine_profile import MachineProfile
from tollway.sim.hardware import HARDWARE, analytic_profile, step_seconds
from tollway.sim.planner import candidate_config, plan
from tollway.sim.simulator import simulate
from tollway.traffic.patterns import Limits, LoadPattern
from tollway.traffic.stats import SLO
from tollway.traffic.workload import Lengths, Workload


def linear_profile(fixed=0.02, per_token=0.0005, per_row=0.002, jitter=(0.95, 1.0, 1.1)) -> MachineProfile:
    """A machine whose fp32 steps cost fixed + per token + per sampled row (exactly linear)."""
    samples = []
    for tokens in (1, 4, 16, 64, 128, 256, 512):
        for sampled in {1, min(tokens, 64)}:
            for pairs in (0.1, 10.0, 100.0):
                samples.append(["fp32", tokens, sampled, pairs, int(tokens > sampled),
                                fixed + per_token * tokens + per_row * sampled + 1e-5 * pairs])
    return MachineProfile("test machine", "test-model", samples, int8_max_tokens=0, dense_kernel="fp32",
                          estimate=False, overhead=[0.001, 0.0001], jitter=list(jitter), usd_per_hour=2.0)


def workload(mix=None, seed=5, prompt=64, output=32) -> Workload:
    return Workload(Lengths(prompt, 16, 16, 256), Lengths(output, 8, 4, 64), True,
                    mix or {"fast": 0.1, "standard": 0.8, "batch": 0.1}, None, seed)


def config(**overrides) -> SchedulerConfig:
    return SchedulerConfig(**{"num_blocks": 4096, "max_num_seqs": 64, **overrides})


def run(profile=None, replicas=1, load=None, requests=300, routing="least_outstanding", **options) -> dict:
    return simulate(config(), profile or linear_profile(), options.pop("work", workload()),
                    [load or LoadPattern("rate 20/s", rate=20.0)], Limits(max_requests=requests), replicas, routing,
                    progress=False, **options)


def test_the_same_seed_gives_the_same_run_and_another_seed_does_not():
    a, b = run(), run()
    strip = lambda r: [(x["tier"], x["sent"], x["first_token"], x["end"]) for x in r["stages"][0]["requests"]]  # noqa: E731
    assert strip(a) == strip(b) and len(strip(a)) == 300
    assert strip(run(work=workload(seed=6))) != strip(a)
    summary = a["stages"][0]["summary"]
    assert set(summary["tiers"]) == {"fast", "standard", "batch"} and summary["all"]["completed"] == 300
    assert a["simulation"]["steps"] > 0 and a["stages"][0]["steps"]


def test_more_replicas_never_lower_throughput_on_a_saturating_load():
    saturating = LoadPattern("rate 200/s", rate=200.0)  # far past one replica's few tens of requests/s
    throughput = [run(replicas=n, load=saturating, requests=400)["stages"][0]["summary"]["all"]["output_tok_s"]
                  for n in (1, 2, 4)]
    assert throughput[0] <= throughput[1] <= throughput[2]
    assert throughput[2] > 1.5 * throughput[0]


@pytest.mark.parametrize("routing", ["round_robin", "least_outstanding", "tier_aware"])
def test_every_routing_spreads_work_over_the_replicas(routing):
    result = run(replicas=3, routing=routing, requests=200, load=LoadPattern("rate 60/s", rate=60.0))
    assert result["stages"][0]["summary"]["all"]["completed"] == 200
    assert result["simulation"]["routing"] == routing


def test_the_simulated_lanes_make_fast_faster_and_fcfs_does_not():
    """The real scheduler's policy is what the simulator runs: lanes shape steps for fast, fcfs not."""
    profile = linear_profile(per_row=0.01)  # 48 decodes take ~0.5 s, four times fast's 120 ms target
    busy = LoadPattern("concurrency 48", concurrency=48)

    def fast_over_standard(policy):
        tiers = simulate(config(policy=policy), profile, workload(), [busy], Limits(max_requests=400),
                         progress=False)["stages"][0]["summary"]["tiers"]
        return tiers["fast"]["tok_s_per_user"]["mean"] / tiers["standard"]["tok_s_per_user"]["mean"]

    assert fast_over_standard("lanes") > 1.5
    assert fast_over_standard("fcfs") < 1.2


def test_a_trace_is_played_at_its_arrival_times(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"arrival": 0.5 * i, "tier": "fast" if i % 3 == 0 else "standard", "prompt_tokens": 20 + i,
             "output_tokens": 5} for i in range(12)]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    assert main(["simulate", "--profile", str(_saved(tmp_path)), "--trace", str(trace), "--output", str(out),
                 "--quiet"]) == 0
    records = json.loads((out / "bench.json").read_text())["stages"][0]["requests"]
    assert [r["sent"] for r in records] == pytest.approx([r["arrival"] for r in rows])
    assert [r["prompt_tokens"] for r in records] == [r["prompt_tokens"] for r in rows]
    assert all(r["output_tokens"] == 5 and r["end"] > r["sent"] for r in records)
    assert (out / "report.html").is_file()


def test_a_simulated_run_overlays_a_measured_one_in_one_report(tmp_path):
    """`tollway report` merges a simulated bench.json with a measured one (the committed example
    sweep): every plot draws both runs, each under its own label."""
    measured = Path(__file__).resolve().parent.parent / "benchmarks" / "bench-example" / "bench.json"
    sim = tmp_path / "sim"
    assert main(["simulate", "--profile", str(_saved(tmp_path)), "--concurrency", "16", "--max-requests", "40",
                 "--prompt-tokens", "mean=96,stdev=32,min=32,max=160", "--output-tokens", "32",
                 "--mix", "fast=0.2,standard=0.8", "--label", "simulated example", "--output", str(sim),
                 "--quiet"]) == 0
    merged = tmp_path / "merged"
    assert main(["report", str(measured), str(sim / "bench.json"), "--output", str(merged)]) == 0
    page = (merged / "report.html").read_text()
    for key in ("latency", "pareto", "cost", "steps"):
        figure = page[page.index(f"id='plot-{key}'"):]
        figure = figure[:figure.index("</figure>")]
        assert "data-drawn='1'" in figure, key
        assert "(tollway (example))" in figure and "(simulated example)" in figure, key


def test_only_the_first_requests_keep_every_token_time():
    records = run(requests=40, token_times=10)["stages"][0]["requests"]
    assert all(len(r["chunk_times"]) == r["output_tokens"] for r in records if r["index"] <= 10)
    assert all(r["chunk_times"] == [] and r["end"] > r["first_token"] for r in records if r["index"] > 10)


def test_simulated_engine_seconds_split_the_busy_time():
    result = run(requests=200)
    records = result["stages"][0]["requests"]
    assert all(r["engine_seconds"] > 0 for r in records)
    # Attributed runner time is at most the busy time (which also counts the engine's overhead).
    assert sum(r["engine_seconds"] for r in records) <= result["simulation"]["busy_seconds"]


def test_capacity_held_for_the_fast_lane_is_charged_to_fast_requests_as_the_meter_does():
    profile = linear_profile(jitter=(1.0,))
    profile.overhead = [0.0, 0.0]  # every busy second is then runner time, all of it attributed
    result = run(profile, requests=300, work=workload({"fast": 0.3, "standard": 0.7}))
    sim, records = result["simulation"], result["stages"][0]["requests"]
    assert any(r["tier"] == "fast" for r in records)
    # Every second is someone's: the requests' charges, plus the readiness held after the
    # last fast request, which no one came to pay. Dropping readiness (as before) broke this.
    charged = sum(r["engine_seconds"] for r in records)
    assert charged + sim["readiness_seconds"] == pytest.approx(sim["busy_seconds"], rel=1e-9)


def test_the_planners_choice_meets_the_slos_when_simulated_again():
    slo = SLO.parse("ttft=2s,tpot=200ms,fast:tpot=60ms")
    ranked = plan(config(), linear_profile(), workload(), qps=30.0, slo=slo, attainment=0.95, requests=300,
                  max_replicas=16, batch_caps=(32, 64), reserves=(0.125,), progress=False)
    chosen = ranked[0]
    assert chosen.meets and chosen.usd_per_hour == 2.0 * chosen.replicas
    cfg = candidate_config(config(), slo, chosen.max_num_seqs, chosen.fast_reserved_seq_share)
    assert cfg.tiers["fast"].tpot_target == 0.06 and cfg.tiers["standard"].tpot_target == 0.2
    again = simulate(cfg, linear_profile(), workload(seed=9), [LoadPattern("rate 30/s", rate=30.0)],
                     Limits(max_requests=300), chosen.replicas, "tier_aware", slo, progress=False)
    for tier, m in again["stages"][0]["summary"]["tiers"].items():
        assert m["goodput_share"] >= 0.9, tier  # a different seed: near the 95% it was chosen at
    if chosen.replicas > 1:  # one replica fewer fails: the planner found the fewest
        fewer = plan(config(), linear_profile(), workload(), qps=30.0, slo=slo, attainment=0.95, requests=300,
                     max_replicas=chosen.replicas - 1, batch_caps=(chosen.max_num_seqs,),
                     reserves=(chosen.fast_reserved_seq_share,), progress=False)
        assert not fewer[0].meets


GEMMA_270M = ModelConfig("gemma3", 262144, 640, 2048, 18, 4, 1, 256, 1e-6, 1e6, 32768, True, "gelu_tanh",
                         ["full"] * 18)


def test_analytic_profiles_follow_the_specs_and_say_they_are_estimates():
    h200, a100, l4 = (HARDWARE[n] for n in ("H200", "A100", "L4"))
    decode = lambda h, b: step_seconds(GEMMA_270M, h, b, b, b * 512.0)  # noqa: E731
    assert decode(h200, 1) < decode(a100, 1) < decode(l4, 1)  # bandwidth-bound: by memory bandwidth
    assert decode(h200, 64) < 64 * decode(h200, 1)  # batching is nearly free while memory-bound
    profile = analytic_profile(GEMMA_270M, "gemma3-270m", h200)
    assert profile.kv_tokens > analytic_profile(GEMMA_270M, "gemma3-270m", a100).kv_tokens > 0  # 141 GB vs 80
    assert profile.estimate and profile.dense_kernel == "bf16" and profile.usd_per_hour == h200.usd_per_hour
    result = run(profile, requests=100)
    assert "(estimate)" in result["label"] and result["simulation"]["estimate"]


def test_bad_simulator_input_gets_one_line_errors(tmp_path, capsys):
    cases = [(["simulate", "--rate", "1", "--max-requests", "1"], "--profile or --hardware"),
             (["simulate", "--hardware", "Z80", "--rate", "1", "--max-requests", "1"], "unknown hardware"),
             (["simulate", "--profile", str(tmp_path / "none.json"), "--rate", "1", "--max-requests", "1"],
              "cannot read the profile"),
             (["simulate", "--profile", str(_saved(tmp_path)), "--rate", "1", "--max-requests", "1", "--replicas",
               "0"], "--replicas"),
             (["plan", "--profile", str(_saved(tmp_path)), "--qps", "0", "--slo", "ttft=1s"], "--qps")]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("tollway: error:") and message in err and "\n" not in err, err


def _saved(tmp_path):
    path = tmp_path / "profile.json"
    linear_profile().save(path)
    return path


def test_the_servers_time_per_call_delays_what_the_scheduler_sees_and_what_the_client_sees():
    """A served profile's calls: the scheduler takes a call `intake` after it was sent, and the
    client has each token `delivery` after it was made; a lane with none draws any lane's."""
    import dataclasses

    from tollway.sim.simulator import TraceRow

    steady = linear_profile(jitter=(1.0,))
    calls = {"fast": [[0.004, 0.002, 0]], "standard": [[0.010, 0.003, 0]]}
    trace = [TraceRow(1.0 * i, tier, 40, 6) for i, tier in enumerate(["fast", "standard", "batch", "fast"])]

    def records(profile):
        result = simulate(config(), profile, workload(), [LoadPattern("trace")], Limits(max_requests=4), trace=trace,
                          progress=False)
        return result["stages"][0]["requests"]

    bare, served = records(steady), records(dataclasses.replace(steady, calls=calls))
    pooled = {0.004 + 0.002, 0.010 + 0.003}
    for b, s, row in zip(bare, served, trace):  # a second apart: each alone in the engine
        shift = (s["first_token"] - b["first_token"])
        assert s["sent"] == b["sent"] == pytest.approx(row.arrival)
        if row.tier == "batch":
            assert any(shift == pytest.approx(p) for p in pooled)
        else:
            assert shift == pytest.approx(sum(calls[row.tier][0][:2]))
        assert s["end"] - b["end"] == pytest.approx(shift)
        assert [t - u for t, u in zip(s["chunk_times"], b["chunk_times"])] == pytest.approx([shift] * 6)

    # A closed loop's user sends the next call once the last one's end has reached it.
    loop = simulate(config(), dataclasses.replace(steady, calls={"standard": [[0.010, 0.003, 1]]}),
                    workload(mix={"standard": 1.0}), [LoadPattern("one user", concurrency=1)], Limits(max_requests=5),
                    progress=False)["stages"][0]["requests"]
    assert [r["sent"] for r in loop[1:]] == pytest.approx([r["end"] for r in loop[:-1]])
    assert all(r["first_token"] - r["sent"] > 0.013 for r in loop)


def test_a_profile_with_calls_that_are_not_seconds_is_refused():
    data = linear_profile().to_dict()
    for bad in ({"fast": [[0.001, 0.001]]}, {"fast": [[0.001, -1, 0]]}, {"fast": "0.001"}, [[0.001, 0.002, 0]],
                {"fast": [[True, 0.001, 0]]}, {"fast": [[0.001, 0.001, 1.5]]}):
        with pytest.raises(ValueError, match="calls"):
            MachineProfile.from_dict({**data, "calls": bad})
    assert MachineProfile.from_dict({**data, "calls": {"fast": [[0.001, 0, 3]]}}).calls == {"fast": [[0.001, 0, 3]]}


def test_a_call_draws_the_servers_time_of_calls_made_as_busy():
    from tollway.sim.server_time import MIN_CALLS, ServerTime

    quiet, busy = [[0.002, 0.001, 2]] * MIN_CALLS, [[0.008, 0.004, 40]] * MIN_CALLS
    drawn = ServerTime({"standard": quiet + busy, "fast": [[0.001, 0.0005, 33]]}, seed=1)
    assert drawn.draw("standard", 0) == drawn.draw("standard", 3) == (0.002, 0.001)
    assert drawn.draw("standard", 32) == drawn.draw("standard", 500) == (0.008, 0.004)
    assert drawn.draw("fast", 1) == (0.001, 0.0005)  # its lane's only calls, however few
    assert drawn.draw("batch", 40) == (0.008, 0.004)  # a lane with none: every lane's
    # a busyness with too few calls kept draws from the nearest with enough
    sparse = ServerTime({"standard": quiet + [[0.5, 0.5, 40]]}, seed=1)
    assert {sparse.draw("standard", 40) for _ in range(20)} == {(0.002, 0.001)}
    assert ServerTime({}, seed=1).draw("fast", 9) == (0.0, 0.0)


def test_a_simulation_says_what_it_leaves_out_and_the_report_shows_it():
    import dataclasses

    from tollway.traffic.report import render

    grid = run(requests=20)
    missing = " ".join(grid["simulation"]["left_out"])
    assert "n-gram drafts" in missing and "the server's own work" in missing and "prefix-cache" in missing
    served = simulate(config(speculative_tokens=0), dataclasses.replace(linear_profile(), served=True), workload(),
                      [LoadPattern("rate 20/s", rate=20.0)], Limits(max_requests=20), progress=False)
    missing = " ".join(served["simulation"]["left_out"])
    assert "n-gram drafts" not in missing and "the server's own work" not in missing
    assert "the server's time per call" in missing and "the client's own time" in missing
    with_calls = simulate(config(speculative_tokens=0),
                          dataclasses.replace(linear_profile(), served=True, calls={"fast": [[0.001, 0.001, 0]]}),
                          workload(), [LoadPattern("rate 20/s", rate=20.0)], Limits(max_requests=20), progress=False)
    assert "the server's time per call" not in " ".join(with_calls["simulation"]["left_out"])
    assert "Not simulated: prefix-cache hits" in render([grid])


def test_a_served_profiles_jitter_is_drawn_in_runs_of_steps_as_they_ran():
    """A served machine's slow spells last tens of steps: drawn alone, a step's jitter would
    average out over a request's tokens, and its TPOT tail would be too thin."""
    import dataclasses

    from tollway.sim.simulator import JITTER_RUN, Simulator

    spells = [1.0] * 200 + [2.0] * 200  # a quick spell, then a slow one

    def switches(served: bool) -> tuple[int, int]:
        profile = dataclasses.replace(linear_profile(), jitter=spells, served=served, overhead=[0.0, 0.0])
        sim = Simulator(config(), profile, seed=3)
        long_outputs = Workload(Lengths(16, 0, 16, 16), Lengths(400, 0, 400, 400), True, {"standard": 1.0}, None, 5)
        sim.run_stage(long_outputs, LoadPattern("one user", concurrency=1), Limits(max_requests=3), progress=False)
        decodes = [seconds for _, seqs, tokens, seconds in sim.steps if tokens == 1]
        slow = [s > 1.5 * min(decodes) for s in decodes]
        return sum(a != b for a, b in zip(slow, slow[1:])), len(decodes)

    changed, steps = switches(served=True)
    assert steps > 1000 and changed < 3 * steps / JITTER_RUN  # in runs: a switch at most every new run
    changed, steps = switches(served=False)
    assert changed > steps / 4  # drawn alone: about every other step


def test_a_profile_says_how_far_the_machine_drifted_while_it_was_measured():
    import dataclasses

    steady = dataclasses.replace(linear_profile(), jitter=[1.0, 1.02] * 10)
    slowing = dataclasses.replace(linear_profile(), jitter=[1.0] * 10 + [1.1] * 10)
    assert abs(steady.drift()) < 0.001 and slowing.drift() == pytest.approx(0.1)
    assert linear_profile().drift() is None  # three timings tell nothing


def test_a_step_stops_between_layers_for_a_fast_arrival_and_runs_on_beside_it():
    """Where the profiled engine's steps stop between layers (pause_layers), a fast request
    that arrives mid-step waits for one layer of it, not all of it; the stopped step runs on
    beside the fast steps, ends later by their time, and is billed its own runner time."""
    import dataclasses

    from tollway.sim.simulator import TraceRow

    trace = [TraceRow(0.0, "standard", 512, 2), TraceRow(0.05, "fast", 16, 3)]

    def play(layers):
        profile = dataclasses.replace(linear_profile(jitter=(1.0,)), pause_layers=layers, overhead=[0.0, 0.0])
        result = simulate(config(speculative_tokens=0), profile, workload(), [LoadPattern("trace", rate=1.0)],
                          Limits(max_requests=2), trace=trace, progress=False)
        standard, fast = result["stages"][0]["requests"]
        return result["simulation"]["steps_paused"], standard, fast

    prefill = 0.02 + 0.0005 * 512 + 0.002  # the standard prompt's step: 278 ms, 10 layers of 27.8 ms
    paused, _, fast = play(0)
    assert paused == 0 and fast["first_token"] - fast["sent"] > prefill - 0.05  # waited for the rest of it
    paused, standard, fast = play(10)
    assert paused == 1
    fast_ttft = fast["first_token"] - fast["sent"]
    layer = prefill / 10
    assert fast_ttft < layer + 0.03, fast_ttft  # the rest of one layer, then its own 16-token step (28 ms)
    # The fast request's three steps (its prefill, two decodes) ran beside the stopped step, a layer
    # of it between each (a fast decode overruns its 20 ms target: nothing more fits), which then
    # ran on to its end: its first token comes after its own layers and those three steps.
    assert fast["end"] < standard["first_token"]
    whole = play(0)[1]
    delay = standard["first_token"] - whole["first_token"]
    assert 0.03 + 2 * 0.0225 < delay < 0.03 + 2 * 0.0225 + 0.01, delay  # their steps, a few context pairs more
    assert standard["engine_seconds"] == pytest.approx(whole["engine_seconds"], rel=0.02)
