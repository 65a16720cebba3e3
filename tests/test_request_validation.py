"""The server's request validators (m3jax.request_validation) as pure functions: the body's size from its headers,
the JSON body, every field against the engine's limits (#45), and property tests (hypothesis) that random bodies
and headers either pass or raise RequestError, never anything else."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3jax.request_validation import (CHAT, COMPLETIONS, IMAGE_MARKER, INT32_MAX, ImagePart, Limits, RequestError,
                                      body_length, check_prompt, decode_body, parse_request)
from m3jax.sampling import SamplingParams

LIMITS = Limits(vocab_size=384, max_length=256, max_logprobs=3, max_body_bytes=10_000, placeholder_ids=(5, 6),
                model_name="tiny")


def _refused(path, body, status=400):
  with pytest.raises(RequestError) as e:
    parse_request(path, body, LIMITS)
  assert e.value.status == status
  return str(e.value)


@pytest.mark.quick
def test_image_parts_become_markers_on_a_server_that_takes_images():
  limits = Limits(vocab_size=384, max_length=256, placeholder_ids=(5, 6), max_images=2)
  url = "data:image/png;base64,iVBORw0KGgo="

  def chat(content):
    return parse_request(CHAT, {"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": content}]}, limits)

  def image(u=url):
    return {"type": "image_url", "image_url": {"url": u, "detail": "high"}}

  text = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
  parsed = chat([image(), *text, image("data:image/jpeg;base64,/9j/"), {"type": "text", "text": "c"}])
  assert parsed.messages[1]["content"] == IMAGE_MARKER + "a\nb" + IMAGE_MARKER + "c"  # text parts joined, images bare
  assert parsed.images == (ImagePart("messages.[1].content.[0]", url),
                           ImagePart("messages.[1].content.[3]", "data:image/jpeg;base64,/9j/"))
  assert chat("plain").images == ()
  for content, param, message in (
      ([image("http://x.org/a.png")], "messages.[1].content.[0]", "image URLs are not fetched"),
      ([*text, image("file:a.png")], "messages.[1].content.[2]", "file: URLs are not read"),
      ([image("a.png")], "messages.[1].content.[0]", "expected a data: URL"),
      ([image()] * 3, "messages.[1].content.[2]", "at most 2 images per request"),
      ([{"type": "image_url", "image_url": "data:,"}], "messages.[1].content.[0]", 'expected {"type": "image_url"'),
      ([{"type": "input_audio"}], "messages.[1].content.[0]", "input_audio parts are not supported"),
  ):
    with pytest.raises(RequestError) as e:
      chat(content)
    assert e.value.param == param and message in str(e.value), str(e.value)
  # Placeholder ids of the client's own are refused either way; the server's own (with_images) pass.
  with pytest.raises(RequestError, match=r"placeholder tokens \[5\] with no image behind them; remove them \(send "):
    check_prompt([1, 5], 2, limits)
  check_prompt([1, 5], 2, limits, with_images=True)


@pytest.mark.quick
def test_int32_fields_are_checked_at_the_edge():
  """#45: top_k 2147483648 reached the engine's int32 arrays (a 500 for it and every later request)."""
  assert "top_k must be an integer in [-1, 2147483647]" in _refused(COMPLETIONS, {"prompt": "x", "top_k": 2**31})
  assert "seed must be an integer in [0, 2147483647]" in _refused(COMPLETIONS, {"prompt": "x", "seed": 2**31})
  assert "seed must be an integer" in _refused(COMPLETIONS, {"prompt": "x", "seed": -1})
  assert "top_k must be an integer" in _refused(COMPLETIONS, {"prompt": "x", "top_k": 2.0})
  assert "temperature must be a finite number >= 0" in _refused(COMPLETIONS, {"prompt": "x", "temperature": 1e39})
  ok = parse_request(COMPLETIONS, {"prompt": "x", "top_k": INT32_MAX, "seed": INT32_MAX, "temperature": 1}, LIMITS)
  assert ok.sampling == {"top_k": INT32_MAX, "seed": INT32_MAX, "temperature": 1.0}
  SamplingParams(temperature=1.0, top_k=ok.sampling["top_k"])  # what the edge accepts, the engine takes
  assert parse_request(COMPLETIONS, {"prompt": "x", "top_k": -1}, LIMITS).sampling == {"top_k": 0}


