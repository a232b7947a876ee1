"""Schema-driven fuzzing: schemathesis generates requests from the app's own OpenAPI schema,
valid and not; none may get a 5xx. The context is kept short so every generated request,
whatever its max_tokens, finishes quickly."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig

from live_server import make_meter, running_server


@pytest.fixture(scope="module")
def fuzz_server(make_engine, tmp_path_factory):
    data = tmp_path_factory.mktemp("fuzz")
    yield from running_server(make_engine(max_model_len=48), batch_dir=data,
                              meter=make_meter(data / "ledger.sqlite"))


# The coverage phase's valid boundary cases of the generating operations (n = 16 choices, each up to
# the context, and so on through every field) were three quarters of this module's time, each a
# generation; there it makes only the invalid ones (each a 400), and the fuzzing phase's examples
# still generate.
GENERATING = "^/v1/(chat/completions|completions|responses)$"
CONFIG = SchemathesisConfig.from_dict({"operations": [
    {"include-path-regex": GENERATING, "phases": {"coverage": {"generation": {"mode": "negative"}}}}]})


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server["url"] + "/openapi.json", config=CONFIG)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
# Three examples an operation: with some 40 operations, five took a sixth of the suite's time.
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case):
    # A generous read timeout: on a busy 2-core machine a request may queue behind the
    # previous examples' generations (a timeout is not a server error).
    case.call_and_validate(checks=[not_a_server_error], timeout=60)
