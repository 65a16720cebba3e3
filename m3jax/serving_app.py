"""The ASGI app of ``m3jax serve`` (FastAPI on uvicorn, m3jax.serving_http): the routes over a
``m3jax.serving.Server``, OpenAI's error shape for every failure, one log line per request, /metrics, and the
OpenAPI document at ``/openapi.json`` (request schemas from m3jax.serving_schema).

The event loop never blocks: a completions / chat / tokenizer POST reads its body (sized from the headers first:
m3jax.request_validation.body_length), then runs on a thread of its own (m3jax.serving_replies.answer: validation,
tokenizing, echo scoring, waiting on the engine) while the loop forwards what it yields and listens for the client
hanging up; a client that leaves makes ``Server.follow`` raise ClientGone within its poll interval, which cancels
the request's engine requests. Concurrent requests therefore reach the engine together and are batched there.
Until ``attach_server`` gives it a Server (the model still loading), every route answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from m3jax.request_validation import (CHAT, COMPLETIONS, DETOKENIZE, TOKENIZE, RequestError, body_length,
                                      error_body)
from m3jax.serving import Server
from m3jax.serving_replies import Head, RequestRecord, answer, json_head
from m3jax.serving_schema import (REQUEST_MODELS, ChatCompletion, ChatCompletionRequest, Completion,
                                  CompletionRequest, Detokenized, DetokenizeRequest, ErrorResponse, Health,
                                  ModelCard, ModelList, TokenizeRequest, TokenizerInfo, Tokens,
                                  Unavailable)

__all__ = ["attach_server", "create_app"]

_BODY_TIMEOUT_S = 60.0  # a client that stops sending mid-body gets a 408
_QUIET_PATHS = ("/health", "/metrics")  # logged at DEBUG: monitors poll them
_KNOWN_PATHS = (COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics", "/tokenizer_info", TOKENIZE, DETOKENIZE)
_RECORD = "m3jax.record"  # the scope key of the request's RequestRecord
log = logging.getLogger("m3jax.serving")

_ERRORS = {400: {"model": ErrorResponse, "description": "a request the server does not serve (why, and the field)"},
           404: {"model": ErrorResponse, "description": "another model than the served one"},
           408: {"model": ErrorResponse, "description": "the body stopped arriving"},
           411: {"model": ErrorResponse, "description": "a chunked body, or none without a Content-Length"},
           413: {"model": ErrorResponse, "description": "a body over --max-request-bytes"},
           500: {"model": ErrorResponse, "description": "serving this request failed (the server goes on)"},
           503: {"model": Unavailable, "description": "the model is still loading, or the engine cannot serve"}}


# One server-sent event of a streamed reply (OpenAPI before 3.2: ``schema`` describes each event).
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a JSON chunk of the reply (choices with text or delta; usage last with "
                                     "stream_options.include_usage; an error object if serving failed), then [DONE]"}}}


def create_app() -> FastAPI:
  """The app, answering 503 until ``attach_server``."""
  app = FastAPI(title="m3jax serve", version="1", description="OpenAI-compatible API over m3jax's engine",
                docs_url=None, redoc_url=None)
  app.state.server = None
  app.add_exception_handler(StarletteHTTPException, _http_error)
  app.add_exception_handler(Exception, _internal_error)
  app.add_middleware(_RequestLog)
  app.add_middleware(_LoadingGate)  # outermost: nothing below it runs while the model loads
  _routes(app)
  app.openapi = lambda: _openapi(app)
  return app


def attach_server(app: FastAPI, server: Server) -> None:
  """Makes ``app`` answer with ``server`` (until now it answered 503: loading)."""
  app.state.server = server


def _server(request: Request) -> Server:
  return request.app.state.server


def _routes(app: FastAPI) -> None:
  for path, name, schema, reply, summary in (
      (COMPLETIONS, "createCompletion", CompletionRequest, Completion,
       "Completions: text or token-id prompts (echo, logprobs, n)"),
      (CHAT, "createChatCompletion", ChatCompletionRequest, ChatCompletion,
       "Chat completions, rendered with the chat template"),
      (TOKENIZE, "tokenize", TokenizeRequest, Tokens, "A text's token ids"),
      (DETOKENIZE, "detokenize", DetokenizeRequest, Detokenized, "Token ids' text")):
    streams = path in (COMPLETIONS, CHAT)
    ok = {"model": reply, "description": "the reply" + (" (stream: text/event-stream events)" if streams else "")}
    if streams:
      ok["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    app.add_api_route(path, _poster(path), methods=["POST"], summary=summary, operation_id=name,
                      response_class=JSONResponse, responses={200: ok, **_ERRORS}, openapi_extra=_request_body(schema))

  @app.get("/health", operation_id="health", responses={200: {"model": Health}, 503: {"model": Health}})
  def health(request: Request) -> Response:
    failure = _server(request).health()
    if failure is None:
      return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "error", "message": failure}, 503)

  @app.get("/v1/models", operation_id="listModels", responses={200: {"model": ModelList}})
  def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_server(request).model_card()]})

  @app.get("/v1/models/{name:path}", operation_id="retrieveModel",
           responses={200: {"model": ModelCard}, 404: _ERRORS[404]})
  def model(request: Request, name: str) -> Response:
    server = _server(request)
    if name == server.model_name:
      return JSONResponse(server.model_card())
    return _error(404, f"The model {name[:80]!r} does not exist: this server serves {server.model_name!r}",
                  param="model", code="model_not_found")

  @app.get("/metrics", operation_id="metrics", response_class=Response,
           responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                            "description": "Prometheus text format"}})
  def metrics(request: Request) -> Response:
    server = _server(request)
    return Response(server.metrics.render(server.engine_stats()),
                    media_type="text/plain; version=0.0.4; charset=utf-8")

  @app.get("/tokenizer_info", operation_id="tokenizerInfo", responses={200: {"model": TokenizerInfo}})
  def tokenizer_info(request: Request) -> Response:
    return JSONResponse(_server(request).tokenizer_info)


def _poster(route: str) -> Callable:
  async def post(request: Request) -> Response:
    server = _server(request)
    try:
      body_length(request.headers, server.limits.max_body_bytes)
    except RequestError as e:  # the body is not read: nothing after it on this connection can be parsed
      return _head_response(json_head(e.status, e.body(), close=True))
    try:
      data = await asyncio.wait_for(request.body(), _BODY_TIMEOUT_S)
    except ClientDisconnect:
      return _NoAnswer()
    except TimeoutError:
      return _error(408, f"the body did not arrive within {_BODY_TIMEOUT_S:g} s", close=True)
    record = request.scope[_RECORD]
    return _Threaded(lambda gone: answer(server, route, data, record, gone))

  return post


def _request_body(model) -> dict[str, Any]:
  return {"requestBody": {"required": True, "content": {"application/json": {
      "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
  """FastAPI's document, with the request models (the POST routes read their bodies themselves, so FastAPI does
  not know them) and without the 422 it adds for path parameters (this server answers 400)."""
  if app.openapi_schema is None:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                 ref_template="#/components/schemas/{model}")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs["$defs"])
    for name in ("HTTPValidationError", "ValidationError"):
      schemas.pop(name, None)
    for item in doc["paths"].values():
      for operation in item.values():
        operation.get("responses", {}).pop("422", None)
    app.openapi_schema = doc
  return app.openapi_schema


def _error(status: int, message: str, param: str | None = None, code: str | None = None, *,
           close: bool = False) -> Response:
  return _head_response(json_head(status, error_body(message, status, param, code), close=close))


def _head_response(head: Head) -> Response:
  response = Response(head.body, head.status)
  for key, value in head.headers:
    response.headers[key] = value
  return response


async def _http_error(request: Request, exc: Exception) -> Response:
  """The router's 404 / 405 in OpenAI's error shape."""
  status = getattr(exc, "status_code", 500)
  path = request.url.path[:80]
  if status == 404:
    return _error(404, f"no route {path}", code="not_found")
  if status == 405:
    return _error(405, f"{request.method} is not allowed on {path}", code="method_not_allowed")
  return _error(status, str(getattr(exc, "detail", exc)))


async def _internal_error(request: Request, exc: Exception) -> Response:
  del request
  return _error(500, f"internal error: {type(exc).__name__}: {exc}")


class _NoAnswer(Response):
  """No response: the client left before its request was read."""

  async def __call__(self, scope, receive, send) -> None:
    del scope, receive, send


class _Threaded(Response):
  """Runs ``produce(client_gone)`` (m3jax.serving_replies.answer) on a thread of its own and sends what it yields,
  while listening for the client hanging up (then ``client_gone()`` turns true and the producer is abandoned)."""

  def __init__(self, produce: Callable[[Callable[[], bool]], Iterator[Head | bytes]]):
    super().__init__()
    self._produce = produce

  async def __call__(self, scope, receive, send) -> None:
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()
    threading.Thread(target=_drive, args=(self._produce(gone.is_set), loop, items, gone), daemon=True,
                     name="m3jax-request").start()
    watcher = asyncio.ensure_future(_watch_disconnect(receive, gone))
    streaming = False
    try:
      while True:
        getter = asyncio.ensure_future(items.get())
        await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():  # the client left
          getter.cancel()
          return
        item = getter.result()
        if item is _END:
          break
        if isinstance(item, BaseException):
          raise item
        if isinstance(item, Head):
          headers = [(k.encode(), v.encode()) for k, v in item.headers]
          if item.body is not None:
            headers.append((b"content-length", str(len(item.body)).encode()))
          await send({"type": "http.response.start", "status": item.status, "headers": headers})
          if item.body is not None:
            await send({"type": "http.response.body", "body": item.body})
            return
          streaming = True
        else:
          await send({"type": "http.response.body", "body": item, "more_body": True})
      if streaming:
        await send({"type": "http.response.body", "body": b""})
    except asyncio.CancelledError:  # the server is stopping and its grace period is over: a line, not a traceback
      log.warning("%s %s: the reply was cut short, the server is stopping", scope["method"], scope["path"][:80])
    finally:
      gone.set()
      watcher.cancel()


_END = object()


def _drive(items: Iterator[Head | bytes], loop: asyncio.AbstractEventLoop, queue: asyncio.Queue,
           gone: threading.Event) -> None:
  """On the request's thread: ``items`` into ``queue`` (on ``loop``), then _END; an exception goes in as itself.
  Stops early once ``gone`` is set (closing ``items``, which cancels the request's engine requests)."""
  def put(item: Any) -> None:
    try:
      loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # the loop has closed (the server stopped)
      gone.set()

  try:
    for item in items:
      if gone.is_set():
        break
      put(item)
  except BaseException as e:  # pylint: disable=broad-except  (handed to the loop, which answers 500)
    put(e)
  finally:
    items.close()
    put(_END)


async def _watch_disconnect(receive, gone: threading.Event) -> None:
  while (await receive())["type"] != "http.disconnect":
    pass
  gone.set()


class _LoadingGate:
  """Every route answers 503 (OpenAI's error shape, ``"status": "loading"``) until the app has a Server."""

  def __init__(self, app):
    self.app = app

  async def __call__(self, scope, receive, send) -> None:
    if scope["type"] != "http" or scope["app"].state.server is not None:
      await self.app(scope, receive, send)
      return
    body = {"status": "loading", **error_body("the model is still loading; retry shortly", 503)}
    await _head_response(json_head(503, body, close=True))(scope, receive, send)


class _RequestLog:
  """One line per request (logger m3jax.serving: client, method, path, status, prompt / completion tokens,
  latency; /health and /metrics at DEBUG) once its reply is out, and the request in ``Server.metrics``; a client
  that left before any answer is logged with status 499 (nginx's "client closed request")."""

  def __init__(self, app):
    self.app = app

  async def __call__(self, scope, receive, send) -> None:
    if scope["type"] != "http":
      await self.app(scope, receive, send)
      return
    record = scope[_RECORD] = RequestRecord(started=time.perf_counter())
    status = None

    async def sent(message) -> None:
      nonlocal status
      if message["type"] == "http.response.start":
        status = message["status"]
      await send(message)

    try:
      await self.app(scope, receive, sent)
    except Exception:
      status = status or 500  # answered by the app's outermost handler
      raise
    finally:
      seconds = time.perf_counter() - record.started
      path = scope["path"][:80]
      status = status or 499
      scope["app"].state.server.metrics.request_done(path if path in _KNOWN_PATHS else "other", status, seconds,
                                                     *record.usage)
      client = scope.get("client") or ("-", 0)
      log.log(logging.DEBUG if path in _QUIET_PATHS else logging.INFO,
              "%s %s %s %d prompt_tokens=%d completion_tokens=%d latency=%.3fs", client[0], scope["method"], path,
              status, record.usage[0], record.usage[1], seconds)
