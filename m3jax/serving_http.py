"""The HTTP side of ``m3jax serve``: the request handler (routes, OpenAI's response and streaming layouts, one log
line per request, /metrics) over a ``m3jax.serving.Server``, and binding the port before the model loads.

Each connection gets a thread (``http.server.ThreadingHTTPServer``); a handler validates the request through the
Server (m3jax.request_validation), submits it, and answers as the pieces arrive (m3jax.serving.Server.follow):
whole, or as server-sent events. Every request is logged (logger ``m3jax.serving``: client, method, path, status,
prompt / completion tokens, latency; /health and /metrics at DEBUG) and counted in ``Server.metrics``.
"""

from __future__ import annotations

import http.server
import json
import logging
import select
import socket
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from m3jax.reply import Piece
from m3jax.request_validation import (CHAT, DETOKENIZE, POST_ROUTES, TOKENIZE, RequestError, body_length, decode_body,
                                      error_body, parse_detokenize, parse_request, parse_tokenize)
from m3jax.serving import ClientGone, Echo, GenerationFailed, Request, Server

__all__ = ["attach", "bind", "make_handler", "serve"]

_SOCKET_TIMEOUT_S = 60.0  # a client that stops sending mid-request (or idles on a kept-alive connection)
_QUIET_PATHS = ("/health", "/metrics")  # logged at DEBUG: monitors poll them
log = logging.getLogger("m3jax.serving")


