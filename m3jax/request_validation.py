"""Checks on an HTTP completions / chat request at the server's edge, as pure functions of the request and the
engine's limits (no sockets, no tokenizer, no engine): the body's size from its headers before it is read, the
JSON body, and every field against what the engine can really run (int32 ranges, the vocabulary, the context
length). Each refusal is a ``RequestError`` carrying the HTTP status, a one-line reason and the field it names
(``param``), answered in OpenAI's error shape (``RequestError.body``). JSON ``null`` means "the default" for every
optional field.

``m3jax.serving`` calls them in this order: ``body_length`` (headers) -> read the body -> ``decode_body`` ->
``parse_request`` (fields) -> render / tokenize the prompt -> ``check_prompt`` (ids, length, placeholders).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Mapping
from typing import Any

INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: longer ones cannot end a reply any sooner than max_tokens would

MAX_PROMPTS = 64  # prompts in one completions request (each is its own choice and its own engine request)
MAX_CHOICES = 64  # prompts x n: the engine requests one HTTP request may queue

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"  # the tokenizer over HTTP (vLLM's routes; lm-eval's "remote")
ROUTES = (COMPLETIONS, CHAT)
POST_ROUTES = (COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE)

# Request fields that would change the result, with the values that do not (anything else gets a 400).
UNSUPPORTED = {"best_of": (None, 1), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "suffix": (None, ""),
               "tools": (None, []), "response_format": (None, {"type": "text"})}
# Chat content parts that carry something other than text or images (refused: the server takes neither).
_MEDIA_PARTS = ("input_image", "image", "input_audio", "audio", "video_url", "video", "file")
# Where the chat template puts an image part (m3jax.vision.IMAGE_MARKER: the marker the vision prompt expands).
IMAGE_MARKER = "]<]image[>["


class RequestError(ValueError):
  """A request the server refuses, with the HTTP status (400 unless said), the reason, the request field it is
  about (``param``, or None) and OpenAI's error ``code`` (a string such as "model_not_found", or None)."""

  def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.param, self.code = status, param, code

  def body(self) -> dict[str, Any]:
    """The error as OpenAI answers one: {"error": {"message", "type", "param", "code"}}."""
    return error_body(str(self), self.status, self.param, self.code)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
  """OpenAI's error object: type "invalid_request_error" for 4xx, "server_error" otherwise; ``code`` a string or
  None (never the HTTP status: that is the response's)."""
  kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the engine behind the server can run.

  Attributes:
    vocab_size: token ids must lie in [0, vocab_size).
    max_length: prompt + max_tokens tokens per request.
    max_logprobs: most alternatives per token a request may ask log-probabilities for; None: log-probabilities off.
    max_body_bytes: largest request body read (checked from Content-Length before reading).
    placeholder_ids: image / video placeholder token ids: a prompt's own ids may not hold them (an image comes as
      an image_url part, whose placeholders the server writes itself).
    model_name: the id the server serves; a request naming another ``model`` gets a 404 (None: any name).
    max_images: image_url parts one chat request may hold (0: the server takes no images: the checkpoint has no
      vision tower, or ``m3jax serve --no-vision``).
  """

  vocab_size: int
  max_length: int
  max_logprobs: int | None = None
  max_body_bytes: int = 1 << 20
  placeholder_ids: tuple[int, ...] = ()
  model_name: str | None = None
  max_images: int = 0


def default_body_limit(max_length: int) -> int:
  """The body size ``m3jax serve`` accepts by default: room for a prompt of max_length tokens as ids
  (~8 bytes each) or as JSON-escaped text (a token rarely spans more than ~16 escaped characters), plus 64 KiB."""
  return 64 * max_length + (64 << 10)


# What ``m3jax serve`` adds to its default body limit per image a request may hold (base64 of a 12 MiB image).
IMAGE_BODY_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class ImagePart:
  """A chat ``image_url`` part, its URL's scheme checked (decoded by m3jax.image_urls): ``where`` names it as
  ``param`` does ("messages.[0].content.[1]")."""

  where: str
  url: str


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
  """The fields of a checked request. Exactly one of ``prompts`` (completions: each a text or a tuple of token
  ids, each its own choice) and ``messages`` (chat, for the chat template) is set. ``sampling`` holds
  Engine.submit's temperature / top_k / top_p / seed as given (top_k -1 already mapped to 0). ``max_tokens`` is
  0 only with ``echo`` (the prompt alone, scored)."""

  chat: bool
  max_tokens: int
  sampling: dict[str, Any]
  stop: tuple[str, ...] = ()
  logprobs: int | None = None  # None: no log-probabilities; k: the chosen token's and the k most likely
  stream: bool = False
  prompts: tuple[str | tuple[int, ...], ...] | None = None
  messages: tuple[dict[str, str], ...] | None = None
  images: tuple[ImagePart, ...] = ()  # chat: the image_url parts in order (each an IMAGE_MARKER in its content)
  echo: bool = False  # completions: the reply starts with the prompt (its text, and its tokens' log-probabilities)
  include_usage: bool = False  # stream_options.include_usage: a last chunk with usage and no choices
  skip_special_tokens: bool = True  # special tokens (<bos>, image markers, ...) are left out of reply text
  n: int = 1  # choices per prompt (choice i * n + j is prompt i's j-th)


def body_length(headers: Mapping[str, str], limit: int) -> int:
  """The request body's size from its headers, before anything is read -> bytes to read.

  Refuses a chunked (or otherwise encoded) body (411: the size must be known before reading), a missing,
  malformed or negative Content-Length (411 / 400) and one over ``limit`` (413).
  """
  encoding = headers.get("Transfer-Encoding")
  if encoding is not None and encoding.strip().lower() != "identity":
    raise RequestError(f"Transfer-Encoding: {encoding[:40]} bodies are not accepted; send the body with a "
                       "Content-Length", 411)
  raw = headers.get("Content-Length")
  if raw is None:
    raise RequestError("the request needs a Content-Length header", 411)
  raw = raw.strip()
  if not raw.isdigit() or not raw.isascii():
    raise RequestError(f"Content-Length must be a non-negative integer, got {raw[:40]!r}")
  length = int(raw)
  if length > limit:
    raise RequestError(f"the body is {length} bytes; this server accepts at most {limit} "
                       "(m3jax serve --max-request-bytes)", 413)
  return length


def _no_constants(name: str) -> float:
  raise RequestError(f"the body is not JSON: {name} is not a JSON number")


def decode_body(data: bytes) -> dict[str, Any]:
  """A request body -> its JSON object (UTF-8, strict JSON: no NaN / Infinity, no nesting so deep that the parser
  would overflow the stack)."""
  try:
    body = json.loads(data.decode("utf-8"), parse_constant=_no_constants)
  except UnicodeDecodeError as e:
    raise RequestError(f"the body is not UTF-8 text ({e.reason} at byte {e.start})") from None
  except json.JSONDecodeError as e:
    raise RequestError(f"the body is not JSON: {e}") from None
  except RecursionError:
    raise RequestError("the body is not JSON this server reads: nested too deeply") from None
  if not isinstance(body, dict):
    raise RequestError(f"the body must be a JSON object, got a JSON {type(body).__name__}")
  return body


def is_int(value: Any) -> bool:
  """A JSON integer (not a bool, not a float such as 2.0 or 2.5)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _show(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def parse_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
  """temperature / top_p / top_k / seed -> Engine.submit's keyword arguments (absent or null ones left out)."""
  sampling: dict[str, Any] = {}
  temperature = body.get("temperature")
  if temperature is not None:
    if not is_number(temperature) or not 0 <= temperature <= FLOAT32_MAX:
      raise RequestError(f"temperature must be a finite number >= 0, got {_show(temperature)}", param="temperature")
    sampling["temperature"] = float(temperature)
  top_p = body.get("top_p")
  if top_p is not None:
    if not is_number(top_p) or not 0 < top_p <= 1:
      raise RequestError(f"top_p must be a number in (0, 1], got {_show(top_p)}", param="top_p")
    sampling["top_p"] = float(top_p)
  top_k = body.get("top_k")
  if top_k is not None:
    if not is_int(top_k) or not -1 <= top_k <= INT32_MAX:
      raise RequestError(f"top_k must be an integer in [-1, {INT32_MAX}] (-1 or 0: no cut), got {_show(top_k)}", param="top_k")
    sampling["top_k"] = max(int(top_k), 0)
  seed = body.get("seed")
  if seed is not None:
    if not is_int(seed) or not 0 <= seed <= INT32_MAX:
      raise RequestError(f"seed must be an integer in [0, {INT32_MAX}], got {_show(seed)}", param="seed")
    sampling["seed"] = int(seed)
  return sampling


def parse_logprobs(body: Mapping[str, Any], chat: bool, limits: Limits) -> int | None:
  """completions: logprobs = k (int); chat: logprobs = true, top_logprobs = k -> k, or None for none."""
  if chat:
    want, k = body.get("logprobs"), body.get("top_logprobs")
    if want not in (None, False, True):
      raise RequestError(f"logprobs must be true or false, got {_show(want)}", param="logprobs")
    if k is not None and not want:
      raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    k = (k or 0) if want else None
  else:
    k = body.get("logprobs")
  if k is None:
    return None
  name = "top_logprobs" if chat else "logprobs"
  if not is_int(k) or k < 0:
    raise RequestError(f"{name} must be a non-negative integer, got {_show(k)}", param=name)
  if limits.max_logprobs is None:
    raise RequestError("log-probabilities are off on this server (m3jax serve --max-logprobs -1)", param=name)
  if k > limits.max_logprobs:
    raise RequestError(f"at most {limits.max_logprobs} log-probabilities per token on this server "
                       f"(m3jax serve --max-logprobs), got {k}", param=name)
  return int(k)


def parse_stop(value: Any) -> tuple[str, ...]:
  """stop: null, a string or a list of at most MAX_STOP_STRINGS strings -> the non-empty ones ("" stops nothing,
  as OpenAI accepts it)."""
  stop = [] if value is None else [value] if isinstance(value, str) else value
  if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(x, str) for x in stop):
    raise RequestError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings, got {_show(value)}", param="stop")
  long = [x for x in stop if len(x) > MAX_STOP_CHARS]
  if long:
    raise RequestError(f"stop strings may hold at most {MAX_STOP_CHARS} characters, got one of {len(long[0])}", param="stop")
  return tuple(x for x in stop if x)


