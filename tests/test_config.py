"""Config from TOML: what a file overrides, what it leaves at the defaults, and the one-line
errors a bad file gets (from real files, since load_config reads the disk)."""
import re
import textwrap

import pytest

from tollway.config import EngineConfig, SchedulerConfig, TierSpec, default_tiers, load_config


def write(tmp_path, text: str):
    path = tmp_path / "tollway.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_file_overrides_fields_and_keeps_the_rest_at_defaults(tmp_path):
    config = load_config(write(tmp_path, """
        model = "/models/qwen3.gguf"
        device = "cpu"

        [scheduler]
        policy = "priority"
        max_num_seqs = 32

        [tiers.fast]
        tpot_target = 0.05
        reserved_kv_share = 0.2
    """))
    assert isinstance(config, EngineConfig)
    assert (config.model, config.device) == ("/models/qwen3.gguf", "cpu")
    assert config.num_threads is None and config.cache_dir is None
    sched = config.scheduler
    assert (sched.policy, sched.max_num_seqs) == ("priority", 32)
    assert sched.num_blocks == SchedulerConfig().num_blocks and sched.kernel == "auto"

    defaults = default_tiers()
    fast = sched.tiers["fast"]
    assert (fast.tpot_target, fast.reserved_kv_share) == (0.05, 0.2)
    assert fast == TierSpec(**{**vars(defaults["fast"]), "tpot_target": 0.05, "reserved_kv_share": 0.2})
    assert sched.tiers["standard"] == defaults["standard"]
    assert sched.tiers["batch"] == defaults["batch"]


def test_empty_file_is_the_default_config(tmp_path):
    assert load_config(write(tmp_path, "")) == EngineConfig()