def make_handler(server: Server):
  """The HTTP request handler class bound to ``server``."""

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = _SOCKET_TIMEOUT_S

    def log_message(self, format, *args):  # pylint: disable=redefined-builtin
      del format, args  # http.server's own lines are replaced by one line per request (_log_request)

    def send_response(self, code, message=None):
      self._status = code
      super().send_response(code, message)

    def _begin(self) -> None:
      self._status, self._usage, self._started = None, (0, 0), time.perf_counter()

    def _log_request(self) -> None:
      """One line per request (logger m3jax.serving) and the request in /metrics."""
      seconds = time.perf_counter() - self._started
      path = self.path.split("?")[0][:80]
      status = self._status or 499  # no answer: the client left first (nginx's "client closed request")
      server.metrics.request_done(path if path in _KNOWN_PATHS else "other", status, seconds, *self._usage)
      log.log(logging.DEBUG if path in _QUIET_PATHS else logging.INFO,
              "%s %s %s %d prompt_tokens=%d completion_tokens=%d latency=%.3fs", self.client_address[0],
              self.command, path, status, self._usage[0], self._usage[1], seconds)

    def _json(self, status: int, payload: dict[str, Any]) -> None:
      data = json.dumps(payload).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      if self.close_connection:
        self.send_header("Connection", "close")
      self.end_headers()
      self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
      self._json(status, error_body(message, status, param, code))

    def _refuse(self, e: RequestError) -> None:
      self._json(e.status, e.body())

    def _client_gone(self) -> bool:
      """True once the client has closed its end of the connection (a readable socket with nothing to read)."""
      try:
        readable, _, _ = select.select([self.connection], [], [], 0)
        return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
      except (OSError, ValueError):
        return True

    def do_GET(self):  # pylint: disable=invalid-name
      self._begin()
      try:
        self._get()
      finally:
        self._log_request()

    def _get(self) -> None:
      if self.path == "/health":
        failure = server.health()
        if failure is None:
          self._json(200, {"status": "ok"})
        else:
          self._json(503, {"status": "error", "message": failure})
      elif self.path == "/v1/models":
        self._json(200, {"object": "list", "data": [server.model_card()]})
      elif self.path.startswith("/v1/models/"):
        name = urllib.parse.unquote(self.path[len("/v1/models/"):])
        if name == server.model_name:
          self._json(200, server.model_card())
        else:
          self._error(404, f"The model {name[:80]!r} does not exist: this server serves {server.model_name!r}",
                      param="model", code="model_not_found")
      elif self.path == "/metrics":
        data = server.metrics.render(server.engine_stats()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
      elif self.path == "/tokenizer_info":
        self._json(200, server.tokenizer_info)
      else:
        self._error(404, f"no route {self.path[:80]}", code="not_found")

    def do_POST(self):  # pylint: disable=invalid-name
      self._begin()
      try:
        self._post()
      finally:
        self._log_request()

    def _post(self) -> None:
      try:
        length = body_length(self.headers, server.limits.max_body_bytes)
      except RequestError as e:  # the body is not read: nothing after it on this connection can be parsed
        self.close_connection = True
        self._refuse(e)
        return
      try:
        data = self.rfile.read(length)
      except OSError:  # the client stopped sending (socket timeout) or left
        self.close_connection = True
        return
      if len(data) < length:  # the client closed before sending the whole body
        self.close_connection = True
        return
      if self.path not in POST_ROUTES:
        self._error(404, f"no route {self.path[:80]}", code="not_found")
        return
      if self.path in (TOKENIZE, DETOKENIZE):
        self._tokenizer(data)
        return
      try:
        request = server.prepare(parse_request(self.path, decode_body(data), server.limits))
        echoes = server.echo(request) if request.echo else None
        request_ids, updates = server.submit(request)
      except RequestError as e:
        self._refuse(e)
        return
      except Exception as e:  # pylint: disable=broad-except  (e.g. the tokenizer failed on this prompt)
        self._error(500, f"internal error: {type(e).__name__}: {e}")
        return
      chat = self.path == CHAT
      self._usage = (request.prompt_tokens, 0)
      reply = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_ids[0] if request_ids else server.next_id()}",
               "created": int(time.time()), "model": server.model_name}
      pieces = self._timed(server.follow(request_ids, updates, request.stop, self._client_gone,
                                         skip_special_tokens=request.skip_special_tokens,
                                         list_stop_token=request.echo))
      self._streaming = answered = False
      try:
        if request.stream:
          self._stream(pieces, request, chat, reply, echoes)
        else:
          self._whole(pieces, request, chat, reply, echoes)
        answered = True
      except (ClientGone, BrokenPipeError, ConnectionResetError):
        self.close_connection = True
      except Exception as e:  # pylint: disable=broad-except  (a fault while answering: this request's alone)
        self.close_connection = True
        if not self._streaming:
          self._error(500, f"internal error: {type(e).__name__}: {e}")
      finally:
        pieces.close()
        if not answered:  # the engine frees their slots at the next call (nothing if they had finished)
          for request_id in request_ids:
            server.cancel(request_id)

    def _tokenizer(self, data: bytes) -> None:
      try:
        body = decode_body(data)
        if self.path == TOKENIZE:
          text, special = parse_tokenize(body)
          ids = server.tokenizer.encode(text, add_special_tokens=special).ids
          self._json(200, {"tokens": ids, "count": len(ids), "max_model_len": server.limits.max_length})
        else:
          ids = parse_detokenize(body, server.limits)
          self._json(200, {"prompt": server.tokenizer.decode(list(ids), skip_special_tokens=False)})
      except RequestError as e:
        self._refuse(e)

    def _timed(self, pieces: Iterator[tuple[int, Piece]]) -> Iterator[tuple[int, Piece]]:
      """The pieces, timing each choice's first token (TTFT) and the mean gap between its later ones (TPOT) for
      /metrics, and counting the completion tokens for the request log."""
      first: dict[int, float] = {}
      counts: dict[int, int] = {}
      try:
        for i, piece in pieces:
          now = time.perf_counter()
          if piece.generated and i not in first:
            first[i] = now
            server.metrics.first_token(now - self._started)
          counts[i] = piece.generated
          if piece.finish_reason is not None and counts[i] > 1 and i in first:
            server.metrics.per_output_token((now - first[i]) / (counts[i] - 1))
          self._usage = (self._usage[0], sum(counts.values()))
          yield i, piece
      finally:
        pieces.close()

    def _whole(self, pieces, request: Request, chat: bool, reply: dict[str, Any], echoes: list[Echo] | None
               ) -> None:
      try:
        merged: list[list[Piece]] = [[] for _ in range(request.choices)]
        for i, piece in pieces:
          merged[i].append(piece)
      except (GenerationFailed, RequestError) as e:
        self._error(500, f"generation failed: {e}")
        return
      choices, generated = [], 0
      echoes = None if echoes is None else [echoes[c // request.n] for c in range(request.choices)]
      for i, own in enumerate(merged):
        text = "".join(p.text for p in own)
        finish = own[-1].finish_reason if own else "length"  # max_tokens 0: the prompt alone
        generated += own[-1].generated if own else 0
        logprobs = None
        if request.logprobs is not None:
          whole = Piece(text=text, finish_reason=finish, generated=0, ids=[t for p in own for t in p.ids],
                        logprobs=[x for p in own for x in p.logprobs],
                        top=None if not own or own[-1].top is None else ([x for p in own for x in p.top[0]],
                                                                         [x for p in own for x in p.top[1]]),
                        offsets=[x for p in own for x in p.offsets])
          logprobs = server.logprobs_json(whole, request.logprobs, chat,
                                          offset=len(echoes[i].text) if echoes else 0)
          if echoes:
            e = echoes[i]
            head = server.completion_logprobs(e.ids, e.logprobs, e.top, e.offsets, request.logprobs)
            logprobs = {key: None if head[key] is None else head[key] + logprobs[key] for key in head}
        if chat:
          choice = {"index": i, "message": {"role": "assistant", "content": text}}
        else:
          choice = {"index": i, "text": (echoes[i].text if echoes else "") + text}
        choices.append({**choice, "logprobs": logprobs, "finish_reason": finish})
      self._json(200, {**reply, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                       "usage": _usage(request.prompt_tokens, generated)})

    def _stream(self, pieces, request: Request, chat: bool, reply: dict[str, Any], echoes: list[Echo] | None
                ) -> None:
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Cache-Control", "no-cache")
      self.send_header("Connection", "close")
      self.end_headers()
      self.close_connection = True
      self._streaming = True
      reply = {**reply, "object": "chat.completion.chunk" if chat else "text_completion"}
      if request.include_usage:
        reply["usage"] = None  # OpenAI's chunks carry "usage": null until the last one
      started: set[int] = set()
      generated = [0] * request.choices
      echoes = None if echoes is None else [echoes[c // request.n] for c in range(request.choices)]
      shift = [len(e.text) for e in echoes] if echoes else [0] * request.choices
      if echoes:  # each choice starts with its prompt
        for i, e in enumerate(echoes):
          choice = {"index": i, "text": e.text, "finish_reason": None if request.max_tokens else "length"}
          if request.logprobs is not None:
            choice["logprobs"] = server.completion_logprobs(e.ids, e.logprobs, e.top, e.offsets, request.logprobs)
          self._event({**reply, "choices": [choice]})
      try:
        for i, piece in pieces:
          generated[i] = piece.generated
          if not piece.text and piece.finish_reason is None:
            continue  # held back (a partial character, or a possible stop string's start)
          if chat:
            message = {"content": piece.text} if i in started else {"role": "assistant", "content": piece.text}
            choice = {"index": i, "delta": message}
          else:
            choice = {"index": i, "text": piece.text}
          started.add(i)
          if request.logprobs is not None:
            choice["logprobs"] = server.logprobs_json(piece, request.logprobs, chat, offset=shift[i])
          self._event({**reply, "choices": [{**choice, "finish_reason": piece.finish_reason}]})
      except GenerationFailed as e:
        self._event(error_body(f"generation failed: {e}", 500))
      else:
        if request.include_usage:
          self._event({**reply, "choices": [], "usage": _usage(request.prompt_tokens, sum(generated))})
      self.wfile.write(b"data: [DONE]\n\n")
      self.wfile.flush()

    def _event(self, payload: dict[str, Any]) -> None:
      self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
      self.wfile.flush()

  return Handler


_KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenizer_info",
                "/tokenize", "/detokenize")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


class _Loading(http.server.BaseHTTPRequestHandler):
  """Answers 503 while the model loads (``bind`` before ``attach``)."""

  protocol_version = "HTTP/1.1"

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    del format, args

  def _loading(self):
    self.close_connection = True
    data = json.dumps({"status": "loading", **error_body("the model is still loading; retry shortly", 503)}).encode()
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
