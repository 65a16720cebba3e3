"""An OpenAI-compatible HTTP server over the continuous-batching engine (``m3jax serve``).

Endpoints: ``POST /v1/completions`` (``prompt``: text or token ids), ``POST /v1/chat/completions`` (``messages``,
rendered with the checkpoint's chat template), ``GET /v1/models``, ``GET /health``. ``stream: true`` sends
server-sent events, one per decode call that gives the request new text, then ``data: [DONE]``. ``stop`` (a string
or a list of them) ends the text before the first stop string, with finish_reason "stop", and frees the request's
slot at once; so does a streaming client that hangs up.

One worker thread owns the ``Engine`` (the model's only user); HTTP threads validate a request
(m3jax.request_validation: the body's size from its headers before it is read, then every field against the
engine's limits, then the tokenized prompt), submit it, and wait on their own queue for its tokens. Faults stay
local: a request whose serving fails gets a 500 (or an error event when streamed) and frees its slot while the
engine goes on; ``/health`` answers 503 once the engine cannot serve. A client that hangs up, streaming or not,
cancels its request at the engine's next step. Each request samples with its own temperature / top_k / top_p / seed (the
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
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from m3jax import tokenizer as tok_lib
from m3jax.config import M3Config
from m3jax.detokenize import TokenStrings
from m3jax.engine import Engine, Update
from m3jax.reply import Piece, Reply
from m3jax.request_validation import (CHAT, ROUTES, Limits, ParsedRequest, RequestError, body_length, check_prompt,
                                      decode_body, default_body_limit, parse_request)

__all__ = ["Request", "RequestError", "Server", "attach", "bind", "make_handler", "serve"]

_POLL_S = 0.05  # how often a request waiting for its first tokens checks whether its client is still there
_SOCKET_TIMEOUT_S = 60.0  # a client that stops sending mid-request (or idles on a kept-alive connection)


class GenerationFailed(RuntimeError):
  """Serving one request failed (the engine ended it with finish_reason "error", or the engine stopped)."""


class ClientGone(Exception):
  """The request's client closed its connection."""


@dataclasses.dataclass(frozen=True)
class Request:
  """A checked completions / chat request: prompt ids, max_tokens, sampling (Engine.submit's temperature / top_k /
  top_p / seed, as given) and stop strings."""

  prompt_ids: list[int]
  max_tokens: int
  sampling: dict[str, Any]
  stop: tuple[str, ...] = ()
  logprobs: int | None = None  # None: no log-probabilities; k: the chosen token's and the k most likely
  stream: bool = False


