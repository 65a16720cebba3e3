"""The OpenAI-compatible server: completions and chat, whole and streamed, concurrent requests sharing the engine's
slots (each gets generate()'s greedy tokens), and clear 400s for what it does not serve."""

import concurrent.futures
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

import m3jax
from m3jax.engine import Engine
from m3jax.generate import generate
from m3jax.serving import Server
from m3jax.serving_http import serve
from m3jax.tokenizer import render_messages
from served_checkpoint import served_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  with served_checkpoint(tmp_path_factory.mktemp("serve")) as s:
    yield s


def _post(url, body, raw=False):
  req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=300) as r:
    data = r.read().decode()
  return data if raw else json.loads(data)


def _greedy(s, ids, n):
  eos = s["model"].config.text.eos_token_ids
  out = generate(s["model"], [ids], max_new_tokens=n, eos_token_ids=eos)
  ids = out.tokens[0, : out.lengths[0]].tolist()
  stopped = ids[-1] in eos
  return s["tok"].decode(ids[:-1] if stopped else ids, skip_special_tokens=True), ("stop" if stopped else "length"), ids


@pytest.mark.quick
def test_models_and_health(served):
  with urllib.request.urlopen(served["url"] + "/v1/models") as r:
    assert json.loads(r.read())["data"][0]["id"] == "tiny-m3"
  with urllib.request.urlopen(served["url"] + "/health") as r:
    assert json.loads(r.read()) == {"status": "ok"}


@pytest.mark.slow
def test_concurrent_completions_each_get_their_own_greedy_text(served):
  prompts = ["What is sparse attention?", "Hello", "A block holds one hundred and twenty-eight keys,",
             "Why a shared expert?", "The quick brown fox"]
  budgets = [7, 3, 9, 5, 6]
  with concurrent.futures.ThreadPoolExecutor(5) as pool:  # 5 requests, 2 slots: they queue and share the engine
    replies = list(pool.map(lambda pb: _post(served["url"] + "/v1/completions",
                                             {"prompt": pb[0], "max_tokens": pb[1], "model": "tiny-m3"}),
                            zip(prompts, budgets)))
  for p, n, r in zip(prompts, budgets, replies):
    text, reason, ids = _greedy(served, served["tok"].encode(p, add_special_tokens=False).ids, n)
    assert r["object"] == "text_completion" and r["model"] == "tiny-m3"
    assert r["choices"][0]["text"] == text and r["choices"][0]["finish_reason"] == reason
    assert r["usage"]["completion_tokens"] == len(ids)


def test_chat_whole_and_streamed(served):
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
  ids = served["tok"].encode(render_messages(served["ckpt"], messages), add_special_tokens=False).ids
  text, reason, _ = _greedy(served, ids, 8)
  whole = _post(served["url"] + "/v1/chat/completions", {"messages": messages, "max_tokens": 8})
  assert whole["object"] == "chat.completion"
  assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}
  assert whole["usage"]["prompt_tokens"] == len(ids)
  raw = _post(served["url"] + "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "stream": True},
              raw=True)
  events = [line[len("data: "):] for line in raw.split("\n\n") if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  chunks = [json.loads(e) for e in events[:-1]]
  assert len(chunks) >= 3  # 8 tokens at 3 per decode call
  assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == text
  assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [reason]
  assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and "role" not in chunks[1]["choices"][0]["delta"]


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature must be a finite number >= 0"),
    ("/v1/completions", {"prompt": "x", "top_p": "high"}, "top_p must be a number"),
    ("/v1/completions", {"prompt": ""}, '"prompt" must be a non-empty string, a list of token ids, or a list'),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens must be a positive integer"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 300}, "exceeds the engine's max_length (256)"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt ids outside"),
    ("/v1/completions", {"prompt": [1, True]}, '"prompt" must be a non-empty string, a list of token ids, or a'),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": True}, "max_tokens must be a positive integer"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n must be an integer in [1, 64], got 0"),
    ("/v1/completions", {"prompt": ["x"] * 40, "n": 2}, "40 prompts x n=2 choices: at most 64 per request"),
    ("/v1/chat/completions", {"messages": []}, '"messages" must be a non-empty list'),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop must be a string or a list of at most 16 strings"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, "stop must be a string or a list of at most 16"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 5}, "at most 3 log-probabilities per token"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs needs logprobs: true"),
    ("/v1/completions", {"prompt": "x", "logprobs": "yes"}, "logprobs must be a non-negative integer"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty=0.5 is not supported"),
])
@pytest.mark.quick
def test_requests_it_cannot_serve_get_a_400_naming_why(served, path, body, message):
  with pytest.raises(urllib.error.HTTPError) as e:
    _post(served["url"] + path, body)
  assert e.value.code == 400
  assert message in json.loads(e.value.read())["error"]["message"]


