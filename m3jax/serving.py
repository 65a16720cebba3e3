"""An OpenAI-compatible server over the continuous-batching engine (``m3jax serve``): ``Server``, the requests'
side (validation, the engine's worker thread, replies, echo scoring, metrics); m3jax.serving_http answers HTTP
with it (``serve``, ``bind``, ``attach``: the FastAPI app of m3jax.serving_app on uvicorn, ``/openapi.json`` its
OpenAPI document).

Endpoints: ``POST /v1/completions`` (``prompt``: a text, token ids, or a list of either, each its own choice),
``POST /v1/chat/completions`` (``messages``, rendered with the checkpoint's chat template; contents as strings or
text parts, and with the model's vision tower image_url parts holding data: URLs: ``Server._multimodal``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, m3jax.metrics), and the tokenizer:
``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize`` (vLLM's routes, what lm-eval's
``tokenizer_backend=remote`` reads). ``stream: true`` sends server-sent events, one per decode call that gives a
choice new text, then ``data: [DONE]`` (with ``stream_options.include_usage`` a last chunk with the usage and no
choices before it). ``stop`` (a string or a list of them) ends the text before the first stop string, with
finish_reason "stop", and frees the request's slot at once; so does a streaming client that hangs up.

Completions ``echo: true`` starts each choice with its prompt: the prompt's text, and with ``logprobs: k`` its
tokens, their log-probabilities (null for the first, which has nothing to condition on) and top-k, scored in one
forward (m3jax.scoring.token_logprobs, the numbers ``score_continuations`` gives); ``max_tokens: 0`` then returns
the prompt alone. With echo every generated token is listed, the stop token too (OpenAI's legacy layout, which
lm-eval's loglikelihood reads as prompt + one generated token).

One worker thread owns the ``Engine``; each request's own thread (m3jax.serving_replies) validates it
(m3jax.request_validation: the body's size from its headers before it is read, then every field against the
engine's limits, then the OpenAI schema, then the tokenized prompts), submits it (one engine request per choice: n
per prompt), and waits on its own queue for its tokens. Echo scoring runs on the request's thread, one request at
a time. Faults stay local: a request whose serving fails gets a 500 (or an error event
when streamed) and frees its slots while the engine goes on; ``/health`` answers 503 once the engine cannot serve.
A client that hangs up, streaming or not, cancels its request at the engine's next step. Each request samples with
its own temperature / top_k / top_p / seed (the server's start values by default); its tokens do not depend on the
other requests (m3jax.engine). Fields that would change the result but are not implemented (penalties,
logit_bias, ...) get a 400 naming them; errors use OpenAI's shape ({"error": {"message", "type", "param",
"code"}}), and a ``model`` other than the served one gets a 404 ("model_not_found"). Streamed text never shows a
partial character (m3jax.detokenize); special tokens are left out of reply text unless ``skip_special_tokens:
false``. Log-probabilities (completions ``logprobs: k``, chat ``logprobs: true`` + ``top_logprobs: k``) are of the
raw logits, for the tokens whose text the reply shows (not a stop string's), up to the engine's ``top_logprobs``
alternatives per token (``m3jax serve --max-logprobs``); completions name tokens by their text, or ``bytes:\\xNN``
when they hold part of a character, so that distinct tokens never share a key. Every request is logged (logger
``m3jax.serving``: method, path, status, prompt / completion tokens, latency).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from m3jax import tokenizer as tok_lib
from m3jax.config import M3Config
from m3jax.detokenize import TokenStrings
from m3jax.engine import Engine, Update
from m3jax.metrics import ServerMetrics
from m3jax.reply import Piece, Reply, TextOffsets
from m3jax.request_validation import (IMAGE_BODY_BYTES, Limits, ParsedRequest, RequestError, check_prompt,
                                      default_body_limit, parse_request)

__all__ = ["ClientGone", "Echo", "GenerationFailed", "Request", "RequestError", "Server"]

_POLL_S = 0.05  # how often a request waiting for its first tokens checks whether its client is still there
# Echo scoring computes logits over every prompt token: at most this many tokens of them per forward (rows x chunk
# width), each prompt in chunks of the engine's prefill_chunk or _SCORE_CHUNK tokens (a power of two, as
# generate's prefill_chunk; shorter prompts run whole).
_SCORE_TOKENS = 4096
_SCORE_CHUNK = 1024


class GenerationFailed(RuntimeError):
  """Serving one request failed (the engine ended it with finish_reason "error", or the engine stopped)."""


class ClientGone(Exception):
  """The request's client closed its connection."""