def parse_content(i: int, content: Any, images: list[ImagePart] | None = None, max_images: int = 0, *,
                  local_files: bool = False) -> str:
  """A message's content: a string, or a list of parts: text parts ``{"type": "text", "text": str}`` and, when
  ``max_images`` > 0, image parts ``{"type": "image_url", "image_url": {"url": str, "detail": ...}}`` (``detail``
  ignored; the URL's scheme checked here, its image decoded later). Text parts in a row are joined with newlines
  (as vLLM does); an image part becomes IMAGE_MARKER at its place, with nothing around it (so an image before the
  text renders as ``m3jax chat`` / ``m3jax generate --image`` render it), and is appended to ``images``. Audio /
  file / video parts are refused, as image parts are when the server takes no images."""
  if isinstance(content, str):
    return content
  if not isinstance(content, list) or not content:
    raise RequestError(f"message {i}: content must be a string or a non-empty list of text parts, got "
                       f"{_show(content)}", param=f"messages.[{i}].content")
  pieces: list[str] = []
  previous_text = False
  images = [] if images is None else images
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    where = f"messages.[{i}].content.[{j}]"
    if kind == "image_url":
      if max_images <= 0:
        raise RequestError(f"message {i}, content part {j}: image_url parts are not supported (this server takes no "
                           "images: the checkpoint has no vision tower, or it runs with --no-vision; send text "
                           "parts)", param=where)
      spec = part.get("image_url")
      url = spec.get("url") if isinstance(spec, dict) else None
      if not isinstance(url, str):
        raise RequestError(f'{where}: expected {{"type": "image_url", "image_url": {{"url": "data:image/png;base64,'
                           f'..."}}}}, got {_show(part)}', param=where)
      if spec.get("detail") is not None and not isinstance(spec.get("detail"), str):
        raise RequestError(f"{where}: image_url.detail must be a string (it is ignored), got "
                           f"{_show(spec['detail'])}", param=where)
      problem = url_scheme_error(url, files=local_files)
      if problem is not None:
        raise RequestError(f"{where}: {problem}", param=where)
      if len(images) >= max_images:
        raise RequestError(f"{where}: at most {max_images} images per request"
                           f"{'' if local_files else ' (m3jax serve --max-images)'}", param=where)
      images.append(ImagePart(where, url))
      pieces.append(IMAGE_MARKER)
      previous_text = False
      continue
    if kind in _MEDIA_PARTS:
      raise RequestError(f"message {i}, content part {j}: {kind} parts are not supported (this server takes text "
                         f"{'and image_url ' if max_images > 0 else ''}parts)", param=where)
    if kind != "text" or not isinstance(part.get("text"), str):
      raise RequestError(f'message {i}, content part {j}: expected {{"type": "text", "text": str}}'
                         f'{" or an image_url part" if max_images > 0 else ""}, got {_show(part)}', param=where)
    pieces.append(("\n" if previous_text else "") + part["text"])
    previous_text = True
  return "".join(pieces)


