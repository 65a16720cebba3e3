"""The OpenAI-compatible server: completions and chat, whole and streamed, concurrent requests sharing the engine's
slots (each gets generate()'s greedy tokens), and clear 400s for what it does not serve."""

import concurrent.futures
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

import m3jax
from m3jax.demo import build_demo_checkpoint
from m3jax.engine import Engine
from m3jax.generate import generate
from m3jax.serving import Server, serve
from m3jax.tokenizer import load_tokenizer, render_messages


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  ckpt = build_demo_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")
  model = m3jax.load(ckpt, kernels="reference", text_only=True)
  engine = Engine(model, slots=2, max_length=256, steps_per_call=3, logprobs=True, top_logprobs=3)
  server = Server(engine, ckpt, model_name="tiny-m3")
  httpd = serve(server, port=0)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield {"url": f"http://127.0.0.1:{httpd.server_address[1]}", "model": model, "ckpt": ckpt,
         "tok": load_tokenizer(ckpt), "engine": engine}
  httpd.shutdown()
  httpd.server_close()
  server.close()


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
  return s["tok"].decode(ids[:-1] if stopped else ids, skip_special_tokens=False), ("stop" if stopped else "length"), ids


def test_models_and_health(served):
  with urllib.request.urlopen(served["url"] + "/v1/models") as r:
    assert json.loads(r.read())["data"][0]["id"] == "tiny-m3"
  with urllib.request.urlopen(served["url"] + "/health") as r:
    assert json.loads(r.read()) == {"status": "ok"}


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
    ("/v1/completions", {"prompt": ""}, '"prompt" must be a non-empty string or list of token ids'),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens must be a positive integer"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 300}, "exceeds the engine's max_length (256)"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt ids outside"),
    ("/v1/completions", {"prompt": [1, True]}, '"prompt" must be a non-empty string or list of token ids'),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": True}, "max_tokens must be a positive integer"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n > 1 is not supported"),
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
def test_requests_it_cannot_serve_get_a_400_naming_why(served, path, body, message):
  with pytest.raises(urllib.error.HTTPError) as e:
    _post(served["url"] + path, body)
  assert e.value.code == 400
  assert message in json.loads(e.value.read())["error"]["message"]


def test_greedy_defaults_are_accepted_and_unknown_routes_are_404(served):
  r = _post(served["url"] + "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 2, "temperature": 0,
                                                 "top_p": 1.0})
  assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
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
    port = re.search(r"http://127.0.0.1:(\d+)/v1 \(2 slots, up to 128 tokens per request\)", line)
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
  assert whole["text"] == text and "".join(lp["tokens"]).replace("\ufffd", "") == text.replace("\ufffd", "")
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
    if t != "\ufffd":
      assert text[o:].startswith(t), (t, o)
  # Chat: per-token entries whose bytes spell the reply exactly (a token may hold part of a character).
  messages = [{"role": "user", "content": "Say something in Chinese"}]
  chat = _post(served["url"] + "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "logprobs": True,
                                                        "top_logprobs": 3})["choices"][0]
  content = chat["logprobs"]["content"]
  assert bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace") == chat["message"]["content"]
  assert all(len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
             for e in content)
  none = _post(served["url"] + "/v1/chat/completions", {"messages": messages, "max_tokens": 2})["choices"][0]
  assert none["logprobs"] is None