@dataclasses.dataclass(frozen=True)
class Request:
  """A checked completions / chat request: its prompts' ids (one per choice), max_tokens, sampling (Engine.submit's
  temperature / top_k / top_p / seed, as given), stop strings and the reply's options."""

  prompts: tuple[tuple[int, ...], ...]
  max_tokens: int
  sampling: dict[str, Any]
  stop: tuple[str, ...] = ()
  logprobs: int | None = None  # None: no log-probabilities; k: the chosen token's and the k most likely
  stream: bool = False
  echo: bool = False
  include_usage: bool = False
  skip_special_tokens: bool = True
  n: int = 1  # choices per prompt: choice c is prompt c // n's (c % n)-th
  prompt_embeds: Any = None  # chat with images: the prompt's embeddings [1, len(prompt), H] (embed_multimodal)

  @property
  def prompt_tokens(self) -> int:
    """The prompts' tokens, each counted once however many choices it has (as OpenAI counts them)."""
    return sum(len(p) for p in self.prompts)

  @property
  def choices(self) -> int:
    return len(self.prompts) * self.n


@dataclasses.dataclass(frozen=True)
class Echo:
  """A prompt as an echoing choice starts: its text and tokens, and with log-probabilities each token's (None for
  the first) and its top alternatives [(id, logprob), ...] (None for the first), and each token's character
  offset in the text."""

  text: str
  ids: list[int]
  offsets: list[int]
  logprobs: list[float | None] | None = None
  top: list[list[tuple[int, float]] | None] | None = None


