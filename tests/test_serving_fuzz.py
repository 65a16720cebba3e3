"""``m3jax serve`` fuzzed from its own OpenAPI document (#49): schemathesis generates requests for every operation
of ``/openapi.json``, bodies that follow the schema and bodies that break it, and each must get a reply that is
not a 5xx, within a timeout (no hang), whose status, content type and JSON body the document describes; after
them the server is healthy and the engine holds no request. A few examples per operation (hypothesis,
derandomized), generation lengths capped by ``_bounded`` so that it stays cheap on the tiny served checkpoint."""

import base64
import io
import json
import time
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from PIL import Image
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from served_checkpoint import MODEL_NAME, served_checkpoint

EXAMPLES = 25  # per operation and generation mode
TIMEOUT_S = 60  # a reply slower than this is a hang (the slowest legitimate one here takes well under a second)
MAX_TOKENS, MAX_N, MAX_PROMPTS = 4, 2, 3  # generation bounded: prompts x n x max_tokens tokens per request at most


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  with served_checkpoint(tmp_path_factory.mktemp("fuzz"), vision=True) as s:  # image parts are decoded
    yield s


@pytest.fixture(scope="module")
def schema(served):
  return schemathesis.openapi.from_url(served["url"] + "/openapi.json")


@pytest.mark.quick
def test_the_openapi_document_describes_every_route():
  from m3jax.serving_app import create_app  # pylint: disable=g-import-not-at-top
  doc = create_app().openapi()  # what /openapi.json serves (the fuzz tests below read it over HTTP)
  assert doc["openapi"].startswith("3.")
  assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
                               "/v1/models", "/v1/models/{name}", "/metrics", "/tokenizer_info"}
  schemas = doc["components"]["schemas"]
  for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
    body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": f"#/components/schemas/{model}"}
    assert {"400", "404", "503"} <= set(doc["paths"][path]["post"]["responses"])
  assert schemas["CompletionRequest"]["required"] == ["prompt"]
  assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
  assert "422" not in json.dumps(doc)  # pydantic failures are 400s in OpenAI's shape, never FastAPI's 422
  refs = {part.split('"')[0] for part in json.dumps(doc).split('"$ref": "#/components/schemas/')[1:]}
  assert refs <= set(schemas), refs - set(schemas)  # every reference resolves


def _bounded(case) -> None:
  """Keeps a generated body cheap to serve and past the checks test_serving covers: the served model's name
  (another gets a 404), chat roles the template takes, and generation lengths, choices and prompt lists capped."""
  body = case.body
  if not isinstance(body, dict):
    return
  if isinstance(body.get("model"), str):
    body["model"] = MODEL_NAME
  for key, cap in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS), ("n", MAX_N)):
    if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > cap:
      body[key] = cap
  messages = body.get("messages")
  if isinstance(messages, list):  # the test template refuses other roles (tested in test_serving)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
      body["max_tokens"] = MAX_TOKENS  # chat's default (256) does not fit the tiny engine (tested in test_serving)
    for m in messages:
      if isinstance(m, dict) and isinstance(m.get("role"), str):
        m["role"] = "user"
      for part in m.get("content") if isinstance(m, dict) and isinstance(m.get("content"), list) else ():
        _image_url(part)
  prompt = body.get("prompt")
  if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
    body["prompt"] = prompt[:MAX_PROMPTS]


def _png_url() -> str:
  """A 30 x 20 PNG as a data: URL: what a generated image part's URL becomes one time in three."""
  out = io.BytesIO()
  Image.new("RGB", (30, 20), (200, 120, 40)).save(out, format="PNG")
  return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


_PNG = _png_url()


def _image_url(part) -> None:
  """An image part's generated URL kept (random text: a 400), its text sent as a base64 data URL's bytes (not an
  image: a 400), or a real image (a reply), by its length modulo 3."""
  spec = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
  url = spec.get("url") if isinstance(spec, dict) else None
  if isinstance(url, str) and len(url) % 3 == 1:
    spec["url"] = "data:image/png;base64," + base64.b64encode(url.encode("utf-8", "replace")).decode()
  elif isinstance(url, str) and len(url) % 3 == 2:
    spec["url"] = _PNG


def _wait_until_idle(engine, seconds=60) -> None:
  deadline = time.monotonic() + seconds
  while any(s is not None for s in engine._slots) or engine._waiting:  # pylint: disable=protected-access
    assert time.monotonic() < deadline, "the engine still holds a request"
    time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
                         ids=["schema-valid", "schema-breaking"])
def test_fuzzed_requests_get_no_5xx_and_no_hang(served, schema, mode):
  checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
  operations = [result.ok() for result in schema.get_all_operations()]
  assert len(operations) == 9
  if mode == schemathesis.GenerationMode.NEGATIVE:  # a body to break: the POST routes (the GETs take none)
    operations = [op for op in operations if op.method.upper() == "POST"]
  statuses: dict[str, set[int]] = {}
  for operation in operations:

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
      _bounded(case)
      response = case.call(base_url=served["url"], timeout=TIMEOUT_S)
      statuses.setdefault(operation.label, set()).add(response.status_code)
      case.validate_response(response, checks=checks)

    fuzz()
  assert all(status < 500 for codes in statuses.values() for status in codes), statuses
  if mode == schemathesis.GenerationMode.POSITIVE:  # valid requests reach the engine: some are served
    assert 200 in statuses["POST /v1/completions"] and 200 in statuses["POST /v1/chat/completions"], statuses
  else:
    assert 400 in statuses["POST /v1/completions"], statuses
  _wait_until_idle(served["engine"])
  with urllib.request.urlopen(served["url"] + "/health", timeout=30) as r:
    assert json.loads(r.read()) == {"status": "ok"}