def parse_chat(value: Any, max_images: int = 0, *, local_files: bool = False
               ) -> tuple[tuple[dict[str, str], ...], tuple[ImagePart, ...]]:
  """chat messages: a non-empty list of {"role": str, "content": str or parts} (other keys dropped) -> (the
  messages with string contents, the image_url parts in order; at most ``max_images``; ``local_files``: file:
  URLs allowed)."""
  if not isinstance(value, list) or not value:
    raise RequestError('"messages" must be a non-empty list of {"role", "content"} objects', param="messages")
  for i, m in enumerate(value):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list)):
      raise RequestError(f"message {i}: each message needs a string role and string content (or a list of text "
                         f"parts), got {_show(m)}", param=f"messages.[{i}]")
  images: list[ImagePart] = []
  messages = tuple({"role": m["role"], "content": parse_content(i, m["content"], images, max_images,
                                                                 local_files=local_files)}
                   for i, m in enumerate(value))
  return messages, tuple(images)


def url_scheme_error(url: str, *, files: bool) -> str | None:
  """Why ``url`` is not an image URL the server reads (None when its scheme is one: ``data:``, and ``file:`` when
  ``files``), checked without decoding anything (m3jax.image_urls decodes)."""
  scheme = url.split(":", 1)[0].lower() if ":" in url else ""
  if scheme == "data" or (scheme == "file" and files):
    return None
  if scheme in ("http", "https"):
    return ("image URLs are not fetched (this server does not reach the network); send the image inline as a "
            "data: URL (data:image/png;base64,...)")
  if scheme == "file":
    return ("file: URLs are not read (the server does not open its clients' paths); send the image inline as a "
            "data: URL (data:image/png;base64,...)")
  return (f"expected a data: URL (data:image/png;base64,...){' or a file: URL' if files else ''}, got "
          f"{url[:40]!r}")


