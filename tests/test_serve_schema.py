"""Schema-driven fuzzing: schemathesis reads the live server's /openapi.json, generates requests from it (valid
ones, and for the POST routes invalid ones too), and checks every response: never a 500, and status, content
type, headers and body as the schema documents them."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks

from serving import MODEL_NAME, make_async_llm, tiny_chat_model_dir  # noqa: F401

CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_headers_conformance, checks.response_schema_conformance]
OPERATIONS = {"GET /health": 5, "GET /version": 5, "GET /v1/models": 5, "GET /metrics": 5,
              "POST /v1/completions": 60, "POST /v1/chat/completions": 60}  # examples each


@pytest.fixture(scope="module")
def api_schema(make_async_llm):
    from minillm.serve import ServerThread

    # A short context keeps every generated request short, whatever max_tokens it asks for.
    with ServerThread(make_async_llm(max_model_len=48, num_kv_blocks=512), served_model_name=MODEL_NAME) as server:
        yield schemathesis.openapi.from_url(f"http://{server.host}:{server.port}/openapi.json")


def test_the_schema_lists_every_route(api_schema):
    assert {operation.ok().label for operation in api_schema.get_all_operations()} == set(OPERATIONS)


@pytest.mark.parametrize("label", OPERATIONS)
def test_every_response_conforms_to_the_schema(api_schema, label):
    operation = api_schema.find_operation_by_label(label)
    cases = operation.as_strategy(GenerationMode.POSITIVE)
    if label.startswith("POST"):
        cases = st.one_of(cases, operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(max_examples=OPERATIONS[label], deadline=None, suppress_health_check=list(HealthCheck))
    def check(case):
        # A request may ask for n = 128 choices, each sampled over the 49k-token vocabulary: on a busy 2-core CPU
        # that takes longer than schemathesis' default 10 s, which would fail on the client's timeout.
        case.call_and_validate(checks=CHECKS, timeout=120)

    check()
