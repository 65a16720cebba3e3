"""An OpenAI-compatible HTTP server over the continuous-batching engine (``m3jax serve``).

Endpoints: ``POST /v1/completions`` (``prompt``: text or token ids), ``POST /v1/chat/completions`` (``messages``,
rendered with the checkpoint's chat template), ``GET /v1/models``, ``GET /health``. ``stream: true`` sends
server-sent events, one per decode call that gives the request new tokens, then ``data: [DONE]``.

One worker thread owns the ``Engine`` (the model's only user); HTTP threads validate a request, submit it, and
wait on their own queue for its tokens. Each request samples with its own temperature / top_k / top_p / seed (the
server's start values by default); its tokens do not depend on the other requests (m3jax.engine). Fields that
would change the result but are not implemented (stop sequences, logprobs, penalties, ...) get a 400 naming them.
"""

from __future__ import annotations

import http.server
import itertools
import json
import queue
import threading
import time
from typing import Any

from m3jax import tokenizer as tok_lib
from m3jax.engine import Engine, Update


# Request fields that would change the result, with the values that do not (anything else gets a 400).
_UNSUPPORTED = {"stop": (None, "", []), "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (False,),
                "best_of": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []),
                "response_format": (None, {"type": "text"})}


class RequestError(ValueError):
  """A request the server refuses (HTTP 400), with the reason."""


class Server:
  """The engine's worker thread plus the request bookkeeping shared by the HTTP handlers.

  Args:
    engine: the Engine to run (its slots, max_length and sampling serve every request).
    checkpoint: the checkpoint directory (tokenizer.json, chat template, generation_config.json).
    model_name: what ``/v1/models`` and responses report.
  """

  def __init__(self, engine: Engine, checkpoint: str, model_name: str = "minimax-m3"):
    self.engine, self.checkpoint, self.model_name = engine, checkpoint, model_name
    self.tokenizer = tok_lib.load_tokenizer(checkpoint)
    self._ids = itertools.count()
    self._pending: dict[int, queue.Queue] = {}  # request id -> where its updates go
    self._lock = threading.Condition()
    self._stopping = False
    self._worker = threading.Thread(target=self._work, name="m3jax-engine", daemon=True)
    self._worker.start()

  def close(self) -> None:
    with self._lock:
      self._stopping = True
      self._lock.notify_all()
    self._worker.join()

  def _work(self) -> None:
    while True:
      with self._lock:
        while not self._pending and not self._stopping:
          self._lock.wait()
        if self._stopping:
          return
      try:
        for update in self.engine.stream():
          self._deliver(update)
      except Exception as e:  # pylint: disable=broad-except
        # The engine failed (e.g. out of device memory): fail every waiting request rather than hang them.
        with self._lock:
          for updates in self._pending.values():
            updates.put(e)
          self._pending.clear()

  def _deliver(self, update: Update) -> None:
    with self._lock:
      updates = self._pending.get(update.request_id)
      if update.completion is not None:
        self._pending.pop(update.request_id, None)
    if updates is not None:
      updates.put(update)

  def submit(self, prompt_ids: list[int], max_new_tokens: int, sampling: dict[str, Any] | None = None
             ) -> queue.Queue:
    """Queues a request (``sampling``: Engine.submit's temperature / top_k / top_p / seed) -> the queue its
    ``Update``s arrive on (an exception if the engine failed)."""
    request_id = next(self._ids)
    updates: queue.Queue = queue.Queue()
    with self._lock:
      try:
        self.engine.submit(prompt_ids, max_new_tokens=max_new_tokens, request_id=request_id, **(sampling or {}))
      except ValueError as e:
        raise RequestError(str(e).replace(f"request {request_id!r}: ", "")) from None
      self._pending[request_id] = updates
      self._lock.notify_all()
    return updates

  def parse(self, path: str, body: dict[str, Any]) -> tuple[list[int], int, dict[str, Any]]:
    """A completions / chat request body -> (prompt ids, max_new_tokens, sampling: temperature / top_k / top_p /
    seed as given); RequestError names what is wrong."""
    if not isinstance(body, dict):
      raise RequestError("the body must be a JSON object")
    sampling = {}
    for name, kind in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", int), ("seed", int)):
      value = body.get(name)
      if value is not None:
        if not isinstance(value, kind) or isinstance(value, bool):
          raise RequestError(f"{name} must be a number, got {value!r}")
        sampling[name] = value
    if sampling.get("top_k") == -1:  # some clients' "no cut"
      sampling["top_k"] = 0
    chat = path == "/v1/chat/completions"
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 256 if chat else 16))  # OpenAI's defaults
    if not isinstance(max_tokens, int) or max_tokens < 1:
      raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if body.get("n", 1) != 1:
      raise RequestError("n > 1 is not supported")
    for name, harmless in _UNSUPPORTED.items():
      if name in body and body[name] not in harmless:
        raise RequestError(f"{name}={body[name]!r} is not supported by this server (it would be ignored)")
    if chat:
      messages = body.get("messages")
      if not isinstance(messages, list) or not messages:
        raise RequestError('"messages" must be a non-empty list of {"role", "content"} objects')
      for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
          raise RequestError(f"each message needs a string role and string content, got {m!r}")
      text = tok_lib.render_messages(self.checkpoint, [{"role": m["role"], "content": m["content"]}
                                                       for m in messages])
      return self.tokenizer.encode(text, add_special_tokens=False).ids, max_tokens, sampling
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
      return self.tokenizer.encode(prompt, add_special_tokens=False).ids, max_tokens, sampling
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
      return prompt, max_tokens, sampling
    raise RequestError('"prompt" must be a non-empty string or list of token ids (one prompt per request)')

  def text(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=False)


