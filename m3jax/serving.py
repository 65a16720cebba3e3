"""An OpenAI-compatible HTTP server over the continuous-batching engine (``m3jax serve``).

Endpoints: ``POST /v1/completions`` (``prompt``: text or token ids), ``POST /v1/chat/completions`` (``messages``,
rendered with the checkpoint's chat template), ``GET /v1/models``, ``GET /health``. ``stream: true`` sends
server-sent events, one per decode call that gives the request new text, then ``data: [DONE]``. ``stop`` (a string
or a list of them) ends the text before the first stop string, with finish_reason "stop", and frees the request's
slot at once; so does a streaming client that hangs up.

One worker thread owns the ``Engine`` (the model's only user); HTTP threads validate a request, submit it, and
wait on their own queue for its tokens. Each request samples with its own temperature / top_k / top_p / seed (the
server's start values by default); its tokens do not depend on the other requests (m3jax.engine). Fields that
would change the result but are not implemented (penalties, logit_bias, ...) get a 400 naming them. Streamed text
never shows a partial character (m3jax.detokenize). Log-probabilities (completions ``logprobs: k``, chat
``logprobs: true`` + ``top_logprobs: k``) are of the raw logits, for the tokens whose text the reply shows, up to
the engine's ``top_logprobs`` alternatives per token (``m3jax serve --max-logprobs``).
"""

from __future__ import annotations

import dataclasses
import http.server
import itertools
import json
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from m3jax import tokenizer as tok_lib
from m3jax.detokenize import TokenStrings
from m3jax.engine import Engine, Update
from m3jax.reply import Piece, Reply
from m3jax.token_ids import is_token_id


# Request fields that would change the result, with the values that do not (anything else gets a 400).
_UNSUPPORTED = {"echo": (False,),
                "best_of": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []),
                "response_format": (None, {"type": "text"})}


_MAX_STOP_STRINGS = 16


class RequestError(ValueError):
  """A request the server refuses (HTTP 400), with the reason."""