def parse_messages(value: Any) -> tuple[dict[str, str], ...]:
  """chat messages of text only: a non-empty list of {"role": str, "content": str or text parts}."""
  return parse_chat(value)[0]


def parse_prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
  """completions prompt: a non-empty string, a non-empty list of token ids, or a non-empty list of either (at most
  MAX_PROMPTS) -> the prompts, each a string or a tuple of ids."""
  def one(p: Any) -> str | tuple[int, ...] | None:
    if isinstance(p, str) and p:
      return p
    if isinstance(p, list) and p and all(is_int(t) for t in p):
      return tuple(int(t) for t in p)
    return None

  single = one(value)
  if single is not None:
    return (single,)
  if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
    if len(value) > MAX_PROMPTS:
      raise RequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}", param="prompt")
    prompts = tuple(one(p) for p in value)
    bad = [i for i, p in enumerate(prompts) if p is None]
    if not bad:
      return prompts
    raise RequestError(f'prompt {bad[0]} must be a non-empty string or list of token ids, got {_show(value[bad[0]])}',
                       param="prompt")
  raise RequestError('"prompt" must be a non-empty string, a list of token ids, or a list of such prompts',
                     param="prompt")


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
  """An optional boolean field (null: the default)."""
  value = body.get(name)
  if value is None:
    return default
  if value not in (False, True) or not isinstance(value, bool):
    raise RequestError(f"{name} must be true or false, got {_show(value)}", param=name)
  return value


def check_model(body: Mapping[str, Any], limits: Limits) -> None:
  """``model``: absent / null, or the id the server serves (404 "model_not_found" otherwise, as OpenAI answers)."""
  model = body.get("model")
  if model is None or limits.model_name is None:
    return
  if model != limits.model_name:
    raise RequestError(f"The model {_show(model)} does not exist: this server serves {limits.model_name!r} "
                       "(GET /v1/models)", 404, param="model", code="model_not_found")