def make_handler(server: Server):
  """The HTTP request handler class bound to ``server``."""

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # pylint: disable=redefined-builtin
      del format, args  # quiet; the CLI reports per request on stderr

    def _json(self, status: int, payload: dict[str, Any]) -> None:
      data = json.dumps(payload).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
      self._json(status, {"error": {"message": message, "type": "invalid_request_error" if status == 400
                                    else "server_error", "code": status}})

    def do_GET(self):  # pylint: disable=invalid-name
      if self.path == "/health":
        self._json(200, {"status": "ok"})
      elif self.path == "/v1/models":
        self._json(200, {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                      "owned_by": "m3jax"}]})
      else:
        self._error(404, f"no route {self.path}")

    def do_POST(self):  # pylint: disable=invalid-name
      if self.path not in ("/v1/completions", "/v1/chat/completions"):
        self._error(404, f"no route {self.path}")
        return
      try:
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"null")
      except (ValueError, json.JSONDecodeError) as e:
        self._error(400, f"the body is not JSON: {e}")
        return
      try:
        prompt_ids, max_tokens, sampling = server.parse(self.path, body)
        updates = server.submit(prompt_ids, max_tokens, sampling)
      except (RequestError, ValueError) as e:
        self._error(400, str(e))
        return
      chat = self.path == "/v1/chat/completions"
      created, rid = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{id(updates):x}"
      if body.get("stream"):
        self._stream(updates, chat, created, rid, len(prompt_ids))
      else:
        self._whole(updates, chat, created, rid, len(prompt_ids))

    def _next(self, updates: queue.Queue) -> Update:
      update = updates.get()
      if isinstance(update, Exception):
        raise update
      return update

    def _whole(self, updates, chat: bool, created: int, rid: str, prompt_tokens: int) -> None:
      try:
        while (update := self._next(updates)).completion is None:
          pass
      except Exception as e:  # pylint: disable=broad-except
        self._error(500, f"generation failed: {e}")
        return
      done = update.completion
      ids = done.tokens.tolist()
      text = server.text(ids[:-1] if done.finish_reason == "stop" else ids)
      choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                else {"index": 0, "text": text, "logprobs": None})
      self._json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                       "model": server.model_name, "choices": [{**choice, "finish_reason": done.finish_reason}],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                                 "total_tokens": prompt_tokens + len(ids)}})

    def _stream(self, updates, chat: bool, created: int, rid: str, prompt_tokens: int) -> None:
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Cache-Control", "no-cache")
      self.end_headers()
      ids: list[int] = []
      printed = ""
      first = True
      kind = "chat.completion.chunk" if chat else "text_completion"
      while True:
        try:
          update = self._next(updates)
        except Exception as e:  # pylint: disable=broad-except
          self._event({"error": {"message": f"generation failed: {e}", "code": 500}})
          break
        done = update.completion
        ids.extend(update.new_tokens.tolist())
        shown = ids[:-1] if done is not None and done.finish_reason == "stop" else ids
        text = server.text(shown)
        delta, printed = text[len(printed):], text
        reason = None if done is None else done.finish_reason
        message = {"role": "assistant", "content": delta} if first else {"content": delta}
        first = False
        choice = ({"index": 0, "delta": message} if chat else {"index": 0, "text": delta})
        self._event({"id": rid, "object": kind, "created": created, "model": server.model_name,
                     "choices": [{**choice, "finish_reason": reason}]})
        if done is not None:
          break
      self.wfile.write(b"data: [DONE]\n\n")
      self.wfile.flush()
      self.close_connection = True

    def _event(self, payload: dict[str, Any]) -> None:
      self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
      self.wfile.flush()

  return Handler


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000) -> http.server.ThreadingHTTPServer:
  """An HTTP server bound to host:port (port 0 picks a free one); call ``serve_forever`` on it."""
  httpd = http.server.ThreadingHTTPServer((host, port), make_handler(server))
  httpd.daemon_threads = True
  return httpd
