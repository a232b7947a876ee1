"""StepTimeModel: the shape arithmetic, the offline fit and the online refit that the lanes
policy shapes steps with. Pure Python and deterministic: step times come from known
coefficients, so every number the model produces can be checked against the truth."""
import os
import random
import subprocess
import sys

import pytest

from tollway.request import SamplingParams
from tollway.scheduler.plan import ScheduledSeq, StepPlan
from tollway.scheduler.step_model import FEATURES, StepShape, StepTimeModel

# Shaped like the real CPU numbers: int8 cheap to start and steep per token, fp32 the opposite.
TRUTH = {"int8": [0.040, 0.0030, 0.0040, 0.00002, 0.005], "fp32": [0.060, 0.0020, 0.0120, 0.00002, 0.008]}


def seconds(coefficients, shape: StepShape) -> float:
    return sum(c * x for c, x in zip(coefficients, shape.features()))


def decode_batch(kernel: str, batch: int, context: int) -> StepShape:
    shape = StepShape(kernel)
    for _ in range(batch):
        shape = shape.plus(context, 1, True)
    return shape


def varied_shapes(rng: random.Random, kernel: str, n: int) -> list[StepShape]:
    """Decode batches, prefill chunks and mixed steps, so every feature varies independently."""
    shapes = []
    for _ in range(n):
        if rng.random() < 0.5:
            shapes.append(decode_batch(kernel, rng.randint(1, 64), rng.randint(16, 2048)))
        else:
            shape = StepShape(kernel).plus(rng.randint(0, 1024), rng.randint(16, 512), rng.random() < 0.5)
            for _ in range(rng.randint(0, 8)):
                shape = shape.plus(rng.randint(16, 2048), 1, True)
            shapes.append(shape)
    return shapes


def max_rel_error(model: StepTimeModel, truth, shapes) -> float:
    return max(abs(model.predict(s) / seconds(truth, s) - 1) for s in shapes)


# --- StepShape -------------------------------------------------------------------------------

def test_decode_reads_its_context_plus_itself():
    shape = StepShape("int8").plus(start_pos=99, num_new=1, logit_rows=1)
    assert (shape.kernel, shape.tokens, shape.sampled) == ("int8", 1, 1)
    assert shape.attention == pytest.approx(100 / 1000)


@pytest.mark.parametrize("start, n", [(0, 1), (0, 512), (10, 4), (300, 37), (4096, 256)])
def test_prefill_chunk_counts_every_query_key_pair(start, n):
    """The closed form must match counting: the query at position p attends to p + 1 keys."""
    shape = StepShape("fp32").plus(start, n, logit_rows=0)
    brute = sum(p + 1 for p in range(start, start + n))
    assert brute == n * start + n * (n + 1) // 2
    assert (shape.tokens, shape.sampled) == (n, 0)
    assert shape.attention == pytest.approx(brute / 1000)