@dataclasses.dataclass(frozen=True)
class Request:
  """A checked completions / chat request: prompt ids, max_tokens, sampling (Engine.submit's temperature / top_k /
  top_p / seed, as given) and stop strings."""

  prompt_ids: list[int]
  max_tokens: int
  sampling: dict[str, Any]
  stop: tuple[str, ...] = ()
  logprobs: int | None = None  # None: no log-probabilities; k: the chosen token's and the k most likely


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
    self.token_strings = TokenStrings(self.tokenizer)
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

  def submit(self, request: Request) -> tuple[int, queue.Queue]:
    """Queues a request -> (its id, the queue its ``Update``s arrive on; an exception there if the engine
    failed)."""
    request_id = next(self._ids)
    updates: queue.Queue = queue.Queue()
    with self._lock:
      try:
        self.engine.submit(request.prompt_ids, max_new_tokens=request.max_tokens, request_id=request_id,
                           **request.sampling)
      except ValueError as e:
        raise RequestError(str(e).replace(f"request {request_id!r}: ", "")) from None
      self._pending[request_id] = updates
      self._lock.notify_all()
    return request_id, updates

  def cancel(self, request_id: int) -> None:
    """Frees a request's slot (its stop string came, or its client left); its queue gets no more updates."""
    with self._lock:
      self._pending.pop(request_id, None)
    self.engine.cancel(request_id)

  def follow(self, request_id: int, updates: queue.Queue, stop: tuple[str, ...] = ()) -> Iterator[Piece]:
    """A submitted request's reply as it comes, one Piece per update (m3jax.reply): the stop token is not shown
    (nor listed); a stop string ends the text before it (finish_reason "stop"; tokens counted and listed up to the
    one that completed it) and cancels the rest of the request. Raises what the engine raised."""
    reply = Reply(self.tokenizer, stop, self.token_strings)
    while True:
      update = updates.get()
      if isinstance(update, Exception):
        raise update
      piece = reply.add(update)
      if reply.cancel:
        self.cancel(request_id)
      yield piece
      if piece.finish_reason is not None:
        return

  def _parse_logprobs(self, body: dict[str, Any], chat: bool) -> int | None:
    """completions: logprobs = k (int); chat: logprobs = true, top_logprobs = k -> k, or None for none."""
    if chat:
      want, k = body.get("logprobs"), body.get("top_logprobs")
      if want not in (None, False, True):
        raise RequestError(f"logprobs must be true or false, got {want!r}")
      if k is not None and not want:
        raise RequestError("top_logprobs needs logprobs: true")
      k = (k or 0) if want else None
    else:
      k = body.get("logprobs")
    if k is None:
      return None
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
      raise RequestError(f"{'top_logprobs' if chat else 'logprobs'} must be a non-negative integer, got {k!r}")
    if not self.engine.logprobs:
      raise RequestError("log-probabilities are off on this server (m3jax serve --max-logprobs -1)")
    if k > self.engine.top_logprobs:
      raise RequestError(f"at most {self.engine.top_logprobs} log-probabilities per token on this server "
                         f"(m3jax serve --max-logprobs), got {k}")
    return k

  def logprobs_json(self, piece: Piece, k: int, chat: bool) -> dict[str, Any]:
    """A piece's tokens in OpenAI's logprobs layout (chat: {"content": [...]}; completions: tokens /
    token_logprobs / top_logprobs / text_offset)."""
    names = self.token_strings
    tops = [list(zip(ids[:k], lps[:k])) for ids, lps in zip(*piece.top)] if piece.top else [[] for _ in piece.ids]
    if chat:
      return {"content": [{"token": names.text(t), "logprob": lp, "bytes": names.bytes(t),
                           "top_logprobs": [{"token": names.text(a), "logprob": b, "bytes": names.bytes(a)}
                                            for a, b in top]}
                          for t, lp, top in zip(piece.ids, piece.logprobs, tops)]}
    return {"tokens": [names.text(t) for t in piece.ids], "token_logprobs": piece.logprobs,
            "top_logprobs": [{names.text(a): b for a, b in top} for top in tops] if k else None,
            "text_offset": piece.offsets}

  def parse(self, path: str, body: dict[str, Any]) -> Request:
    """A completions / chat request body -> the checked Request; RequestError names what is wrong."""
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
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
      raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if body.get("n", 1) != 1:
      raise RequestError("n > 1 is not supported")
    for name, harmless in _UNSUPPORTED.items():
      if name in body and body[name] not in harmless:
        raise RequestError(f"{name}={body[name]!r} is not supported by this server (it would be ignored)")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > _MAX_STOP_STRINGS
        or not all(isinstance(x, str) for x in stop)):
      raise RequestError(f"stop must be a string or a list of at most {_MAX_STOP_STRINGS} strings, got "
                         f"{body.get('stop')!r}")
    stop = tuple(x for x in stop if x)  # "" stops nothing (OpenAI accepts it)
    logprobs = self._parse_logprobs(body, chat)
    if chat:
      messages = body.get("messages")
      if not isinstance(messages, list) or not messages:
        raise RequestError('"messages" must be a non-empty list of {"role", "content"} objects')
      for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
          raise RequestError(f"each message needs a string role and string content, got {m!r}")
      text = tok_lib.render_messages(self.checkpoint, [{"role": m["role"], "content": m["content"]}
                                                       for m in messages])
      return Request(self.tokenizer.encode(text, add_special_tokens=False).ids, max_tokens, sampling, stop,
                     logprobs)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
      return Request(self.tokenizer.encode(prompt, add_special_tokens=False).ids, max_tokens, sampling, stop,
                     logprobs)
    if isinstance(prompt, list) and prompt and all(is_token_id(t) for t in prompt):
      return Request(prompt, max_tokens, sampling, stop, logprobs)
    raise RequestError('"prompt" must be a non-empty string or list of token ids (one prompt per request)')


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
        request = server.parse(self.path, body)
        request_id, updates = server.submit(request)
      except (RequestError, ValueError) as e:
        self._error(400, str(e))
        return
      chat = self.path == "/v1/chat/completions"
      reply = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", "created": int(time.time()),
               "model": server.model_name}
      pieces = server.follow(request_id, updates, request.stop)
      if body.get("stream"):
        self._stream(pieces, request, request_id, chat, reply)
      else:
        self._whole(pieces, request, chat, reply)

    def _whole(self, pieces, request: Request, chat: bool, reply: dict[str, Any]) -> None:
      merged = []
      try:
        merged = list(pieces)
      except Exception as e:  # pylint: disable=broad-except
        self._error(500, f"generation failed: {e}")
        return
      text = "".join(p.text for p in merged)
      last = merged[-1]
      logprobs = None
      if request.logprobs is not None:
        whole = Piece(text=text, finish_reason=last.finish_reason, generated=last.generated,
                      ids=[t for p in merged for t in p.ids], logprobs=[x for p in merged for x in p.logprobs],
                      top=None if last.top is None else ([x for p in merged for x in p.top[0]],
                                                         [x for p in merged for x in p.top[1]]),
                      offsets=[x for p in merged for x in p.offsets])
        logprobs = server.logprobs_json(whole, request.logprobs, chat)
      choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                else {"index": 0, "text": text})
      prompt_tokens = len(request.prompt_ids)
      self._json(200, {**reply, "object": "chat.completion" if chat else "text_completion",
                       "choices": [{**choice, "logprobs": logprobs, "finish_reason": last.finish_reason}],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": last.generated,
                                 "total_tokens": prompt_tokens + last.generated}})

    def _stream(self, pieces, request: Request, request_id: int, chat: bool, reply: dict[str, Any]) -> None:
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Cache-Control", "no-cache")
      self.end_headers()
      self.close_connection = True
      first = True
      reply = {**reply, "object": "chat.completion.chunk" if chat else "text_completion"}
      try:
        try:
          for piece in pieces:
            if not piece.text and piece.finish_reason is None:
              continue  # held back (a partial character, or a possible stop string's start)
            message = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
            first = False
            choice = {"index": 0, "delta": message} if chat else {"index": 0, "text": piece.text}
            if request.logprobs is not None:
              choice["logprobs"] = server.logprobs_json(piece, request.logprobs, chat)
            self._event({**reply, "choices": [{**choice, "finish_reason": piece.finish_reason}]})
        except (BrokenPipeError, ConnectionResetError):
          raise
        except Exception as e:  # pylint: disable=broad-except
          self._event({"error": {"message": f"generation failed: {e}", "code": 500}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
      except (BrokenPipeError, ConnectionResetError):
        server.cancel(request_id)  # the client left: free its slot now rather than after max_tokens

    def _event(self, payload: dict[str, Any]) -> None:
      self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
      self.wfile.flush()

  return Handler


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000) -> http.server.ThreadingHTTPServer:
  """An HTTP server bound to host:port (port 0 picks a free one); call ``serve_forever`` on it."""
  httpd = http.server.ThreadingHTTPServer((host, port), make_handler(server))
  httpd.daemon_threads = True
  return httpd