class Server:
  """The engine's worker thread plus the request bookkeeping shared by the HTTP handlers.

  Args:
    engine: the Engine to run (its slots, max_length and sampling serve every request).
    checkpoint: the checkpoint directory (tokenizer.json, chat template, generation_config.json, config.json).
    model_name: what ``/v1/models`` and responses report.
    max_body_bytes: the largest request body read (default: request_validation.default_body_limit).
  """

  def __init__(self, engine: Engine, checkpoint: str, model_name: str = "minimax-m3", *,
               max_body_bytes: int | None = None):
    self.engine, self.checkpoint, self.model_name = engine, checkpoint, model_name
    self.tokenizer = tok_lib.load_tokenizer(checkpoint)
    self.token_strings = TokenStrings(self.tokenizer)
    self.limits = Limits(vocab_size=engine.model.config.text.vocab_size, max_length=engine.max_length,
                         max_logprobs=engine.top_logprobs if engine.logprobs else None,
                         max_body_bytes=default_body_limit(engine.max_length) if max_body_bytes is None
                         else max_body_bytes,
                         placeholder_ids=_placeholder_ids(checkpoint, engine))
    self._ids = itertools.count()
    self._pending: dict[int, queue.Queue] = {}  # request id -> where its updates go
    self._lock = threading.Condition()
    self._stopping = False
    self.failure: str | None = None  # why the server cannot serve any more (None while it can)
    self._worker = threading.Thread(target=self._work, name="m3jax-engine", daemon=True)
    self._worker.start()

  def close(self) -> None:
    with self._lock:
      self._stopping = True
      self._lock.notify_all()
    self._worker.join()

  def health(self) -> str | None:
    """None while the engine can serve; otherwise why it cannot."""
    if self.failure is not None:
      return self.failure
    if self.engine.broken is not None:
      return self.engine.broken
    if not self._worker.is_alive() and not self._stopping:
      return "the engine's worker thread has stopped"
    return None

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
        # Not one request's fault (those end with finish_reason "error"): the engine stopped. Fail every waiting
        # request rather than hang it, then start the engine afresh; if it cannot, the server reports it.
        failure = GenerationFailed(f"the engine failed ({type(e).__name__}: {e})")
        with self._lock:
          for updates in self._pending.values():
            updates.put(failure)
          self._pending.clear()
          try:
            self.engine.reset()
          except Exception as again:  # pylint: disable=broad-except
            self.failure = f"the engine cannot serve: {type(e).__name__}: {e} ({type(again).__name__}: {again})"
            return

  def _deliver(self, update: Update) -> None:
    with self._lock:
      updates = self._pending.get(update.request_id)
      if update.completion is not None:
        self._pending.pop(update.request_id, None)
    if updates is not None:
      updates.put(update)

  def parse(self, path: str, body: Any) -> Request:
    """A completions / chat request body -> the checked Request; RequestError names what is wrong."""
    return self.prepare(parse_request(path, body, self.limits))

  def prepare(self, parsed: ParsedRequest) -> Request:
    """A request whose fields are checked -> its prompt ids (the chat template rendered, the text tokenized),
    checked against the engine (vocabulary, placeholders, length)."""
    if parsed.messages is not None:
      try:
        text = tok_lib.render_messages(self.checkpoint, [dict(m) for m in parsed.messages])
      except ValueError as e:  # ChatTemplateError: the template refused the messages (raise_exception) or failed
        raise RequestError(str(e)) from None
      ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    elif parsed.text is not None:
      ids = self.tokenizer.encode(parsed.text, add_special_tokens=False).ids
    else:
      ids = list(parsed.prompt_ids)
    check_prompt(ids, parsed.max_tokens, self.limits)
    return Request(ids, parsed.max_tokens, dict(parsed.sampling), parsed.stop, parsed.logprobs, parsed.stream)

  def submit(self, request: Request) -> tuple[int, queue.Queue]:
    """Queues a request -> (its id, the queue its ``Update``s arrive on; a GenerationFailed there if the engine
    stopped). RequestError 503 when the engine cannot serve, 400 when it refuses the request."""
    request_id = next(self._ids)
    updates: queue.Queue = queue.Queue()
    with self._lock:
      failure = self.health()
      if failure is not None:
        raise RequestError(f"the server cannot serve: {failure}", 503)
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

  def follow(self, request_id: int, updates: queue.Queue, stop: tuple[str, ...] = (),
             client_gone: Callable[[], bool] | None = None) -> Iterator[Piece]:
    """A submitted request's reply as it comes, one Piece per update (m3jax.reply): the stop token is not shown
    (nor listed); a stop string ends the text before it (finish_reason "stop"; tokens counted and listed up to the
    one that completed it) and cancels the rest of the request.

    Raises GenerationFailed when serving the request failed, and ClientGone when ``client_gone()`` (asked at each
    update, and every few tens of milliseconds while the request waits) says its client left. However the
    iteration ends before the reply does (an exception here or in the caller, or ``close()``), the request is
    cancelled, so its slot is freed at the engine's next step.
    """
    reply = Reply(self.tokenizer, stop, self.token_strings)
    finished = False
    try:
      while True:
        try:
          update = updates.get(timeout=None if client_gone is None else _POLL_S)
        except queue.Empty:
          if client_gone():
            raise ClientGone() from None
          continue
        if isinstance(update, Exception):
          finished = True
          raise update
        if update.completion is not None and update.completion.finish_reason == "error":
          finished = True
          raise GenerationFailed(update.completion.error or "unknown error")
        if client_gone is not None and client_gone():
          raise ClientGone()
        piece = reply.add(update)
        if reply.cancel:
          self.cancel(request_id)
        finished = piece.finish_reason is not None
        yield piece
        if finished:
          return
    finally:
      if not finished:
        self.cancel(request_id)

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


def _placeholder_ids(checkpoint: str, engine: Engine) -> tuple[int, ...]:
  """The image / video placeholder ids when the checkpoint is a vision-language one (config.json has a
  vision_config): the server runs the text backbone and takes no images, so a prompt holding one is refused."""
  if engine.model.placeholder_ids:
    return engine.model.placeholder_ids
  try:
    return M3Config.from_file(checkpoint).placeholder_ids
  except (OSError, ValueError):
    return ()


