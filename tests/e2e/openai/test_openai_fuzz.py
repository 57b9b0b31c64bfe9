"""The OpenAI API fuzzed from its own OpenAPI schema (schemathesis' case strategies, driven by
hypothesis) against a real server: no request the schema admits, however odd, gets a 5xx, and every
4xx is an OpenAI error body. Bodies keep their drawn fields but name a served model, so the fuzz
reaches the chat template, the guides and the engine rather than stopping at 404. (schemathesis'
pytest plugin does not run under the pytest installed here, so each operation's strategy is drawn
with hypothesis' own @given.) The rig: tests/openai_server.py."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

pytestmark = [pytest.mark.triton, pytest.mark.slow]


@pytest.fixture(scope="module")
def api_schema(api):
    return schemathesis.openapi.from_url(f"{api.url}/openapi.json")


def _operations(api_schema) -> dict:
    return {op.ok().label: op.ok() for op in api_schema.get_all_operations()}


def test_the_schema_has_the_routes(api_schema):
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"} <= set(_operations(api_schema))


@pytest.mark.parametrize("label", ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
                                   "GET /health"])
def test_no_5xx_and_every_4xx_is_an_openai_error_body(api_schema, api, label):
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=_operations(api_schema)[label].as_strategy())
    def run(case):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny_chat" if case.path.endswith("chat/completions") else "tiny"
        response = case.call(base_url=api.url, timeout=120)
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text[:500]

    run()
