"""The tollway command: streams a generation; bad input gets one clear line and exit code 2."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _tollway(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tollway", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_streams_greedy_text(default_weights, make_engine, run_to_completion):
    from tollway.request import SamplingParams

    [expected], _ = run_to_completion(make_engine(kernel="int8"), ["The capital of France is"],
                                      SamplingParams(temperature=0, max_tokens=6))
    result = _tollway("generate", "The capital of France is", "--max-tokens", "6", "--kernel", "int8")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model.gguf"], "/no/such/model.gguf"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--max-model-len", "8"], "context"),
])
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


def test_serve_warns_when_public_without_keys(tmp_path):
    """Bound to every interface with no API key: a warning; the server still comes up."""
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tollway", "serve", "--host", "0.0.0.0", "--port", str(port),
                             "--kernel", "int8", "--data-dir", str(tmp_path), "--keys-db", str(tmp_path / "k.sqlite")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.5)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "warning: serving 0.0.0.0 with no API keys" in stderr