def test_plus_accumulates_and_another_kernel_sees_the_same_work():
    shape = StepShape("int8").plus(0, 8, True).plus(5, 1, True).plus(20, 3, False)
    assert (shape.tokens, shape.sampled) == (12, 2)
    assert shape.attention == pytest.approx((8 * 9 // 2 + 6 + 3 * 20 + 6) / 1000)
    # Rows rounded up to the kernel's row group (int8: 4); two chunks, of 8 and 3 tokens.
    assert shape.features() == (1.0, 12.0, 4.0, shape.attention, 2.0)
    moved = shape._replace(kernel="fp32")
    assert moved.features() == (1.0, 16.0, 8.0, shape.attention, 2.0)
    model = StepTimeModel({"int8": [0.0, 1.0, 0.0, 0.0, 0.0], "fp32": [0.0, 2.0, 0.0, 0.0, 0.0]})
    assert (model.predict(shape), model.predict(shape, "fp32"), model.predict(moved)) == (12.0, 32.0, 32.0)


def test_a_row_past_the_group_costs_the_whole_group():
    model = StepTimeModel({"int8": [0.02, 0.004, 0.003, 0.0, 0.0]})
    times = {}
    for n in range(1, 10):
        shape = StepShape("int8")
        for _ in range(n):
            shape = shape.plus(100, 1, 1)
        times[n] = model.predict(shape)
    assert times[1] == times[4] < times[5] == times[8] < times[9]


def test_of_plan_equals_adding_its_seqs_one_by_one():
    params = SamplingParams(temperature=0.0)
    seqs = [ScheduledSeq("a", "fast", (7,), 40, (0, 1, 2), True, params),
            ScheduledSeq("b", "standard", tuple(range(32)), 64, (3, 4, 5, 6), False, params),
            ScheduledSeq("c", "batch", tuple(range(10)), 0, (7,), True, params),
            ScheduledSeq("d", "standard", (9,), 1000, tuple(range(8, 72)), True, params)]
    plan = StepPlan(3, seqs, "int8")
    expected = StepShape("int8")
    for s in seqs:
        expected = expected.plus(s.start_pos, s.num_new, s.num_logit_rows)
    shape = StepShape.of(plan)
    assert shape.kernel == "int8"
    assert (shape.tokens, shape.sampled) == (expected.tokens, expected.sampled) == (plan.num_tokens, 3)
    assert shape.attention == pytest.approx(expected.attention)
    assert StepShape.of(StepPlan(0, [], "fp32")) == StepShape("fp32")


# --- fit and predict -------------------------------------------------------------------------

def test_fit_recovers_each_kernels_coefficients():
    rng = random.Random(7)
    samples = [(s, seconds(TRUTH[k], s)) for k in TRUTH for s in varied_shapes(rng, k, 60)]
    rng.shuffle(samples)
    model = StepTimeModel.fit(samples)
    assert sorted(model.coefficients) == sorted(TRUTH)
    for kernel, truth in TRUTH.items():
        assert model.coefficients[kernel] == pytest.approx(truth, rel=1e-3)
        assert max_rel_error(model, truth, varied_shapes(rng, kernel, 50)) < 0.01


def test_fit_never_returns_a_negative_coefficient():
    """Data where sampling seems to make a step cheaper: the fit drops that feature (no step
    gets cheaper by adding work) and still explains the rest."""
    rng = random.Random(3)
    want_negative = [0.05, 0.002, -0.0005, 0.0001, 0.003]
    shapes = varied_shapes(rng, "int8", 80)
    assert all(seconds(want_negative, s) > 0 for s in shapes)
    model = StepTimeModel.fit([(s, seconds(want_negative, s)) for s in shapes])
    fixed, tokens, sampled, attention, chunks = model.coefficients["int8"]
    assert min(model.coefficients["int8"]) >= 0
    assert sampled == 0.0
    assert fixed > 0 and tokens > 0 and attention > 0


def test_online_refit_never_goes_negative_either():
    rng = random.Random(4)
    want_negative = [0.05, 0.002, -0.0005, 0.0001, 0.003]
    model = StepTimeModel({"int8": TRUTH["int8"]})
    for s in varied_shapes(rng, "int8", 64):
        model.observe(s, seconds(want_negative, s))
    assert min(model.coefficients["int8"]) >= 0


_FIT_REPR = """
import random, sys
sys.path.insert(0, "tests")
from test_step_model import TRUTH, seconds, varied_shapes
from tollway.scheduler.step_model import StepTimeModel
rng = random.Random(7)
model = StepTimeModel.fit([(s, seconds(TRUTH["int8"], s) * rng.uniform(0.9, 1.1)) for s in varied_shapes(rng, "int8", 300)])
for s in varied_shapes(rng, "int8", 64):
    model.observe(s, seconds(TRUTH["int8"], s) * rng.uniform(0.8, 1.3))
print(repr(model.coefficients))
"""


def test_the_fit_rounds_the_same_whatever_blas_kernel_the_cpu_picks():
    """The simulator must give the same bits on an AVX2 and an AVX-512 machine; BLAS sums in an
    order set by the CPU's vector width. OPENBLAS_CORETYPE makes this CPU take other kernels."""
    runs = {core: subprocess.run([sys.executable, "-c", _FIT_REPR], capture_output=True, text=True, check=True,
                                 env={**os.environ, "OPENBLAS_CORETYPE": core}).stdout
            for core in ("", "Prescott", "Sandybridge")}
    assert runs[""].startswith("{'int8': [")
    assert runs["Prescott"] == runs[""] and runs["Sandybridge"] == runs[""]


def test_fit_without_samples_raises():
    with pytest.raises(ValueError, match="no samples"):
        StepTimeModel.fit([])


def test_predict_unknown_kernel_raises():
    model = StepTimeModel(TRUTH)
    with pytest.raises(ValueError, match=r"knows kernels \['fp32', 'int8'\], not 'bf16'"):
        model.predict(StepShape("bf16", 1, 1, 0.1))


@pytest.mark.parametrize("coefficients", [[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
def test_constructor_rejects_wrong_number_of_coefficients(coefficients):
    with pytest.raises(ValueError, match=f"int8: need {len(FEATURES)} coefficients, got {len(coefficients)}"):
        StepTimeModel({"fp32": TRUTH["fp32"], "int8": coefficients})


# --- online refit ----------------------------------------------------------------------------

def test_online_refit_learns_from_a_wrong_start_and_keeps_score():
    """Starting at half the truth, every prediction is 50% off until the first refit; after a
    window's worth of steps the model is within a few percent. The running error must be the
    exact sum of what was predicted before each step was learned from."""
    rng = random.Random(11)
    prior = {k: [c / 2 for c in v] for k, v in TRUTH.items()}
    model = StepTimeModel(prior)
    assert model.refit_every == 16
    shapes = varied_shapes(rng, "int8", 320)
    sum_abs = sum_rel = 0.0
    late_rel = []
    for i, shape in enumerate(shapes):
        measured = seconds(TRUTH["int8"], shape)
        predicted = model.predict(shape)
        if i < 16:
            assert model.coefficients == prior  # no refit before refit_every steps
            assert predicted == pytest.approx(measured / 2)
        sum_abs += abs(predicted - measured)
        sum_rel += abs(predicted - measured) / measured
        if i >= len(shapes) - 64:
            late_rel.append(abs(predicted - measured) / measured)
        model.observe(shape, measured)
        if i == 15:
            assert model.coefficients["int8"] != prior["int8"]
            assert model.error.count == 16
            assert model.error.mean_rel == pytest.approx(0.5)
            assert model.error.mean_abs_seconds == pytest.approx(
                sum(seconds(TRUTH["int8"], s) for s in shapes[:16]) / 2 / 16)

    assert model.error.count == model.error_by_kernel["int8"].count == len(shapes)
    assert model.error_by_kernel["fp32"].count == 0
    assert model.coefficients["fp32"] == prior["fp32"]  # no fp32 steps, nothing to refit
    assert model.error.mean_abs_seconds == pytest.approx(sum_abs / len(shapes))
    assert model.error.mean_rel == pytest.approx(sum_rel / len(shapes))
    assert model.error.mean_rel > 0.5 * 16 / len(shapes)  # the unlearned start is in the score
    assert max(late_rel) < 0.03
    assert max_rel_error(model, TRUTH["int8"], varied_shapes(rng, "int8", 50)) < 0.03


def test_observe_ignores_nonpositive_times_and_unknown_kernels():
    model = StepTimeModel(TRUTH, refit_every=1)
    shape = decode_batch("int8", 4, 100)
    for kernel, secs in (("int8", 0.0), ("int8", -0.5), ("bf16", 0.2)):
        model.observe(shape._replace(kernel=kernel), secs)
    model.refit()
    assert model.error.count == 0
    assert all(e.count == 0 for e in model.error_by_kernel.values())
    assert "bf16" not in model.error_by_kernel
    assert model.coefficients == TRUTH


def test_ridge_holds_the_unvaried_direction_at_the_prior():
    """Decode-only steps have sampled == tokens, so the data cannot tell the two apart: the
    split must stay at the prior's, and a prefill (many tokens, one sample) must still be
    predicted about as the prior would."""
    rng = random.Random(5)
    prior = TRUTH["int8"]
    model = StepTimeModel({"int8": prior})
    for _ in range(128):
        shape = decode_batch("int8", rng.randint(1, 64), rng.randint(16, 2048))
        assert shape.sampled == shape.tokens
        model.observe(shape, seconds(prior, shape) * (1 + rng.uniform(-0.03, 0.03)))
    fixed, tokens, sampled, _, _ = model.coefficients["int8"]
    assert fixed == pytest.approx(prior[0], rel=0.1)
    assert tokens == pytest.approx(prior[1], rel=0.05)
    assert sampled == pytest.approx(prior[2], rel=0.05)
    prefill = StepShape("int8").plus(0, 512, True)
    assert model.predict(prefill) == pytest.approx(seconds(prior, prefill), rel=0.2)


def test_to_dict_reports_features_coefficients_and_error():
    model = StepTimeModel(TRUTH)
    shape = decode_batch("fp32", 2, 50)
    model.observe(shape, 2 * seconds(TRUTH["fp32"], shape))
    d = model.to_dict()
    assert d["features"] == ["fixed", "tokens", "sampled", "attention", "chunks"]
    assert d["coefficients"] == TRUTH
    assert d["error"]["steps"] == 1
    assert d["error"]["mean_rel"] == pytest.approx(0.5)
    assert d["error"]["mean_abs_seconds"] == pytest.approx(seconds(TRUTH["fp32"], shape))


def test_non_finite_and_non_positive_times_are_ignored():
    model = StepTimeModel({"int8": [0.05, 0.001, 0.002, 0.0001, 0.0]}, refit_every=1)
    before = list(model.coefficients["int8"])
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        model.observe(StepShape("int8", 4, 4, 1.0), bad)
    assert model.error.count == 0 and model.coefficients["int8"] == before
    fitted = StepTimeModel.fit([(StepShape("int8", t, t, t / 10), 0.05 + 0.001 * t) for t in (1, 4, 16, 32)]
                               + [(StepShape("int8", 8, 8, 0.8), 0.0), (StepShape("int8", 8, 8, 0.8), float("nan"))])
    assert abs(fitted.predict(StepShape("int8", 8, 8, 0.8)) - 0.058) < 1e-3


def test_headroom_is_the_recent_overrun_quantile():
    model = StepTimeModel({"int8": [0.1, 0.0, 0.0, 0.0, 0.0]}, refit_every=10**9)
    assert model.headroom("int8", 0.95) == 1.0  # too few steps to say
    for i in range(100):  # measured 0.1 s * 1.00 .. 1.99
        model.observe(StepShape("int8", 1, 1, 0.0), 0.1 * (1 + i / 100))
    assert model.headroom("int8", 0.95) == pytest.approx(1.95)
    assert model.headroom("int8", 0.5) == pytest.approx(1.50)