def test_lengths_vocabulary_and_placeholders():
  assert "max_tokens must be a positive integer, got 2.5" in _refused(COMPLETIONS, {"prompt": "x", "max_tokens": 2.5})
  assert "exceeds the engine's max_length (256)" in _refused(COMPLETIONS, {"prompt": "x", "max_tokens": 256})
  assert "n must be an integer in [1, 64], got 65" in _refused(COMPLETIONS, {"prompt": "x", "n": 65})
  assert parse_request(COMPLETIONS, {"prompt": ["x", "y"], "n": 3}, LIMITS).n == 3
  assert "stream must be true or false" in _refused(COMPLETIONS, {"prompt": "x", "stream": "yes"})
  assert "stop strings may hold at most 1024" in _refused(COMPLETIONS, {"prompt": "x", "stop": "a" * 2000})
  assert "message 1: each message needs a string role" in _refused(
      CHAT, {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": 3}]})
  assert _refused("/v1/embeddings", {}, 404) == "no route /v1/embeddings"
  for ids, message in (([], "the prompt has no tokens"), ([1, 384], "prompt ids outside [0, 384): [384]"),
                       ([1, 5, 2], "image / video placeholder tokens [5]"),
                       (list(range(10, 250)), "prompt (240 tokens) + max_tokens (20) exceeds")):
    with pytest.raises(RequestError, match=re.escape(message)):
      check_prompt(ids, 20, LIMITS)
  check_prompt(list(range(10, 246)), 10, LIMITS)  # exactly max_length


@pytest.mark.quick
def test_null_means_default_and_openai_fields():
  """#49: explicit nulls (as SDK wrappers send) got 400s; echo, prompt lists, text parts and the model are read."""
  nulls = {k: None for k in ("max_tokens", "n", "echo", "logprobs", "stop", "temperature", "top_p", "top_k", "seed",
                             "stream", "stream_options", "best_of", "logit_bias", "suffix", "model",
                             "skip_special_tokens", "presence_penalty", "frequency_penalty")}
  parsed = parse_request(COMPLETIONS, {"prompt": "x", **nulls}, LIMITS)
  assert parsed.max_tokens == 16 and parsed.sampling == {} and parsed.stop == () and parsed.logprobs is None
  assert not parsed.echo and not parsed.stream and parsed.skip_special_tokens and parsed.prompts == ("x",)
  chat = parse_request(CHAT, {"messages": [{"role": "user", "content": "x"}], **nulls, "top_logprobs": None}, LIMITS)
  assert chat.max_tokens == 255 and chat.messages  # 256, within max_length == ({"role": "user", "content": "x"},)
  many = parse_request(COMPLETIONS, {"prompt": [[1, 2], [3]], "echo": True, "max_tokens": 0, "model": "tiny"}, LIMITS)
  assert many.prompts == ((1, 2), (3,)) and many.echo and many.max_tokens == 0
  assert parse_request(COMPLETIONS, {"prompt": ["a", "b"]}, LIMITS).prompts == ("a", "b")
  assert parse_request(COMPLETIONS, {"prompt": [[7]]}, LIMITS).prompts == ((7,),)
  parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
  assert parse_request(CHAT, {"messages": [{"role": "user", "content": parts}]}, LIMITS).messages[0]["content"] == "a\nb"
  streamed = parse_request(CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                  "stream_options": {"include_usage": True}}, LIMITS)
  assert streamed.include_usage and streamed.stream
  with pytest.raises(RequestError) as e:
    parse_request(COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, LIMITS)
  assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")
  assert e.value.body()["error"] == {"message": str(e.value), "type": "invalid_request_error", "param": "model",
                                     "code": "model_not_found"}
  image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
  assert "image_url parts are not supported" in _refused(CHAT, {"messages": [{"role": "user", "content": image}]})
  assert "max_tokens must be a positive integer, got 0 (0 only with echo: true)" in _refused(
      COMPLETIONS, {"prompt": "x", "max_tokens": 0})
  assert "prompt 1 must be a non-empty string or list of token ids" in _refused(COMPLETIONS, {"prompt": ["a", []]})
  assert "stream_options must be an object, and only with stream: true" in _refused(
      COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}})
  assert "echo must be true or false" in _refused(COMPLETIONS, {"prompt": "x", "echo": 1})
  with pytest.raises(RequestError) as e:
    parse_request(COMPLETIONS, {"prompt": "x", "temperature": -1}, LIMITS)
  assert e.value.param == "temperature" and e.value.body()["error"]["code"] is None