@pytest.mark.parametrize("text, message", [
    ('modle = "x"\n', "unknown key(s) modle in top level"),
    ('[scheduler]\nmax_seqs = 4\npolicy = "fcfs"\n', "unknown key(s) max_seqs in [scheduler]"),
    ("[tiers.turbo]\ntpot_target = 0.1\n", "unknown tier 'turbo' (tiers are fast, standard, batch)"),
    ("[tiers.batch]\ndeadline = 60\n", "unknown key(s) deadline in [tiers.batch]"),
    ("[tiers.fast]\nname = \"slow\"\n", "unknown key(s) name in [tiers.fast]"),
    ('[scheduler]\npolicy = "random"\n', "policy must be one of lanes, priority, fcfs, got 'random'"),
    ("[tiers.fast]\nreserved_kv_share = 1.0\n", "tiers.fast.reserved_kv_share must be in [0, 1), got 1.0"),
    ("[tiers.standard]\nreserved_seq_share = -0.1\n", "tiers.standard.reserved_seq_share must be in [0, 1), got -0.1"),
    ("[tiers.standard]\ntpot_target = -2.0\n", "tiers.standard.tpot_target must be > 0 seconds, got -2.0"),
    ("[tiers.batch]\nwindow = 0\n", "tiers.batch.window must be > 0 seconds, got 0"),
    ("[scheduler]\nmax_num_seqs = 10\n[tiers.fast]\nreserved_seq_share = 0.6\n[tiers.standard]\nreserved_seq_share = 0.4\n",
     "reserved_seq_share leaves tier batch nothing of 10"),
    ("[scheduler]\nnum_blocks = 4\n[tiers.fast]\nreserved_kv_share = 0.5\n[tiers.batch]\nreserved_kv_share = 0.5\n",
     "reserved_kv_share leaves tier standard nothing of 4"),
    ("scheduler = 5\n", "[scheduler] must be a table"),
    ("[tiers]\nfast = 3\n", "[tiers.fast] must be a table"),
    ("[scheduler]\nmax_num_seqs = 64.5\n", "max_num_seqs in [scheduler] must be int, got 64.5"),
    ('[scheduler]\nmax_num_seqs = "64"\n', "max_num_seqs in [scheduler] must be int, got '64'"),
    ('[tiers.fast]\npreemptible = "no"\n', "preemptible in [tiers.fast] must be bool, got 'no'"),
    ("[tiers.fast]\ntpot_target = true\n", "tpot_target in [tiers.fast] must be float, got True"),
])
def test_bad_file_gets_a_clear_error(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        load_config(path)
    if "unknown" in message:
        assert str(e.value).startswith(f"config {path}: ")


def test_invalid_toml(tmp_path):
    path = write(tmp_path, "[scheduler\npolicy = lanes\n")
    with pytest.raises(ValueError, match=re.escape(f"config {path} is not valid TOML: ")):
        load_config(path)


def test_missing_file(tmp_path):
    path = tmp_path / "absent.toml"
    with pytest.raises(ValueError, match=re.escape(f"cannot read config {path}: No such file or directory")):
        load_config(path)


def test_shares_that_leave_no_seat_are_fine_without_lanes(tmp_path):
    """Reservations only exist under lanes, so the same shares pass under fcfs."""
    config = load_config(write(tmp_path, """
        [scheduler]
        policy = "fcfs"
        max_num_seqs = 10
        [tiers.fast]
        reserved_seq_share = 0.6
        [tiers.standard]
        reserved_seq_share = 0.4
    """))
    assert all(config.scheduler.reserved("seq", t) == 0 for t in ("fast", "standard", "batch"))


def test_reserved_is_the_floor_of_share_times_total_under_lanes():
    config = SchedulerConfig(num_blocks=2048, max_num_seqs=64)
    config.tiers["standard"].reserved_kv_share = 0.3
    config.tiers["standard"].reserved_seq_share = 0.3
    config.validate()
    assert config.reserved("kv", "fast") == 204  # 0.1 * 2048 = 204.8
    assert config.reserved("seq", "fast") == 8  # 0.125 * 64
    assert config.reserved("kv", "standard") == 614  # 614.4
    assert config.reserved("seq", "standard") == 19  # 19.2
    assert config.reserved("kv", "batch") == config.reserved("seq", "batch") == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_nothing_is_reserved_outside_lanes(policy):
    config = SchedulerConfig(policy=policy)
    config.validate()
    assert config.tiers["fast"].reserved_kv_share > 0
    for tier in ("fast", "standard", "batch"):
        assert config.reserved("kv", tier) == config.reserved("seq", tier) == 0


@pytest.mark.parametrize("value, total, expected", [
    ("2GiB", 0, 2 * 2**30), ("500MB", 0, 500 * 10**6), ("1.5 kib", 0, 1536), (1e9, 0, 10**9), ("4096", 0, 4096),
    ("0.25", 8000, 2000), (0.5, 8000, 4000),
])
def test_kv_cache_memory_is_bytes_or_a_share(value, total, expected):
    from tollway.config import memory_budget

    assert memory_budget(value, total) == expected


@pytest.mark.parametrize("value", ["lots", "-1GB", "0", "2 GiBs", True])
def test_bad_kv_cache_memory_is_refused(value):
    from tollway.config import memory_budget

    with pytest.raises(ValueError, match="kv_cache_memory"):
        memory_budget(value, 10**9)


def test_kv_pool_blocks_fill_the_budget():
    from tollway.config import kv_pool_blocks

    # Gemma 3 270M in float16: 18 layers x 1 KV head x 256 x (K and V) x 2 bytes = 18432 bytes a token.
    assert kv_pool_blocks("18MiB", 0, 18432, 16) == 64
    assert kv_pool_blocks(0.5, 2 * 18432 * 16 * 10 + 1, 18432, 16) == 10
    with pytest.raises(ValueError, match="holds no KV block"):
        kv_pool_blocks("1KB", 0, 18432, 16)


@pytest.mark.parametrize("given, model_limit, expected", [
    (None, 32768, 2048 * 16), (None, 4096, 4096), (100_000, 32768, 32768), (512, 32768, 512),
])
def test_max_model_len_defaults_to_what_the_model_and_pool_allow(given, model_limit, expected):
    sched = SchedulerConfig(max_model_len=given)
    assert sched.context_limit() == (given or 2048 * 16)  # before the model is known: the pool's
    sched.fit_context(model_limit)
    assert sched.max_model_len == sched.context_limit() == expected
