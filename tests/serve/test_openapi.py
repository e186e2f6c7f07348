"""/openapi.json says what the server answers (k3.serve.openapi): every status k3 answers in OpenAI's error
shape (not FastAPI's 422, which k3 never sends), server-sent events for a stream, max_tokens bounded by the
server's length, and the rules between fields; and the server holds to the schema where it can be checked."""

from __future__ import annotations

import json

from .conftest import NAME, post


def schema(server) -> dict:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/openapi.json")
    return json.loads(conn.getresponse().read())


def test_every_status_the_server_answers_is_documented(server):
    spec = schema(server)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "405", "408", "413", "415", "500", "503"}
        assert "text/event-stream" in responses["200"]["content"]
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    models = spec["paths"]["/v1/models/{model}"]["get"]["responses"]
    assert {"200", "401", "404"} <= set(models) and "422" not in models and "415" not in models
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_the_schema_bounds_and_rules_are_the_servers(server):
    requests = schema(server)["components"]["schemas"]
    chat, completion = requests["ChatRequest"], requests["CompletionRequest"]
    bounds = [m.get("maximum") for m in chat["properties"]["max_completion_tokens"]["anyOf"]]
    assert 511 in bounds  # max_model_len 512 leaves one prompt token
    ids = [m for m in completion["properties"]["prompt"]["anyOf"] if m.get("items", {}).get("type") == "integer"]
    assert ids[0]["items"] == {"type": "integer", "minimum": 0, "maximum": 256}  # the byte vocabulary: 257
    rule = {"required": ["stream"], "properties": {"stream": {"const": True}}}
    assert chat["allOf"][0]["then"] == completion["allOf"][0]["then"] == rule  # stream_options needs a stream
    code, out, _ = post(server, "/v1/completions", json.dumps({"prompt": "hi", "stream_options": {}}))
    assert code == 400 and out["error"]["param"] == "stream_options"


def test_a_seed_past_64_bits_is_taken_modulo_2_to_the_64(server):
    def text(seed):
        body = {"model": NAME, "prompt": "Hi", "max_tokens": 6, "temperature": 1, "seed": seed}
        code, out, _ = post(server, "/v1/completions", json.dumps(body))
        assert code == 200, out
        return out["choices"][0]["text"]

    assert text(2**64 + 7) == text(7)


def test_the_health_check_needs_no_key(server):
    assert "401" not in schema(server)["paths"]["/health"]["get"]["responses"]


def test_a_whole_number_spelled_with_a_fraction_is_an_integer(server):
    """JSON Schema's "integer" takes 2.0; so does the server (a fraction, a string or a boolean stays 400)."""
    body = {"model": NAME, "prompt": [72.0, 105], "max_tokens": 3.0, "n": 2.0, "temperature": 0, "ignore_eos": True}
    code, out, _ = post(server, "/v1/completions", json.dumps(body))
    assert code == 200 and len(out["choices"]) == 2 and out["usage"]["completion_tokens"] == 6, out
    for bad in (2.5, "3", True):
        code, out, _ = post(server, "/v1/completions", json.dumps({**body, "max_tokens": bad}))
        assert code == 400 and out["error"]["param"] == "max_tokens", out
