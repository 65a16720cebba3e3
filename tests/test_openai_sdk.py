"""The official OpenAI Python SDK against ``m3jax serve`` (real HTTP on localhost, the tiny checkpoint): what the SDK
sends (its defaults, nulls, prompt lists, stream_options) and what it parses (every field it reads, its error
classes) works as with OpenAI's own server (#49)."""

import numpy as np
import openai
import pytest

from m3jax.generate import generate
from served_checkpoint import MODEL_NAME, served_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  with served_checkpoint(tmp_path_factory.mktemp("sdk")) as s:
    s["client"] = openai.OpenAI(base_url=s["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield s


def _greedy_text(served, ids, n):
  model = served["model"]
  eos = model.config.text.eos_token_ids
  out = generate(model, [ids], max_new_tokens=n, eos_token_ids=eos)
  gen = out.tokens[0, : out.lengths[0]].tolist()
  return served["tok"].decode(gen[:-1] if gen[-1] in eos else gen), ("stop" if gen[-1] in eos else "length")


@pytest.mark.quick
def test_models_and_errors_parse_as_the_sdks_types(served):
  client = served["client"]
  assert [m.id for m in client.models.list()] == [MODEL_NAME]
  assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
  with pytest.raises(openai.NotFoundError):
    client.models.retrieve("gpt-4o")
  with pytest.raises(openai.NotFoundError) as e:
    client.completions.create(model="gpt-4o", prompt="Hello", max_tokens=2)
  assert (e.value.status_code, e.value.code, e.value.param) == (404, "model_not_found", "model")
  assert "does not exist" in e.value.message
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model=MODEL_NAME, prompt="Hello", temperature=-1)
  assert (e.value.status_code, e.value.param, e.value.code) == (400, "temperature", None)
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}])
  assert "image_url parts are not supported" in e.value.message


def test_completions_echo_lists_logprobs_and_stop(served):
  from m3jax.scoring import score_continuations  # pylint: disable=g-import-not-at-top
  client, tok = served["client"], served["tok"]
  a = tok.encode("The quick brown fox jumps", add_special_tokens=False).ids
  b = tok.encode("Hello there", add_special_tokens=False).ids
  # lm-eval's loglikelihood request, through the SDK (nulls for what it leaves to the server).
  r = client.completions.create(model=MODEL_NAME, prompt=[a, b], max_tokens=1, logprobs=1, echo=True,
                                temperature=0, n=None, stop=None, seed=None)
  assert r.object == "text_completion" and r.model == MODEL_NAME and r.id.startswith("cmpl-") and r.created > 0
  assert [c.index for c in r.choices] == [0, 1]
  assert r.usage.prompt_tokens == len(a) + len(b) and r.usage.completion_tokens == 2
  for ids, c in zip((a, b), r.choices):
    lp = c.logprobs
    assert c.text.startswith(tok.decode(ids)) and c.finish_reason in ("stop", "length")
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = score_continuations(served["model"], [ids[:1]], [ids[1:]]).logprob[0]
    assert sum(lp.token_logprobs[1:-1]) == pytest.approx(float(want), rel=1e-5, abs=1e-5)
  # A list of text prompts, each its own choice with its greedy text.
  prompts = ["What is sparse attention?", "Hello"]
  listed = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, temperature=0)
  for i, (p, c) in enumerate(zip(prompts, listed.choices)):
    text, reason = _greedy_text(served, tok.encode(p, add_special_tokens=False).ids, 4)
    assert (c.index, c.text, c.finish_reason, c.logprobs) == (i, text, reason, None)
  # Stop strings: the text and the listed tokens end before it.
  full, _ = _greedy_text(served, tok.encode("The quick brown fox", add_special_tokens=False).ids, 30)
  stop = full[len(full) // 2:len(full) // 2 + 2]
  r = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=30, stop=[stop],
                                logprobs=2)
  c = r.choices[0]
  assert c.text == full[:full.find(stop)] and c.finish_reason == "stop"
  assert all(len(top) == 2 for top in c.logprobs.top_logprobs) and max(c.logprobs.text_offset) < len(c.text)
  # Streamed completions: the same text, chunk by chunk, and the usage last.
  chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, stream=True,
                                          stream_options={"include_usage": True}))
  for i, c in enumerate(listed.choices):
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) == c.text
  assert chunks[-1].choices == [] and chunks[-1].usage == listed.usage


def test_chat_text_parts_streaming_with_usage_and_logprobs(served):
  client = served["client"]
  parts = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Hi there"}]
  whole = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": parts}],
                                         max_tokens=6, logprobs=True, top_logprobs=2, temperature=None)
  choice = whole.choices[0]
  assert whole.object == "chat.completion" and choice.message.role == "assistant" and choice.index == 0
  assert choice.finish_reason in ("stop", "length") and whole.usage.total_tokens == (
      whole.usage.prompt_tokens + whole.usage.completion_tokens)
  content = choice.logprobs.content
  assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
  np.testing.assert_array_less([e.logprob for e in content], 1e-6)
  stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": parts}],
                                          max_tokens=6, stream=True, stream_options={"include_usage": True})
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
  assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
  assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_n_choices_whole_and_streamed(served):
  client = served["client"]
  body = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi there"}], max_tokens=5, n=2,
              temperature=0.9, seed=5)
  whole = client.chat.completions.create(**body)
  assert [c.index for c in whole.choices] == [0, 1]
  assert whole.choices[0].message.content != whole.choices[1].message.content  # seeds 5 and 6: two samples
  chunks = list(client.chat.completions.create(**body, stream=True))
  for c in whole.choices:
    mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
    assert mine[0].delta.role == "assistant" and "".join(m.delta.content or "" for m in mine) == c.message.content
    assert mine[-1].finish_reason == c.finish_reason