def make_handler(server: Server):
  """The HTTP request handler class bound to ``server``."""

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = _SOCKET_TIMEOUT_S

    def log_message(self, format, *args):  # pylint: disable=redefined-builtin
      del format, args  # quiet; the CLI reports per request on stderr

    def _json(self, status: int, payload: dict[str, Any]) -> None:
      data = json.dumps(payload).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      if self.close_connection:
        self.send_header("Connection", "close")
      self.end_headers()
      self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
      kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
      self._json(status, {"error": {"message": message, "type": kind, "code": status}})

    def _client_gone(self) -> bool:
      """True once the client has closed its end of the connection (a readable socket with nothing to read)."""
      try:
        readable, _, _ = select.select([self.connection], [], [], 0)
        return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
      except (OSError, ValueError):
        return True

    def do_GET(self):  # pylint: disable=invalid-name
      if self.path == "/health":
        failure = server.health()
        if failure is None:
          self._json(200, {"status": "ok"})
        else:
          self._json(503, {"status": "error", "message": failure})
      elif self.path == "/v1/models":
        self._json(200, {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                      "owned_by": "m3jax"}]})
      else:
        self._error(404, f"no route {self.path[:80]}")

    def do_POST(self):  # pylint: disable=invalid-name
      try:
        length = body_length(self.headers, server.limits.max_body_bytes)
      except RequestError as e:  # the body is not read: nothing after it on this connection can be parsed
        self.close_connection = True
        self._error(e.status, str(e))
        return
      try:
        data = self.rfile.read(length)
      except OSError:  # the client stopped sending (socket timeout) or left
        self.close_connection = True
        return
      if len(data) < length:  # the client closed before sending the whole body
        self.close_connection = True
        return
      if self.path not in ROUTES:
        self._error(404, f"no route {self.path[:80]}")
        return
      try:
        request = server.prepare(parse_request(self.path, decode_body(data), server.limits))
        request_id, updates = server.submit(request)
      except RequestError as e:
        self._error(e.status, str(e))
        return
      except Exception as e:  # pylint: disable=broad-except  (e.g. the tokenizer failed on this prompt)
        self._error(500, f"internal error: {type(e).__name__}: {e}")
        return
      chat = self.path == CHAT
      reply = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", "created": int(time.time()),
               "model": server.model_name}
      pieces = server.follow(request_id, updates, request.stop, self._client_gone)
      self._streaming = answered = False
      try:
        if request.stream:
          self._stream(pieces, request, chat, reply)
        else:
          self._whole(pieces, request, chat, reply)
        answered = True
      except (ClientGone, BrokenPipeError, ConnectionResetError):
        self.close_connection = True
      except Exception as e:  # pylint: disable=broad-except  (a fault while answering: this request's alone)
        self.close_connection = True
        if not self._streaming:
          self._error(500, f"internal error: {type(e).__name__}: {e}")
      finally:
        pieces.close()
        if not answered:  # the engine frees its slot at the next call (nothing if it had finished)
          server.cancel(request_id)

    def _whole(self, pieces, request: Request, chat: bool, reply: dict[str, Any]) -> None:
      try:
        merged = list(pieces)
      except (GenerationFailed, RequestError) as e:
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

    def _stream(self, pieces, request: Request, chat: bool, reply: dict[str, Any]) -> None:
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Cache-Control", "no-cache")
      self.send_header("Connection", "close")
      self.end_headers()
      self.close_connection = True
      self._streaming = True
      first = True
      reply = {**reply, "object": "chat.completion.chunk" if chat else "text_completion"}
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
      except GenerationFailed as e:
        self._event({"error": {"message": f"generation failed: {e}", "type": "server_error", "code": 500}})
      self.wfile.write(b"data: [DONE]\n\n")
      self.wfile.flush()

    def _event(self, payload: dict[str, Any]) -> None:
      self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
      self.wfile.flush()

  return Handler


class _Loading(http.server.BaseHTTPRequestHandler):
  """Answers 503 while the model loads (``bind`` before ``attach``)."""

  protocol_version = "HTTP/1.1"

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    del format, args

  def _loading(self):
    self.close_connection = True
    data = json.dumps({"status": "loading"}).encode()
    self.send_response(503)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.send_header("Connection", "close")
    self.end_headers()
    self.wfile.write(data)

  do_GET = do_POST = _loading  # noqa: N815


def bind(host: str = "127.0.0.1", port: int = 8000) -> http.server.ThreadingHTTPServer:
  """Binds host:port now (port 0 picks a free one), so that a port in use fails before anything else is done;
  ``attach`` gives it the Server to answer with. ValueError naming the address when it cannot listen there."""
  try:
    httpd = http.server.ThreadingHTTPServer((host, port), _Loading)
  except OSError as e:
    raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (another server there? pick another "
                     "--port)") from None
  httpd.daemon_threads = True
  return httpd


def attach(httpd: http.server.ThreadingHTTPServer, server: Server) -> http.server.ThreadingHTTPServer:
  """Makes a bound HTTP server answer with ``server`` (call ``serve_forever`` on it)."""
  httpd.RequestHandlerClass = make_handler(server)
  return httpd


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000) -> http.server.ThreadingHTTPServer:
  """An HTTP server bound to host:port (port 0 picks a free one); call ``serve_forever`` on it."""
  return attach(bind(host, port), server)