@pytest.mark.parametrize("headers, status, message", [
    ({"Content-Length": "-1"}, 400, "Content-Length must be a non-negative integer, got '-1'"),
    ({"Content-Length": "12abc"}, 400, "Content-Length must be a non-negative integer"),
    ({"Content-Length": "١٢"}, 400, "Content-Length must be a non-negative integer"),  # Arabic-Indic digits
    ({}, 411, "needs a Content-Length"),
    ({"Transfer-Encoding": "chunked"}, 411, "Transfer-Encoding: chunked bodies are not accepted"),
    ({"Transfer-Encoding": "chunked", "Content-Length": "5"}, 411, "Transfer-Encoding: chunked"),
    ({"Content-Length": str(10 * 2**20)}, 413, "the body is 10485760 bytes; this server accepts at most 10000"),
])
def test_body_size_is_known_before_reading(headers, status, message):
  with pytest.raises(RequestError) as e:
    body_length(headers, 10_000)
  assert e.value.status == status and message in str(e.value)


def test_bodies_that_are_not_strict_json_objects():
  for data, message in ((b"[1, 2]", "must be a JSON object, got a JSON list"),
                        (b'{"temperature": NaN}', "NaN is not a JSON number"),
                        (b'{"temperature": Infinity}', "Infinity is not a JSON number"),
                        (b"\xff\xfe", "not UTF-8"), (b"{", "not JSON"),
                        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply")):
    with pytest.raises(RequestError, match=message):
      decode_body(data)
  assert decode_body(b'{"prompt": "x"}') == {"prompt": "x"}


# ---------------------------------------------------------------------------------------------------------------
# Properties: any body, any headers -> a ParsedRequest / a size, or RequestError; never another exception.

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=True),
                     st.text(max_size=8))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                     max_leaves=12)
_FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
           "stop", "n", "stream", "logprobs", "top_logprobs", "echo", "best_of", "logit_bias", "suffix", "tools",
           "presence_penalty", "frequency_penalty", "response_format", "model", "stream_options",
           "skip_special_tokens"]
_FIELD_VALUES = st.one_of(_JSON, st.lists(st.integers(-5, 400), max_size=6),
                          st.lists(st.fixed_dictionaries({"role": _SCALARS, "content": _SCALARS}), max_size=3))
_BODIES = st.one_of(_JSON, st.dictionaries(st.sampled_from(_FIELDS), _FIELD_VALUES, max_size=8))


@pytest.mark.quick
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_BODIES, chat=st.booleans())
def test_any_body_is_parsed_or_refused_with_a_request_error(body, chat):
  try:
    parsed = parse_request(CHAT if chat else COMPLETIONS, body, LIMITS)
  except RequestError as e:
    assert e.status in (400, 404) and str(e) and "\n" not in str(e)
    assert (e.status == 404) == (e.code == "model_not_found")
    return
  # What passes is what the engine can run.
  assert isinstance(parsed.max_tokens, int) and (0 if parsed.echo else 1) <= parsed.max_tokens < LIMITS.max_length
  SamplingParams(**{k: v for k, v in parsed.sampling.items() if k != "seed"})
  assert 0 <= parsed.sampling.get("seed", 0) <= INT32_MAX
  assert (parsed.messages is not None) == chat == (parsed.prompts is None)
  for prompt in parsed.prompts or ():
    assert (isinstance(prompt, str) and prompt) or (isinstance(prompt, tuple) and prompt)
    if isinstance(prompt, tuple):
      try:
        check_prompt(prompt, parsed.max_tokens, LIMITS)
      except RequestError:
        pass


@settings(max_examples=100, deadline=None)
@given(data=st.one_of(st.binary(max_size=64), _JSON.map(lambda v: json.dumps(v).encode())))
def test_any_body_bytes_decode_or_are_refused(data):
  try:
    body = decode_body(data)
  except RequestError as e:
    assert e.status == 400
    return
  assert isinstance(body, dict)


@settings(max_examples=100, deadline=None)
@given(headers=st.dictionaries(st.sampled_from(["Content-Length", "Transfer-Encoding", "Content-Type"]),
                               st.one_of(st.text(max_size=12), st.integers(-10, 2**40).map(str)), max_size=3))
def test_any_headers_give_a_size_within_the_limit_or_a_request_error(headers):
  try:
    length = body_length(headers, 10_000)
  except RequestError as e:
    assert e.status in (400, 411, 413)
    return
  assert 0 <= length <= 10_000