def parse_request(path: str, body: Any, limits: Limits) -> ParsedRequest:
  """A completions / chat body -> ParsedRequest; RequestError (400; 404 for an unknown model) naming the first
  field that is wrong. JSON null means the default for every optional field."""
  if path not in ROUTES:
    raise RequestError(f"no route {path[:80]}", 404, code="not_found")
  if not isinstance(body, dict):
    raise RequestError("the body must be a JSON object")
  check_model(body, limits)
  chat = path == CHAT
  sampling = parse_sampling(body)
  echo = _flag(body, "echo", False)
  if chat and echo:
    raise RequestError("echo=True is not supported for chat completions (only for /v1/completions)", param="echo")
  max_tokens = body.get("max_tokens")
  if max_tokens is None:
    max_tokens = body.get("max_completion_tokens")
  if max_tokens is None:
    max_tokens = min(256 if chat else 16, limits.max_length - 1)  # OpenAI's defaults, within the engine's length
  if not is_int(max_tokens) or max_tokens < (0 if echo else 1):
    raise RequestError(f"max_tokens must be a {'non-negative' if echo else 'positive'} integer, got "
                       f"{_show(max_tokens)}{'' if echo else ' (0 only with echo: true)'}", param="max_tokens")
  if max_tokens >= limits.max_length:
    raise RequestError(f"max_tokens ({max_tokens}) + a prompt of at least one token exceeds the engine's "
                       f"max_length ({limits.max_length})", param="max_tokens")
  n = body.get("n")
  n = 1 if n is None else n
  if not is_int(n) or not 1 <= n <= MAX_CHOICES:
    raise RequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {_show(n)}", param="n")
  for name, harmless in UNSUPPORTED.items():
    if name in body and not any(_same(body[name], h) for h in harmless):
      raise RequestError(f"{name}={_show(body[name])} is not supported by this server (it would be ignored)",
                         param=name)
  stream = _flag(body, "stream", False)
  options = body.get("stream_options")
  if options is not None and (not isinstance(options, dict) or not stream):
    raise RequestError("stream_options must be an object, and only with stream: true"
                       f", got {_show(options)}", param="stream_options")
  include_usage = _flag(options or {}, "include_usage", False)
  common = dict(chat=chat, max_tokens=int(max_tokens), sampling=sampling, stop=parse_stop(body.get("stop")), n=int(n),
                logprobs=parse_logprobs(body, chat, limits), stream=stream, echo=echo, include_usage=include_usage,
                skip_special_tokens=_flag(body, "skip_special_tokens", True))
  if chat:
    messages, images = parse_chat(body.get("messages"), limits.max_images)
    return ParsedRequest(messages=messages, images=images, **common)
  prompts = parse_prompts(body.get("prompt"))
  if len(prompts) * n > MAX_CHOICES:
    raise RequestError(f"{len(prompts)} prompts x n={n} choices: at most {MAX_CHOICES} per request", param="n")
  return ParsedRequest(prompts=prompts, **common)


def _same(value: Any, harmless: Any) -> bool:
  """value == harmless without bool / number confusion (False == 0 in Python; presence_penalty false is not 0)."""
  if isinstance(value, bool) != isinstance(harmless, bool):
    return False
  try:
    return bool(value == harmless)
  except Exception:  # pylint: disable=broad-except
    return False


def check_prompt(ids: tuple[int, ...] | list[int], max_tokens: int, limits: Limits, *,
                 with_images: bool = False) -> None:
  """The prompt's token ids (given, or from the tokenizer) against the engine: at least one, each in the
  vocabulary, no image / video placeholder (unless ``with_images``: the server wrote them for the request's
  image_url parts), and prompt + max_tokens within max_length."""
  if not ids:
    raise RequestError("the prompt has no tokens")
  bad = [t for t in ids if not 0 <= t < limits.vocab_size]
  if bad:
    raise RequestError(f"prompt ids outside [0, {limits.vocab_size}): {_show(bad[:8])}")
  placeholders = sorted(set(ids) & set(limits.placeholder_ids))
  if placeholders and not with_images:
    raise RequestError(f"the prompt holds image / video placeholder tokens {placeholders} with no image behind "
                       "them; remove them" + (" (send images as chat image_url parts)" if limits.max_images else
                                              " (this server takes no images)"))
  if len(ids) + max_tokens > limits.max_length:
    raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the engine's max_length "
                       f"({limits.max_length})")


def parse_tokenize(body: Any) -> tuple[str, bool]:
  """POST /tokenize: {"prompt": str, "add_special_tokens": bool (default false)} -> (text, add_special_tokens)."""
  if not isinstance(body, dict):
    raise RequestError("the body must be a JSON object")
  prompt = body.get("prompt")
  if not isinstance(prompt, str):
    raise RequestError(f'"prompt" must be a string, got {_show(prompt)}', param="prompt")
  return prompt, _flag(body, "add_special_tokens", False)


def parse_detokenize(body: Any, limits: Limits) -> tuple[int, ...]:
  """POST /detokenize: {"tokens": [ids]} -> the ids (each in the vocabulary)."""
  if not isinstance(body, dict):
    raise RequestError("the body must be a JSON object")
  tokens = body.get("tokens")
  if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
    raise RequestError(f'"tokens" must be a list of token ids, got {_show(tokens)}', param="tokens")
  bad = [t for t in tokens if not 0 <= t < limits.vocab_size]
  if bad:
    raise RequestError(f"token ids outside [0, {limits.vocab_size}): {_show(bad[:8])}", param="tokens")
  return tuple(int(t) for t in tokens)
