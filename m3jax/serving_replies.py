"""The answer to one POST of ``m3jax serve``, computed on the request's own thread (m3jax.serving_app runs it
there and sends what it yields): the body checked (m3jax.request_validation's messages, then the OpenAI schema of
m3jax.serving_schema), the request submitted to the ``m3jax.serving.Server``, and its reply in OpenAI's layouts,
whole or as server-sent events, as the pieces arrive (``Server.follow``).

``answer`` yields a ``Head`` (the status and headers; with ``body`` set, the whole response) and then, for a
stream, the events' bytes. Everything here blocks (tokenizing, echo scoring, waiting on the engine): it never runs
on the event loop. A client that leaves (``client_gone()``) ends the generator; closing it early cancels the
request's unfinished engine requests, so their slots are freed at the engine's next step.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import ValidationError

from m3jax.reply import Piece
from m3jax.request_validation import (CHAT, DETOKENIZE, TOKENIZE, RequestError, decode_body, error_body,
                                      parse_detokenize, parse_request, parse_tokenize)
from m3jax.serving import ClientGone, Echo, GenerationFailed, Request, Server
from m3jax.serving_schema import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                  validation_error)

__all__ = ["Head", "RequestRecord", "answer", "json_head"]

_SCHEMAS = {CHAT: ChatCompletionRequest, TOKENIZE: TokenizeRequest, DETOKENIZE: DetokenizeRequest}
_SSE_HEADERS = (("content-type", "text/event-stream"), ("cache-control", "no-cache"))


@dataclasses.dataclass(frozen=True)
class Head:
  """A response's status and headers; ``body``: the whole response (None: server-sent events follow)."""

  status: int
  headers: tuple[tuple[str, str], ...]
  body: bytes | None = None


@dataclasses.dataclass
class RequestRecord:
  """What the request log and /metrics learn of one request: when it arrived (``time.perf_counter()``) and its
  prompt / completion tokens so far."""

  started: float
  usage: tuple[int, int] = (0, 0)


def json_head(status: int, payload: Any, *, close: bool = False) -> Head:
  """A whole JSON response (``close``: the connection closes after it, e.g. when the body was not read)."""
  headers = (("content-type", "application/json"),) + ((("connection", "close"),) if close else ())
  return Head(status, headers, json.dumps(payload).encode())


def _check_schema(route: str, body: dict[str, Any]) -> None:
  """The body against the route's OpenAI schema; a mismatch is a 400 naming the field (``param``)."""
  try:
    _SCHEMAS.get(route, CompletionRequest).model_validate(body)
  except ValidationError as e:
    message, param = validation_error(e.errors(include_url=False))
    raise RequestError(message, param=param) from None


def answer(server: Server, route: str, data: bytes, record: RequestRecord, client_gone: Callable[[], bool]
           ) -> Iterator[Head | bytes]:
  """POST ``route`` with body ``data`` -> its Head, then (streaming) the events' bytes."""
  try:
    body = decode_body(data)
    if route in (TOKENIZE, DETOKENIZE):
      yield _tokenizer(server, route, body)
      return
    parsed = parse_request(route, body, server.limits)
    _check_schema(route, body)
    request = server.prepare(parsed)
    echoes = server.echo(request) if request.echo else None
    request_ids, updates = server.submit(request)
  except RequestError as e:
    yield json_head(e.status, e.body())
    return
  except Exception as e:  # pylint: disable=broad-except  (e.g. the tokenizer failed on this prompt)
    yield json_head(500, error_body(f"internal error: {type(e).__name__}: {e}", 500))
    return
  chat = route == CHAT
  record.usage = (request.prompt_tokens, 0)
  reply = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_ids[0] if request_ids else server.next_id()}",
           "created": int(time.time()), "model": server.model_name}
  pieces = _timed(server, record, server.follow(request_ids, updates, request.stop, client_gone,
                                                skip_special_tokens=request.skip_special_tokens,
                                                list_stop_token=request.echo))
  answered = False
  try:
    if request.stream:
      yield from _stream(server, pieces, request, chat, reply, echoes)
    else:
      try:
        head = _whole(server, pieces, request, chat, reply, echoes)
      except ClientGone:
        raise
      except Exception as e:  # pylint: disable=broad-except  (a fault while answering: this request's alone)
        head = json_head(500, error_body(f"internal error: {type(e).__name__}: {e}", 500))
      yield head
    answered = True
  except ClientGone:
    pass
  finally:
    pieces.close()
    if not answered:  # the engine frees their slots at the next call (nothing if they had finished)
      for request_id in request_ids:
        server.cancel(request_id)


def _tokenizer(server: Server, route: str, body: dict[str, Any]) -> Head:
  if route == TOKENIZE:
    text, special = parse_tokenize(body)
    _check_schema(route, body)
    ids = server.tokenizer.encode(text, add_special_tokens=special).ids
    return json_head(200, {"tokens": ids, "count": len(ids), "max_model_len": server.limits.max_length})
  ids = parse_detokenize(body, server.limits)
  _check_schema(route, body)
  return json_head(200, {"prompt": server.tokenizer.decode(list(ids), skip_special_tokens=False)})


