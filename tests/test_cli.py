"""The tollway command: streams a generation; bad input gets one clear line and exit code 2."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _tollway(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tollway", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # a process of its own
def test_generate_streams_greedy_text(default_weights, make_engine, run_to_completion):
    from tollway.request import SamplingParams

    [expected], _ = run_to_completion(make_engine(), ["The capital of France is"],
                                      SamplingParams(temperature=0, max_tokens=6))
    result = _tollway("generate", "The capital of France is", "--max-tokens", "6")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model.gguf"], "/no/such/model.gguf"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--max-model-len", "8"], "context"),
])
@pytest.mark.slow  # a process of its own
def test_bad_input_gets_one_line(tmp_path, args, message):
    result = _tollway("generate", "hello " * 20, *args)
    assert result.returncode == 2
    _assert_one_error_line(result.stderr, message)


@pytest.mark.parametrize("toml, message", [
    ("policy = 'lanes'", "unknown key(s) policy in top level"),
    ("[scheduler]\npolicy = 'sjf'", "policy must be one of"),
    ("[tiers.fast]\ntpot_target = -1", "tiers.fast.tpot_target must be > 0"),
    ("[tiers", "not valid TOML"),
])
def test_bad_config_file_is_one_line(tmp_path, toml, message):
    (tmp_path / "tollway.toml").write_text(toml)
    result = _tollway("generate", "hi", "--config", str(tmp_path / "tollway.toml"))
    assert result.returncode == 2
    _assert_one_error_line(result.stderr, message)


@pytest.mark.slow  # a process of its own
def test_unsupported_architecture_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    result = _tollway("generate", "hi", "--model", str(tmp_path))
    assert result.returncode == 2
    _assert_one_error_line(result.stderr, "unsupported model architecture 'bert'")


def _assert_one_error_line(stderr: str, message: str) -> None:
    # The loading bar is transient on a terminal; what is left is a single error line, last.
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == [lines[-1]] and lines[-1].startswith("tollway: error:") and message in lines[-1]
    assert "Traceback" not in stderr


@pytest.mark.slow  # a process of its own
def test_serve_warns_when_public_without_keys(tmp_path):
    """Bound to every interface with no API key: a warning; the server still comes up."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tollway", "serve", "--host", "0.0.0.0", "--port", str(port),
                             "--data-dir", str(tmp_path), "--keys-db", str(tmp_path / "k.sqlite")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(proc, port)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "warning: serving 0.0.0.0 with no API keys" in stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, port: int) -> None:
    import time

    import httpx

    deadline = time.time() + 300
    while True:
        assert proc.poll() is None
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline
        time.sleep(0.5)


def test_serve_takes_vllm_flags():
    """vLLM's names, through the real parser: a positional model, batch limits, and the KV pool's memory."""
    from tollway.cli import _build_parser
    from tollway.engine_arguments import engine_config

    args = _build_parser().parse_args(["serve", "/models/qwen3.gguf", "--max-num-seqs", "8",
                                       "--max-num-batched-tokens", "256", "--kv-cache-memory", "2GiB",
                                       "--chat-template", "{{ messages[0].content }}", "--tool-call-parser", "hermes"])
    config = engine_config(args)
    sched = config.scheduler
    assert (config.model, sched.max_num_seqs, sched.max_num_batched_tokens) == ("/models/qwen3.gguf", 8, 256)
    assert (config.kv_cache_memory, config.chat_template) == ("2GiB", "{{ messages[0].content }}")
    assert config.tool_call_parser == "hermes"
    assert sched.max_model_len is None  # the model's, settled when it loads
    assert engine_config(_build_parser().parse_args(["serve", "--model", "/m.gguf"])).model == "/m.gguf"
    assert sched.policy == "lanes" and sched.enable_prefix_caching
    vllm = engine_config(_build_parser().parse_args(["serve", "--scheduling-policy", "priority",
                                                     "--no-enable-prefix-caching"])).scheduler
    assert (vllm.policy, vllm.enable_prefix_caching) == ("priority", False)
    assert engine_config(_build_parser().parse_args(["serve", "--enable-prefix-caching"])).scheduler.enable_prefix_caching


def test_chat_template_is_read_from_a_file(tmp_path):
    from tollway.engine_arguments import chat_template

    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chat_template(str(tmp_path / "t.jinja")) == "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.mark.parametrize("args, message", [
    (["--kv-cache-memory", "lots"], "kv_cache_memory must be bytes"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be >= 1"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template: no such file"),
    (["--chat-template", "{% for m in messages %}"], "--chat-template does not parse"),
    (["a.gguf", "--model", "b.gguf"], "two models given"),
    (["--tool-call-parser", "pythonic"], "tool_call_parser must be one of hermes, llama3_json, mistral, constrained"),
])
def test_bad_serve_flag_is_one_line(tmp_path, args, message):
    result = _tollway("serve", "--data-dir", str(tmp_path), "--keys-db", str(tmp_path / "k.sqlite"), *args)
    assert result.returncode == 2
    _assert_one_error_line(result.stderr, message)


@pytest.mark.slow  # a process of its own
def test_serve_like_vllm(tmp_path):
    """One real start: the model given by position, its name served as --served-model-name, the key from
    $TOLLWAY_API_KEY, a KV pool sized from --kv-cache-memory (which, with no --max-model-len, bounds
    the context), a chat template with the request's chat_template_kwargs, and an access log. The
    bench's --model defaults to what /v1/models lists."""
    import os

    import openai

    from tollway.bench.cli import served_model

    port = _free_port()
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ extra | default('') }}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tollway", "serve", "gemma3-270m", "--port", str(port),
         "--served-model-name", "tiny", "--kv-cache-memory", "18MiB", "--chat-template", template,
         "--data-dir", str(tmp_path), "--keys-db", str(tmp_path / "k.sqlite")],
        env={**os.environ, "TOLLWAY_API_KEY": "sk-from-env"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        _wait_healthy(proc, port)
        url = f"http://127.0.0.1:{port}/v1"
        with openai.OpenAI(base_url=url, api_key="sk-wrong") as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        with openai.OpenAI(base_url=url, api_key="sk-from-env") as client:
            [model] = client.models.list().data
            # 18 MiB of float16 KV at 18432 bytes a token: 64 blocks of 16 tokens.
            assert (model.id, model.max_model_len) == ("tiny", 64 * 16)

            def prompt_tokens(**kwargs) -> int:
                return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=1, **kwargs).usage.prompt_tokens

            plain = prompt_tokens()
            assert prompt_tokens(extra_body={"chat_template_kwargs": {"extra": " and a few more words"}}) > plain + 3
        assert served_model(url, "sk-from-env") == "tiny"
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    assert '"GET /v1/models HTTP/1.1" 200' in output
    assert "sk-from-env" not in output


@pytest.mark.parametrize("command", [["bench", "--url", "http://127.0.0.1:1"], ["simulate"], ["report", "a.json"]])
def test_bench_commands_without_the_bench_extra_name_it(monkeypatch, capsys, command):
    from tollway.cli import main

    monkeypatch.setitem(sys.modules, "rich", None)  # import rich now fails, as where the extra is not installed
    assert main(command) == 2
    assert capsys.readouterr().err == (f"tollway: error: tollway {command[0]} needs the bench extra (rich missing): "
                                       "pip install 'tollway[bench]'\n")