@pytest.mark.quick
def test_greedy_defaults_are_accepted_and_unknown_routes_are_404(served):
  r = _post(served["url"] + "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 2, "temperature": 0,
                                                 "top_p": 1.0})
  assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                        "prompt_tokens_details": {"cached_tokens": 0}}  # no full page: nothing to read from the cache
  with pytest.raises(urllib.error.HTTPError) as e:
    _post(served["url"] + "/v1/embeddings", {"input": "x"})
  assert e.value.code == 404


def test_serve_command_starts_a_server(served):
  import os  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen([sys.executable, "-m", "m3jax.cli", "serve", served["ckpt"], "--port", "0", "--slots", "2",
                           "--max-length", "128", "--kernels", "reference"], cwd=repo, stderr=subprocess.PIPE,
                          text=True, env={**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"})
  try:
    line = proc.stderr.readline()
    # A vision-language checkpoint: its vision tower is loaded (text replies are the text backbone's all the same).
    port = re.search(r"http://127.0.0.1:(\d+)/v1 \(2 slots, up to 128 tokens per request, up to 8 images per chat "
                     r"request\)", line)
    assert port, line
    r = _post(f"http://127.0.0.1:{port.group(1)}/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert r["choices"][0]["text"] == _greedy(served, served["tok"].encode("Hello", add_special_tokens=False).ids,
                                              3)[0]
  finally:
    proc.terminate()
    proc.wait(timeout=60)


def test_sampled_requests_follow_their_own_seed(served):
  body = {"prompt": "What is sparse attention?", "max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": 3}
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    a, b, c = pool.map(lambda x: _post(served["url"] + "/v1/completions", x),
                       [body, dict(body, prompt="Hello"), body])
  assert a["choices"][0]["text"] == c["choices"][0]["text"]  # same request, same seed: same text, whatever ran beside
  other = _post(served["url"] + "/v1/completions", dict(body, seed=4))
  greedy = _post(served["url"] + "/v1/completions", dict(body, temperature=0))
  assert len({a["choices"][0]["text"], other["choices"][0]["text"], greedy["choices"][0]["text"]}) == 3


def test_stop_strings_end_the_text_before_them_whole_and_streamed(served):
  ids = served["tok"].encode("The quick brown fox", add_special_tokens=False).ids
  text, _, _ = _greedy(served, ids, 40)
  assert len(text) > 12
  stop = text[len(text) // 2:len(text) // 2 + 2]
  want = text[:text.find(stop)]
  body = {"prompt": ids, "max_tokens": 40, "stop": [stop, "never-in-the-text"]}
  whole = _post(served["url"] + "/v1/completions", body)
  assert whole["choices"][0]["text"] == want and whole["choices"][0]["finish_reason"] == "stop"
  assert whole["usage"]["completion_tokens"] < 40  # counted up to the token that completed the stop string
  raw = _post(served["url"] + "/v1/completions", {**body, "stream": True}, raw=True)
  chunks = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.startswith("data: {")]
  assert "".join(c["choices"][0]["text"] for c in chunks) == want
  assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
  # The request's slot was given back early: the engine has nothing left running.
  _wait_until_idle(served)


def _wait_until_idle(served, seconds=60):
  import time  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + seconds
  engine = served["engine"]
  while any(s is not None for s in engine._slots) or engine._waiting:  # pylint: disable=protected-access
    assert time.monotonic() < deadline, "the engine still holds the request"
    time.sleep(0.05)


def test_a_streaming_client_that_hangs_up_frees_its_slot(served):
  import socket  # pylint: disable=g-import-not-at-top
  _wait_until_idle(served)
  calls = served["engine"].decode_calls
  host, port = served["url"].removeprefix("http://").split(":")
  body = json.dumps({"prompt": [7, 8, 9], "max_tokens": 240, "stream": True}).encode()
  with socket.create_connection((host, int(port)), timeout=300) as sock:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while b"data: {" not in received:  # the first tokens came
      received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 200")
  _wait_until_idle(served)
  # 240 tokens at 3 per call would take 80 calls; the server noticed the hang-up at its next write.
  assert served["engine"].decode_calls - calls < 20


def test_logprobs_list_the_shown_tokens_whole_streamed_and_in_chat(served):
  from m3jax.scoring import token_logprobs  # pylint: disable=g-import-not-at-top

  ids = served["tok"].encode("naïve 数据 🙂", add_special_tokens=False).ids
  text, reason, gen = _greedy(served, ids, 12)
  shown = gen[:-1] if reason == "stop" else gen
  want = token_logprobs(served["model"], [ids + gen]).logprobs[0, len(ids):len(ids) + len(shown)]
  body = {"prompt": ids, "max_tokens": 12, "logprobs": 2}
  whole = _post(served["url"] + "/v1/completions", body)["choices"][0]
  lp = whole["logprobs"]
  assert whole["text"] == text
  # Tokens holding part of a character are named by their bytes (#49), so the names spell the text's UTF-8.
  spelled = b"".join(bytes.fromhex(t[len("bytes:"):].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
                     for t in lp["tokens"])
  assert spelled.decode("utf-8", "replace") == text
  assert len(lp["token_logprobs"]) == len(shown) == len(lp["top_logprobs"]) == len(lp["text_offset"])
  np.testing.assert_allclose(lp["token_logprobs"], want, atol=2e-2)  # decode steps vs one scoring forward
  for chosen, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
    assert len(top) <= 2 and max(top.values()) == pytest.approx(value, abs=1e-6)  # greedy: the top token
  raw = _post(served["url"] + "/v1/completions", {**body, "stream": True}, raw=True)
  chunks = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.startswith("data: {")]
  streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
  assert streamed == lp["token_logprobs"]
  assert [x for c in chunks for x in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]
  # Offsets index the reply's characters: a token that starts a character starts at its offset.
  for t, o in zip(lp["tokens"], lp["text_offset"]):
    if not t.startswith("bytes:"):
      assert text[o:].startswith(t), (t, o)
  # Chat: per-token entries whose bytes spell the reply exactly (a token may hold part of a character).
  messages = [{"role": "user", "content": "Say something in Chinese"}]
  chat = _post(served["url"] + "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "logprobs": True,
                                                        "top_logprobs": 3})["choices"][0]
  content = chat["logprobs"]["content"]
  special = {t.content for t in served["tok"].get_added_tokens_decoder().values() if t.special}
  spelled = bytes(b for e in content if e["token"] not in special for b in e["bytes"])  # special: not in the text
  assert spelled.decode("utf-8", "replace") == chat["message"]["content"]
  assert all(len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
             for e in content)
  none = _post(served["url"] + "/v1/chat/completions", {"messages": messages, "max_tokens": 2})["choices"][0]
  assert none["logprobs"] is None


# Reliability (#45): no request breaks the server, a client that leaves frees its slot, bodies are sized first.


def _raw(served, data: bytes, *, wait_s: float = 60) -> bytes:
  """Sends raw bytes and reads until the server closes the connection (or ``wait_s`` passes)."""
  import socket  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  host, port = served["url"].removeprefix("http://").split(":")
  received = b""
  with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
    sock.sendall(data)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
      try:
        chunk = sock.recv(65536)
      except socket.timeout:
        break
      if not chunk:
        break
      received += chunk
  return received


def _health(url):
  try:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_a_top_k_beyond_int32_is_a_400_and_the_server_goes_on(served):
  """#45: this request got a 500 and so did every later one, while /health said ok."""
  body = {"prompt": "Hello", "max_tokens": 4, "temperature": 1, "top_k": 2147483648}
  with pytest.raises(urllib.error.HTTPError) as e:
    _post(served["url"] + "/v1/completions", body)
  assert e.value.code == 400
  assert "top_k must be an integer in [-1, 2147483647]" in json.loads(e.value.read())["error"]["message"]
  ok = _post(served["url"] + "/v1/completions", dict(body, top_k=2147483647, seed=1))
  assert ok["usage"]["completion_tokens"] == 4
  assert _health(served["url"]) == (200, {"status": "ok"})


@pytest.mark.parametrize("head, status, message", [
    (b"Content-Length: -1\r\n", 400, b"Invalid HTTP request received."),  # refused by the HTTP parser (h11)
    (b"Transfer-Encoding: chunked\r\n", 411, b"chunked bodies are not accepted"),
    (b"Content-Length: 10485760\r\n", 413, b"the body is 10485760 bytes; this server accepts at most"),
])
def test_bodies_are_sized_before_they_are_read_and_answered_once(served, head, status, message):
  """#45: Content-Length -1 hung, a chunked body was answered twice, a 10 MB body was tokenized before any check."""
  chunk = b'{"prompt": "Hello", "max_tokens": 2}'
  body = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n"
  reply = _raw(served, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head
               + b"\r\n" + body)
  assert reply.startswith(f"HTTP/1.1 {status} ".encode()) and message in reply
  assert reply.count(b"HTTP/1.1 ") == 1  # one answer, and the connection closed after it
  assert _health(served["url"])[0] == 200


def test_a_client_that_hangs_up_without_streaming_frees_its_slot(served):
  """#45: a non-streaming client that disconnected kept its slot until max_tokens."""
  import socket  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  _wait_until_idle(served)
  engine = served["engine"]
  calls = engine.decode_calls
  host, port = served["url"].removeprefix("http://").split(":")
  body = json.dumps({"prompt": [7, 8, 9], "max_tokens": 240}).encode()
  with socket.create_connection((host, int(port)), timeout=300) as sock:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 120
    while engine.decode_calls < calls + 2:  # it is being decoded
      assert time.monotonic() < deadline
      time.sleep(0.01)
  _wait_until_idle(served)
  assert served["engine"].decode_calls - calls < 20  # 240 tokens at 3 per call would take 80 calls


def test_template_refusals_and_placeholders_are_400s(served):
  """#45: a chat template calling raise_exception dropped the connection."""
  with pytest.raises(urllib.error.HTTPError) as e:
    _post(served["url"] + "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]})
  assert e.value.code == 400
  assert "the chat template refused the messages: unknown role tool" in json.loads(e.value.read())["error"]["message"]
  with pytest.raises(urllib.error.HTTPError) as e:  # ids 5 / 6 are the demo's image / video placeholders
    _post(served["url"] + "/v1/completions", {"prompt": [7, 5, 8], "max_tokens": 2})
  assert e.value.code == 400 and "placeholder tokens [5]" in json.loads(e.value.read())["error"]["message"]


def test_a_request_whose_serving_fails_gets_a_500_alone(served, monkeypatch):
  """A prefill that runs out of memory (simulated for prompt buckets of 128+) fails its own request, whole or
  streamed; the request beside it gets its greedy text and the server stays healthy."""
  import m3jax.engine as engine_module  # pylint: disable=g-import-not-at-top
  real = engine_module._admit_jit

  def admit(graph, params, prompts, *args, **kwargs):
    if prompts.shape[1] >= 128:
      raise RuntimeError("RESOURCE_EXHAUSTED: simulated out of memory")
    return real(graph, params, prompts, *args, **kwargs)

  monkeypatch.setattr(engine_module, "_admit_jit", admit)
  _wait_until_idle(served)
  long = {"prompt": list(range(10, 140)), "max_tokens": 3}
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    failing = pool.submit(_post, served["url"] + "/v1/completions", long)
    fine = pool.submit(_post, served["url"] + "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    with pytest.raises(urllib.error.HTTPError) as e:
      failing.result()
    reply = fine.result()
  assert e.value.code == 500
  assert "generation failed: RuntimeError: RESOURCE_EXHAUSTED: simulated" in json.loads(e.value.read())["error"]["message"]
  ids = served["tok"].encode("Hello", add_special_tokens=False).ids
  assert reply["choices"][0]["text"] == _greedy(served, ids, 3)[0]
  raw = _post(served["url"] + "/v1/completions", {**long, "stream": True}, raw=True)
  events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
  assert events[-1] == "[DONE]" and "RESOURCE_EXHAUSTED" in json.loads(events[0])["error"]["message"]
  assert _health(served["url"]) == (200, {"status": "ok"})
  _wait_until_idle(served)


def test_health_reports_an_engine_that_cannot_serve(served, monkeypatch):
  import jax  # pylint: disable=g-import-not-at-top
  import m3jax.engine as engine_module  # pylint: disable=g-import-not-at-top
  from m3jax.generate import Decoder  # pylint: disable=g-import-not-at-top

  def steps(graph, params, decode_weights, logits, caches, *args, **kwargs):
    for x in jax.tree.leaves((logits, caches)):
      x.delete()
    raise RuntimeError("INTERNAL: simulated device fault")

  # A server of its own (the module's stays healthy), with the shapes of the module's engine (no new compile).
  engine = Engine(served["model"], slots=2, max_length=256, steps_per_call=3, logprobs=True, top_logprobs=3)
  server = Server(engine, served["ckpt"])
  httpd = serve(server, port=0)
  url = httpd.url
  try:
    assert _health(url) == (200, {"status": "ok"})
    monkeypatch.setattr(engine_module, "_steps_jit", steps)
    monkeypatch.setattr(Decoder, "init_paged_caches", lambda self, *a: (_ for _ in ()).throw(MemoryError("no memory")))
    with pytest.raises(urllib.error.HTTPError) as e:
      _post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert e.value.code == 500 and "simulated device fault" in json.loads(e.value.read())["error"]["message"]
    status, health = _health(url)
    assert status == 503 and health["status"] == "error" and "could not be rebuilt" in health["message"]
    with pytest.raises(urllib.error.HTTPError) as e:
      _post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert e.value.code == 503 and "the server cannot serve" in json.loads(e.value.read())["error"]["message"]
  finally:
    httpd.stop()
    server.close()


def test_serve_checks_its_port_before_loading_the_model(served, monkeypatch, capsys):
  """#45: a port in use gave a traceback, after the model had loaded."""
  import socket  # pylint: disable=g-import-not-at-top
  from m3jax import cli  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(m3jax, "load", lambda *a, **k: pytest.fail("the model was loaded"))
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    assert cli.main(["serve", served["ckpt"], "--port", str(port)]) == 2
  err = capsys.readouterr().err
  assert err == (f"m3jax serve: error: cannot listen on 127.0.0.1:{port}: Address already in use (another server "
                 "there? pick another --port)\n")


# API completeness (#49): echo, prompt lists, nulls, OpenAI's error shape, stream usage, text parts, special tokens,
# distinct top_logprobs keys, logprobs cut at a stop string, /metrics, the request log, the tokenizer routes.


def _events(raw):
  return [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.startswith("data: {")]


def test_echo_gives_the_prompt_its_log_probabilities_and_every_generated_token(served, monkeypatch):
  """What lm-eval's loglikelihood sends ({"prompt": [[ids], [ids]], "max_tokens": 1, "logprobs": 1, "echo": true})
  and reads (token_logprobs[ctxlen:-1]): the same numbers as score_continuations."""
  from m3jax.scoring import score_continuations, token_logprobs  # pylint: disable=g-import-not-at-top
  tok, model = served["tok"], served["model"]
  a = tok.encode("The quick brown fox jumps", add_special_tokens=False).ids
  b = tok.encode("naïve 数据", add_special_tokens=False).ids
  r = _post(served["url"] + "/v1/completions", {"prompt": [a, b], "max_tokens": 1, "logprobs": 1, "echo": True,
                                                 "temperature": 0, "model": "tiny-m3", "seed": 1234})
  assert [c["index"] for c in r["choices"]] == [0, 1]
  assert r["usage"] == {"prompt_tokens": len(a) + len(b), "completion_tokens": 2, "total_tokens": len(a) + len(b) + 2,
                        "prompt_tokens_details": {"cached_tokens": 0}}
  for ids, choice in zip((a, b), r["choices"]):
    lp = choice["logprobs"]
    text, _, gen = _greedy(served, ids, 1)
    assert choice["text"] == tok.decode(ids) + text
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = score_continuations(model, [ids[:2]], [ids[2:]]).logprob[0]  # lm-eval's sum over a continuation
    assert sum(lp["token_logprobs"][2:-1]) == pytest.approx(float(want), rel=1e-5, abs=1e-5)
    want = token_logprobs(model, [ids]).logprobs[0, 1:len(ids)]
    np.testing.assert_allclose(lp["token_logprobs"][1:-1], want, rtol=1e-5, atol=1e-5)
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
      assert len(top) == 1 and max(top.values()) >= value - 1e-6  # lm-eval's greedy test reads this
    assert lp["top_logprobs"][-1][lp["tokens"][-1]] == lp["token_logprobs"][-1]  # the generated token: greedy
    assert gen[0] == tok.token_to_id(lp["tokens"][-1]) or lp["tokens"][-1].startswith("bytes:")
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len(tok.decode(ids))
  alone = _post(served["url"] + "/v1/completions", {"prompt": a, "max_tokens": 0, "logprobs": 2, "echo": True})
  choice = alone["choices"][0]
  assert choice["text"] == tok.decode(a) and choice["finish_reason"] == "length"
  assert alone["usage"]["completion_tokens"] == 0 and len(choice["logprobs"]["tokens"]) == len(a)
  scored = token_logprobs(model, [a], top_k=2)
  assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(scored.logprobs[0, 1:len(a)].tolist(), abs=1e-6)
  for t in range(1, len(a)):  # the greedy token's logprob equals its top entry exactly (lm-eval's is_greedy)
    top = choice["logprobs"]["top_logprobs"][t]
    assert len(top) == 2 and list(top.values()) == scored.top_logprobs[0, t].tolist()
    if scored.greedy[0, t]:
      assert max(top.values()) == choice["logprobs"]["token_logprobs"][t]
  import m3jax.serving as serving_module  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(serving_module, "_SCORE_TOKENS", 16)  # one prompt per scoring forward: the same numbers
  apart = _post(served["url"] + "/v1/completions", {"prompt": [a, b], "max_tokens": 0, "logprobs": 2, "echo": True})
  for one, together in zip(apart["choices"], r["choices"]):
    np.testing.assert_allclose(one["logprobs"]["token_logprobs"][1:], together["logprobs"]["token_logprobs"][1:-1],
                               rtol=1e-6, atol=1e-6)
  monkeypatch.undo()
  # Streamed: each choice's first chunk is its prompt; the chunks add up to the whole reply, logprobs included.
  whole = _post(served["url"] + "/v1/completions", {"prompt": [a, b], "max_tokens": 4, "logprobs": 2, "echo": True})
  chunks = _events(_post(served["url"] + "/v1/completions", {"prompt": [a, b], "max_tokens": 4, "logprobs": 2,
                                                             "echo": True, "stream": True}, raw=True))
  for c in whole["choices"]:
    mine = [x["choices"][0] for x in chunks if x["choices"][0]["index"] == c["index"]]
    assert mine[0]["text"] == tok.decode((a, b)[c["index"]]) and mine[-1]["finish_reason"] == c["finish_reason"]
    assert "".join(x["text"] for x in mine) == c["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
      assert [v for x in mine for v in x["logprobs"][key]] == c["logprobs"][key], key
  echoed = _post(served["url"] + "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "echo": True})
  assert echoed["choices"][0]["text"] == "Hello" + _greedy(served, tok.encode("Hello", add_special_tokens=False).ids,
                                                            2)[0] and echoed["choices"][0]["logprobs"] is None


def test_a_list_of_prompts_gets_a_choice_each_whole_and_streamed_with_usage(served):
  prompts = ["What is sparse attention?", "Hello", "The quick brown fox"]  # 3 prompts, 2 slots
  want = [_greedy(served, served["tok"].encode(p, add_special_tokens=False).ids, 5) for p in prompts]
  whole = _post(served["url"] + "/v1/completions", {"prompt": prompts, "max_tokens": 5, "n": None, "stop": None,
                                                     "echo": None, "logprobs": None, "max_tokens ": None})
  assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
      (i, text, reason) for i, (text, reason, _) in enumerate(want)]
  assert whole["usage"]["completion_tokens"] == sum(len(ids) for _, _, ids in want)
  chunks = _events(_post(served["url"] + "/v1/completions", {"prompt": prompts, "max_tokens": 5, "stream": True,
                                                             "stream_options": {"include_usage": True}}, raw=True))
  for i, (text, reason, _) in enumerate(want):
    mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
    assert "".join(c["text"] for c in mine) == text and mine[-1]["finish_reason"] == reason
  assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
  assert all(c["usage"] is None for c in chunks[:-1])


def test_n_choices_per_prompt_follow_the_seed_plus_their_rank(served):
  body = {"prompt": ["What is sparse attention?", [7, 8, 9]], "max_tokens": 5, "temperature": 0.9, "seed": 11,
          "n": 2, "echo": True}
  r = _post(served["url"] + "/v1/completions", body)
  assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
  assert r["usage"]["prompt_tokens"] == len(served["tok"].encode(body["prompt"][0], add_special_tokens=False).ids) + 3
  for c in r["choices"]:  # choice c is prompt c // 2's (c % 2)-th, sampled with seed 11 + c % 2
    alone = _post(served["url"] + "/v1/completions", {**body, "prompt": body["prompt"][c["index"] // 2], "n": None,
                                                       "seed": 11 + c["index"] % 2})["choices"][0]
    assert c["text"] == alone["text"] and c["finish_reason"] == alone["finish_reason"]
  assert r["choices"][0]["text"] != r["choices"][1]["text"]  # two samples, not one twice
  chunks = _events(_post(served["url"] + "/v1/completions", {**body, "stream": True}, raw=True))
  for c in r["choices"]:
    assert "".join(x["choices"][0]["text"] for x in chunks if x["choices"][0]["index"] == c["index"]) == c["text"]


@pytest.mark.quick
def test_errors_use_openais_shape_and_an_unknown_model_is_a_404(served):
  for path, body, status, param, code in (
      ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model", "model_not_found"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model",
       "model_not_found"),
      ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
      ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
      ("/v1/embeddings", {"input": "x"}, 404, None, "not_found")):
    with pytest.raises(urllib.error.HTTPError) as e:
      _post(served["url"] + path, body)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == status and set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


@pytest.mark.quick
def test_schema_violations_wrong_methods_and_stalled_bodies_get_openais_error_shape(served, monkeypatch):
  """What the OpenAI schema of /openapi.json refuses beyond m3jax.request_validation's checks is a 400 naming the
  field (never FastAPI's 422); a known route with another method a 405; a body that stops arriving a 408."""
  import m3jax.serving_app as app_module  # pylint: disable=g-import-not-at-top
  for path, body, param in (("/v1/completions", {"prompt": "x", "max_tokens": 1, "user": 5}, "user"),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": 5}],
                                                      "stream_options": None}, "messages.[0].name"),
                            ("/tokenize", {"prompt": "x", "add_special_tokens": None, "user": []}, None)):
    try:
      reply = _post(served["url"] + path, body)
      assert param is None, reply  # fields the schema does not name are accepted
    except urllib.error.HTTPError as e:
      error = json.loads(e.read())["error"]
      assert (e.code, error["param"], error["type"]) == (400, param, "invalid_request_error"), error
      assert error["message"].startswith(f"{param}: "), error
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(served["url"] + "/v1/completions", timeout=30)
  assert e.value.code == 405 and json.loads(e.value.read())["error"] == {
      "message": "GET is not allowed on /v1/completions", "type": "invalid_request_error", "param": None,
      "code": "method_not_allowed"}
  monkeypatch.setattr(app_module, "_BODY_TIMEOUT_S", 0.5)
  reply = _raw(served, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"", wait_s=30)
  assert reply.startswith(b"HTTP/1.1 408 ") and b"the body did not arrive within 0.5 s" in reply
  assert reply.count(b"HTTP/1.1 ") == 1 and _health(served["url"])[0] == 200


def test_chat_text_parts_and_special_tokens(served):
  parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
  as_parts = _post(served["url"] + "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}],
                                                            "max_tokens": 4})
  as_text = _post(served["url"] + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi\nthere"}],
                                                           "max_tokens": 4})
  assert as_parts["choices"] == as_text["choices"] and as_parts["usage"] == as_text["usage"]
  with pytest.raises(urllib.error.HTTPError) as e:
    _post(served["url"] + "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}]})
  assert e.value.code == 400 and "image_url parts are not supported" in json.loads(e.value.read())["error"]["message"]
  # Special tokens (<bos> is id 1) stay out of reply text unless skip_special_tokens is false.
  ids = [1] + served["tok"].encode("Hello", add_special_tokens=False).ids
  shown = _post(served["url"] + "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True})
  kept = _post(served["url"] + "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True,
                                                    "skip_special_tokens": False})
  assert shown["choices"][0]["text"].startswith("Hello") and "<bos>" not in shown["choices"][0]["text"]
  assert kept["choices"][0]["text"].startswith("<bos>Hello")


def test_top_logprobs_keep_distinct_tokens_apart_and_stop_at_the_stop_string(served):
  """#49: keyed by text, the byte tokens of a multi-byte character collapsed onto "\ufffd" (asked 5, got 3); and
  the stop string's own tokens were listed although the text leaves them out."""
  ids = served["tok"].encode("naïve 数据 🙂", add_special_tokens=False).ids
  lp = _post(served["url"] + "/v1/completions", {"prompt": ids, "max_tokens": 12, "logprobs": 3})["choices"][0][
      "logprobs"]
  assert all(len(top) == 3 for top in lp["top_logprobs"])
  text, _, _ = _greedy(served, served["tok"].encode("The quick brown fox", add_special_tokens=False).ids, 40)
  stop = text[len(text) // 2:len(text) // 2 + 2]
  kept = text[:text.find(stop)]
  r = _post(served["url"] + "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 40, "stop": stop,
                                                "logprobs": 1})["choices"][0]
  assert r["text"] == kept
  names = served["server"].token_strings
  by_name = {names.key(i): i for i in range(served["tok"].get_vocab_size())}
  listed = [by_name[t] for t in r["logprobs"]["tokens"]]
  spelled = served["tok"].decode(listed)
  assert spelled.startswith(kept) and not served["tok"].decode(listed[:-1]).startswith(kept)
  assert max(r["logprobs"]["text_offset"]) < len(kept)


def test_metrics_and_the_request_log(served, caplog):
  import logging  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  def metrics():
    with urllib.request.urlopen(served["url"] + "/metrics") as r:
      assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
      lines = [x for x in r.read().decode().splitlines() if x and not x.startswith("#")]
    return {x.rsplit(" ", 1)[0]: float(x.rsplit(" ", 1)[1]) for x in lines}

  _wait_until_idle(served)
  before = metrics()
  with caplog.at_level(logging.INFO, logger="m3jax.serving"):
    _post(served["url"] + "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 4})
    with pytest.raises(urllib.error.HTTPError):
      _post(served["url"] + "/v1/completions", {"prompt": [7], "model": "other"})
    deadline = time.monotonic() + 30
    while sum("/v1/completions" in r.getMessage() for r in caplog.records) < 2:  # logged once the reply is out
      assert time.monotonic() < deadline
      time.sleep(0.01)
  lines = [r.getMessage() for r in caplog.records if "/v1/completions" in r.getMessage()]
  assert lines[0].startswith("127.0.0.1 POST /v1/completions 200 prompt_tokens=3 completion_tokens=4 latency=")
  assert lines[1].startswith("127.0.0.1 POST /v1/completions 404 prompt_tokens=0 completion_tokens=0 latency=")
  after = metrics()
  ok, missing = '{path="/v1/completions",status="200"}', '{path="/v1/completions",status="404"}'
  assert after["m3jax_requests_total" + ok] == before.get("m3jax_requests_total" + ok, 0) + 1
  assert after["m3jax_requests_total" + missing] == before.get("m3jax_requests_total" + missing, 0) + 1
  assert after["m3jax_prompt_tokens_total"] == before["m3jax_prompt_tokens_total"] + 3
  assert after["m3jax_generation_tokens_total"] == before["m3jax_generation_tokens_total"] + 4
  assert after["m3jax_time_to_first_token_seconds_count"] == before["m3jax_time_to_first_token_seconds_count"] + 1
  assert after["m3jax_time_per_output_token_seconds_count"] == before["m3jax_time_per_output_token_seconds_count"] + 1
  assert after['m3jax_time_to_first_token_seconds_bucket{le="+Inf"}'] == after[
      "m3jax_time_to_first_token_seconds_count"]
  assert after["m3jax_cache_slots_total"] == 2 and after["m3jax_cache_slots_used"] == 0
  assert after["m3jax_requests_waiting"] == 0 and after["m3jax_cache_pages_total"] > 0
  # The paged engine's prefix cache: a prompt of two full pages sent twice is found there the second time.
  page = served["engine"].page_size
  prompt = [(7 * i) % 200 + 10 for i in range(2 * page + 3)]
  for _ in range(2):
    _post(served["url"] + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
  last = metrics()
  hits = last["m3jax_prefix_cache_hits_total"] - after["m3jax_prefix_cache_hits_total"]
  queries = last["m3jax_prefix_cache_queries_total"] - after["m3jax_prefix_cache_queries_total"]
  assert hits == 2 * page and queries >= hits, (hits, queries)
  assert last["m3jax_prefix_cache_hit_rate"] == pytest.approx(
      last["m3jax_prefix_cache_hits_total"] / last["m3jax_prefix_cache_queries_total"])


@pytest.mark.quick
def test_tokenizer_routes(served):
  with urllib.request.urlopen(served["url"] + "/tokenizer_info") as r:
    info = json.loads(r.read())
  assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == ("<eos>", "<bos>", 256)
  ids = _post(served["url"] + "/tokenize", {"prompt": "Hello <eos>", "add_special_tokens": False})
  assert ids["tokens"] == served["tok"].encode("Hello <eos>", add_special_tokens=False).ids and ids["tokens"][-1] == 2
  assert _post(served["url"] + "/detokenize", {"tokens": ids["tokens"]}) == {"prompt": "Hello <eos>"}
  with pytest.raises(urllib.error.HTTPError) as e:
    _post(served["url"] + "/detokenize", {"tokens": [1, 99999]})
  assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "tokens"


@pytest.mark.quick
def test_a_server_still_loading_answers_503_in_openais_shape():
  from m3jax.serving_http import bind  # pylint: disable=g-import-not-at-top
  with bind(port=0).start() as httpd:  # bound, no model yet (m3jax serve binds before loading)
    with pytest.raises(urllib.error.HTTPError) as e:
      _post(httpd.url + "/v1/completions", {"prompt": "x"})
    body = json.loads(e.value.read())
    assert e.value.code == 503 and body["status"] == "loading"
    assert body["error"] == {"message": "the model is still loading; retry shortly", "type": "server_error",
                             "param": None, "code": None}