def _timed(server: Server, record: RequestRecord, pieces: Iterator[tuple[int, Piece]]
           ) -> Iterator[tuple[int, Piece]]:
  """The pieces, timing each choice's first token (TTFT) and the mean gap between its later ones (TPOT) for
  /metrics, and counting the completion tokens for the request log."""
  first: dict[int, float] = {}
  counts: dict[int, int] = {}
  try:
    for i, piece in pieces:
      now = time.perf_counter()
      if piece.generated and i not in first:
        first[i] = now
        server.metrics.first_token(now - record.started)
      counts[i] = piece.generated
      if piece.finish_reason is not None and counts[i] > 1 and i in first:
        server.metrics.per_output_token((now - first[i]) / (counts[i] - 1))
      record.usage = (record.usage[0], sum(counts.values()))
      yield i, piece
  finally:
    pieces.close()


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
  """OpenAI's usage, with ``prompt_tokens_details.cached_tokens``: the prompt tokens read from the prefix cache."""
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens,
          "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _cached(request: Request, per_choice: list[int]) -> int:
  """The request's cached prompt tokens from its choices' (``Piece.cached_tokens``): each prompt counted once, as
  ``prompt_tokens`` counts it, with the fewest any of its choices read from the cache."""
  if not per_choice:
    return 0
  return sum(min(per_choice[p * request.n:(p + 1) * request.n]) for p in range(len(request.prompts)))


def _per_choice(echoes: list[Echo] | None, request: Request) -> list[Echo] | None:
  """Each choice's prompt echo (choice c is prompt c // n's)."""
  return None if echoes is None else [echoes[c // request.n] for c in range(request.choices)]


def _whole(server: Server, pieces, request: Request, chat: bool, reply: dict[str, Any],
           echoes: list[Echo] | None) -> Head:
  try:
    merged: list[list[Piece]] = [[] for _ in range(request.choices)]
    for i, piece in pieces:
      merged[i].append(piece)
  except (GenerationFailed, RequestError) as e:
    return json_head(500, error_body(f"generation failed: {e}", 500))
  choices, generated, cached = [], 0, []
  echoes = _per_choice(echoes, request)
  for i, own in enumerate(merged):
    text = "".join(p.text for p in own)
    finish = own[-1].finish_reason if own else "length"  # max_tokens 0: the prompt alone
    generated += own[-1].generated if own else 0
    cached.append(max((p.cached_tokens for p in own), default=0))
    logprobs = None
    if request.logprobs is not None:
      whole = Piece(text=text, finish_reason=finish, generated=0, ids=[t for p in own for t in p.ids],
                    logprobs=[x for p in own for x in p.logprobs],
                    top=None if not own or own[-1].top is None else ([x for p in own for x in p.top[0]],
                                                                     [x for p in own for x in p.top[1]]),
                    offsets=[x for p in own for x in p.offsets])
      logprobs = server.logprobs_json(whole, request.logprobs, chat, offset=len(echoes[i].text) if echoes else 0)
      if echoes:
        e = echoes[i]
        head = server.completion_logprobs(e.ids, e.logprobs, e.top, e.offsets, request.logprobs)
        logprobs = {key: None if head[key] is None else head[key] + logprobs[key] for key in head}
    if chat:
      choice = {"index": i, "message": {"role": "assistant", "content": text}}
    else:
      choice = {"index": i, "text": (echoes[i].text if echoes else "") + text}
    choices.append({**choice, "logprobs": logprobs, "finish_reason": finish})
  return json_head(200, {**reply, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                         "usage": _usage(request.prompt_tokens, generated, _cached(request, cached))})


def _event(payload: dict[str, Any]) -> bytes:
  return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _stream(server: Server, pieces, request: Request, chat: bool, reply: dict[str, Any],
            echoes: list[Echo] | None) -> Iterator[Head | bytes]:
  """The reply as server-sent events: each choice's prompt first with echo, one event per piece that shows text
  (or ends its choice), the usage last with include_usage, then ``data: [DONE]``; a failure mid-stream is an
  error event (OpenAI's error shape) before [DONE]."""
  yield Head(200, _SSE_HEADERS)
  reply = {**reply, "object": "chat.completion.chunk" if chat else "text_completion"}
  if request.include_usage:
    reply["usage"] = None  # OpenAI's chunks carry "usage": null until the last one
  started: set[int] = set()
  generated, cached = [0] * request.choices, [0] * request.choices
  echoes = _per_choice(echoes, request)
  shift = [len(e.text) for e in echoes] if echoes else [0] * request.choices
  if echoes:  # each choice starts with its prompt
    for i, e in enumerate(echoes):
      choice = {"index": i, "text": e.text, "finish_reason": None if request.max_tokens else "length"}
      if request.logprobs is not None:
        choice["logprobs"] = server.completion_logprobs(e.ids, e.logprobs, e.top, e.offsets, request.logprobs)
      yield _event({**reply, "choices": [choice]})
  try:
    for i, piece in pieces:
      generated[i], cached[i] = piece.generated, max(cached[i], piece.cached_tokens)
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
      yield _event({**reply, "choices": [{**choice, "finish_reason": piece.finish_reason}]})
  except ClientGone:
    raise
  except (GenerationFailed, RequestError) as e:
    yield _event(error_body(f"generation failed: {e}", 500))
  except Exception as e:  # pylint: disable=broad-except  (a fault while answering: this request's alone)
    yield _event(error_body(f"internal error: {type(e).__name__}: {e}", 500))
  else:
    if request.include_usage:
      yield _event({**reply, "choices": [],
                     "usage": _usage(request.prompt_tokens, sum(generated), _cached(request, cached))})
  yield b"data: [DONE]\n\n"