class Server:
  """The engine's worker thread plus the request bookkeeping shared by the requests' threads
  (m3jax.serving_replies).

  Args:
    engine: the Engine to run (its slots, max_length and sampling serve every request).
    checkpoint: the checkpoint directory (tokenizer.json, chat template, generation_config.json, config.json).
    model_name: what ``/v1/models`` and responses report; a request naming another model gets a 404.
    max_body_bytes: the largest request body read (default: request_validation.default_body_limit, plus
      IMAGE_BODY_BYTES per image a request may hold).
    max_images: image_url parts a chat request may hold when the engine's model has its vision tower (without
      one the server takes no images).
  """

  def __init__(self, engine: Engine, checkpoint: str, model_name: str = "minimax-m3", *,
               max_body_bytes: int | None = None, max_images: int = 8):
    if max_images < 0:
      raise ValueError(f"max_images must be >= 0, got {max_images}")
    self.engine, self.checkpoint, self.model_name = engine, checkpoint, model_name
    self.tokenizer = tok_lib.load_tokenizer(checkpoint)
    self.token_strings = TokenStrings(self.tokenizer)
    max_images = max_images if getattr(engine.model, "vision", None) is not None else 0
    if max_body_bytes is None:
      max_body_bytes = default_body_limit(engine.max_length) + IMAGE_BODY_BYTES * max_images
    self.limits = Limits(vocab_size=engine.model.config.text.vocab_size, max_length=engine.max_length,
                         max_logprobs=engine.top_logprobs if engine.logprobs else None, max_body_bytes=max_body_bytes,
                         placeholder_ids=_placeholder_ids(checkpoint, engine), model_name=model_name,
                         max_images=max_images)
    self.metrics = ServerMetrics()
    self.tokenizer_info = _tokenizer_info(checkpoint, self.token_strings, engine)
    self._ids = itertools.count()
    self._pending: dict[int, queue.Queue] = {}  # request id -> where its updates go
    self._lock = threading.Condition()
    self._scoring = threading.Lock()  # echo scoring and vision encoding: one forward at a time beside the engine's
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

  def next_id(self) -> int:
    """A fresh request id (what a reply that queued no engine request is named after)."""
    return next(self._ids)

  def model_card(self) -> dict[str, Any]:
    """The served model as /v1/models lists it."""
    return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "m3jax",
            "max_model_len": self.engine.max_length}

  def engine_stats(self) -> dict[str, Any]:
    """The engine's live counts for /metrics (``Engine.serving_stats``; {} for an engine without it)."""
    stats = getattr(self.engine, "serving_stats", None)
    return dict(stats()) if callable(stats) else {}

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
    """A request whose fields are checked -> its prompts' ids (the chat template rendered, the texts tokenized),
    each checked against the engine (vocabulary, placeholders, length); a chat request with images also gets
    its prompt's embeddings (``_multimodal``)."""
    embeds = None
    if parsed.messages is not None:
      try:
        text = tok_lib.render_messages(self.checkpoint, [dict(m) for m in parsed.messages])
      except ValueError as e:  # ChatTemplateError: the template refused the messages (raise_exception) or failed
        raise RequestError(str(e), param="messages") from None
      if parsed.images:
        prompts, embeds = self._multimodal(text, parsed)
      else:
        prompts = [self.tokenizer.encode(text, add_special_tokens=False).ids]
    else:
      prompts = [self.tokenizer.encode(p, add_special_tokens=False).ids if isinstance(p, str) else list(p)
                 for p in parsed.prompts]
    for i, ids in enumerate(prompts if embeds is None else ()):  # (_multimodal checked its prompt)
      try:
        check_prompt(ids, parsed.max_tokens, self.limits)
      except RequestError as e:
        if len(prompts) == 1:
          raise
        raise RequestError(f"prompt {i}: {e}", e.status, param="prompt") from None
    return Request(tuple(tuple(p) for p in prompts), parsed.max_tokens, dict(parsed.sampling), parsed.stop,
                   parsed.logprobs, parsed.stream, parsed.echo, parsed.include_usage, parsed.skip_special_tokens,
                   parsed.n, embeds)

  def _multimodal(self, text: str, parsed: ParsedRequest) -> tuple[list[list[int]], Any]:
    """The rendered chat with one IMAGE_MARKER per image_url part -> ([its ids], its embeddings [1, S, H]): each
    image decoded and resized (m3jax.image_urls, a 400 naming its part when it cannot be), the markers expanded
    to the images' placeholders (m3jax.vision.build_multimodal_inputs, as ``m3jax generate --image`` does), the
    length checked, then the vision tower and the token embeddings (``model.embed_multimodal``), one such
    forward at a time beside the engine's."""
    from m3jax.image_urls import decode_image_url  # pylint: disable=g-import-not-at-top
    from m3jax.vision import IMAGE_MARKER, build_multimodal_inputs  # pylint: disable=g-import-not-at-top

    markers = text.count(IMAGE_MARKER)
    if markers != len(parsed.images):
      raise RequestError(f"the rendered messages hold {markers} image markers {IMAGE_MARKER!r} but the request has "
                         f"{len(parsed.images)} image_url parts; send images as image_url parts only",
                         param="messages")
    images = [decode_image_url(part.url, part.where) for part in parsed.images]
    model = self.engine.model
    try:
      inputs = build_multimodal_inputs(text, self.tokenizer, images=images, image_token_id=model.config.image_token_id)
    except ValueError as e:  # a video marker in the text, a tokenizer without the image markers
      raise RequestError(str(e), param="messages") from None
    ids = inputs.input_ids[0].tolist()
    check_prompt(ids, parsed.max_tokens, self.limits, with_images=True)
    with self._scoring:
      try:
        embeds = model.embed_multimodal(inputs.input_ids, **inputs.pixel_kwargs())
      except ValueError as e:  # the placeholders do not match the features (e.g. a placeholder id in the text)
        raise RequestError(str(e), param="messages") from None
    return [ids], embeds

  def submit(self, request: Request) -> tuple[list[int], queue.Queue]:
    """Queues one engine request per choice (n per prompt; none with max_tokens 0) -> (their ids, in choice order;
    the queue their ``Update``s arrive on; a GenerationFailed there if the engine stopped). A prompt's j-th choice
    samples with the request's seed + j (or, without a seed, the engine's own seed per request). RequestError 503
    when the engine cannot serve, 400 when it refuses a prompt (then none of the request's choices is left
    queued)."""
    updates: queue.Queue = queue.Queue()
    ids: list[int] = []
    with self._lock:
      failure = self.health()
      if failure is not None:
        raise RequestError(f"the server cannot serve: {failure}", 503)
      if request.max_tokens == 0:
        return ids, updates
      for choice in range(request.choices):
        prompt, j = request.prompts[choice // request.n], choice % request.n
        sampling = dict(request.sampling)
        if "seed" in sampling:
          sampling["seed"] = (sampling["seed"] + j) % 2**31
        request_id = next(self._ids)
        try:
          self.engine.submit(prompt, max_new_tokens=request.max_tokens, request_id=request_id,
                             prompt_embeds=request.prompt_embeds, **sampling)
        except ValueError as e:
          for queued in ids:
            self._pending.pop(queued, None)
            self.engine.cancel(queued)
          raise RequestError(str(e).replace(f"request {request_id!r}: ", "")) from None
        self._pending[request_id] = updates
        ids.append(request_id)
      self._lock.notify_all()
    return ids, updates

  def cancel(self, request_id: int) -> None:
    """Frees a request's slot (its stop string came, or its client left); its queue gets no more updates."""
    with self._lock:
      self._pending.pop(request_id, None)
    self.engine.cancel(request_id)

  def follow(self, request_ids: Sequence[int] | int, updates: queue.Queue, stop: tuple[str, ...] = (),
             client_gone: Callable[[], bool] | None = None, *, skip_special_tokens: bool = True,
             list_stop_token: bool = False) -> Iterator[tuple[int, Piece]]:
    """Submitted requests' replies as they come: (the request's index in ``request_ids``, a Piece) per update
    (m3jax.reply): the stop token is not shown (nor listed, unless ``list_stop_token``); a stop string ends the
    text before it (finish_reason "stop"; tokens counted up to the one that completed it, listed up to those that
    spell the text kept) and cancels the rest of the request.

    Raises GenerationFailed when serving a request failed, and ClientGone when ``client_gone()`` (asked at each
    update, and every few tens of milliseconds while the requests wait) says its client left. However the
    iteration ends before the replies do (an exception here or in the caller, or ``close()``), the unfinished
    requests are cancelled, so their slots are freed at the engine's next step.
    """
    request_ids = [request_ids] if isinstance(request_ids, int) else list(request_ids)
    index = {r: i for i, r in enumerate(request_ids)}
    replies = {r: Reply(self.tokenizer, stop, self.token_strings, skip_special_tokens=skip_special_tokens,
                        list_stop_token=list_stop_token) for r in request_ids}
    unfinished = set(request_ids)
    try:
      while unfinished:
        try:
          update = updates.get(timeout=None if client_gone is None else _POLL_S)
        except queue.Empty:
          if client_gone():
            raise ClientGone() from None
          continue
        if isinstance(update, Exception):
          raise update
        if update.request_id not in unfinished:
          continue  # a request a stop string finished: the engine confirming its cancel
        if update.completion is not None and update.completion.finish_reason == "error":
          unfinished.discard(update.request_id)
          raise GenerationFailed(update.completion.error or "unknown error")
        if client_gone is not None and client_gone():
          raise ClientGone()
        reply = replies[update.request_id]
        piece = reply.add(update)
        if reply.cancel:
          self.cancel(update.request_id)
        if piece.finish_reason is not None:
          unfinished.discard(update.request_id)
        yield index[update.request_id], piece
    finally:
      for r in unfinished:
        self.cancel(r)

  def echo(self, request: Request) -> list[Echo]:
    """Each prompt as its choices start with ``echo``: text, tokens and offsets, and with ``logprobs`` each
    token's log-probability and top alternatives (``token_logprobs``: the prompts scored a few rows at a time,
    ``_SCORE_TOKENS`` tokens of logits per forward, in chunks of the engine's prefill_chunk or ``_SCORE_CHUNK``)."""
    from m3jax.generate import bucket_length  # pylint: disable=g-import-not-at-top
    from m3jax.scoring import token_logprobs  # pylint: disable=g-import-not-at-top

    skip = request.skip_special_tokens
    echoes = [Echo(text=self.tokenizer.decode(list(ids), skip_special_tokens=skip), ids=list(ids),
                   offsets=TextOffsets(self.token_strings, skip).add(ids)) for ids in request.prompts]
    if request.logprobs is None:
      return echoes
    k = request.logprobs
    chunk = self.engine.prefill_chunk or _SCORE_CHUNK
    width = min(bucket_length(max(len(p) for p in request.prompts)), chunk)
    rows = max(1, _SCORE_TOKENS // width)
    out = []
    for first in range(0, len(echoes), rows):
      group = echoes[first:first + rows]
      with self._scoring:
        scored = token_logprobs(self.engine.model, [e.ids for e in group], top_k=k, prefill_chunk=chunk)
      for b, e in enumerate(group):
        n = len(e.ids)
        lps = [None] + scored.logprobs[b, 1:n].tolist()
        top = [None] + ([list(zip(scored.top_ids[b, t].tolist(), scored.top_logprobs[b, t].tolist()))
                         for t in range(1, n)] if k else [[] for _ in range(1, n)])
        out.append(dataclasses.replace(e, logprobs=lps, top=top))
    return out

  def top_dict(self, top: Sequence[tuple[int, float]]) -> dict[str, float]:
    """Top alternatives -> OpenAI's completions dict, keyed by ``TokenStrings.key`` (a second token with the same
    key, e.g. a special token spelled like a plain one, is keyed ``token_id:N``): no entry is lost."""
    out: dict[str, float] = {}
    for token, logprob in top:
      key = self.token_strings.key(token)
      out["token_id:%d" % token if key in out else key] = logprob
    return out

  def completion_logprobs(self, ids: Sequence[int], logprobs: Sequence[float | None],
                          top: Sequence[Sequence[tuple[int, float]] | None] | None, offsets: Sequence[int], k: int
                          ) -> dict[str, Any]:
    """Tokens in OpenAI's completions logprobs layout (tokens / token_logprobs / top_logprobs / text_offset)."""
    tops = None
    if k:
      tops = [None if t is None else self.top_dict(list(t)[:k]) for t in (top or [[] for _ in ids])]
    return {"tokens": [self.token_strings.key(t) for t in ids], "token_logprobs": list(logprobs),
            "top_logprobs": tops, "text_offset": list(offsets)}

  def logprobs_json(self, piece: Piece, k: int, chat: bool, offset: int = 0) -> dict[str, Any]:
    """A piece's tokens in OpenAI's logprobs layout (chat: {"content": [...]}; completions: tokens /
    token_logprobs / top_logprobs / text_offset, the offsets shifted by ``offset`` characters)."""
    names = self.token_strings
    tops = [list(zip(ids[:k], lps[:k])) for ids, lps in zip(*piece.top)] if piece.top else [[] for _ in piece.ids]
    if chat:
      return {"content": [{"token": names.text(t), "logprob": lp, "bytes": names.bytes(t),
                           "top_logprobs": [{"token": names.text(a), "logprob": b, "bytes": names.bytes(a)}
                                            for a, b in top]}
                          for t, lp, top in zip(piece.ids, piece.logprobs, tops)]}
    return self.completion_logprobs(piece.ids, piece.logprobs, tops, [offset + o for o in piece.offsets], k)


def _placeholder_ids(checkpoint: str, engine: Engine) -> tuple[int, ...]:
  """The image / video placeholder ids when the checkpoint is a vision-language one (config.json has a
  vision_config): the server runs the text backbone and takes no images, so a prompt holding one is refused."""
  if engine.model.placeholder_ids:
    return engine.model.placeholder_ids
  try:
    return M3Config.from_file(checkpoint).placeholder_ids
  except (OSError, ValueError):
    return ()


def _tokenizer_info(checkpoint: str, names: TokenStrings, engine: Engine) -> dict[str, Any]:
  """GET /tokenizer_info: the special tokens (tokenizer_config.json's, else the engine's first stop token as eos),
  the chat template and the longest request (vLLM's layout, what lm-eval's remote tokenizer reads)."""
  try:
    with open(os.path.join(checkpoint, "tokenizer_config.json"), encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError):
    config = {}
  config = config if isinstance(config, dict) else {}

  def token(name: str) -> str | None:
    value = config.get(name)
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None

  eos = token("eos_token")
  if eos is None and int(engine.eos[0]) >= 0:
    eos = names.text(int(engine.eos[0]))
  template = config.get("chat_template")
  return {"eos_token": eos, "bos_token": token("bos_token"), "pad_token": token("pad_token"),
          "chat_template": template if isinstance(template, str) else None, "model_max_length": engine.max_length,
          "tokenizer_class": "PreTrainedTokenizerFast"}
