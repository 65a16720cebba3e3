"""The OpenAI request and reply schemas of ``m3jax serve`` as pydantic models: what ``/openapi.json`` documents
(m3jax.serving_app) and what every request body is validated against after m3jax.request_validation's checks.

The request models state the JSON types and the ranges that hold for any engine (strict JSON types: no string
for a number, no 0 / 1 for a boolean; unknown fields allowed, as OpenAI clients send them); the limits of the
engine being served (its vocabulary, ``--max-length``, ``--max-logprobs``, ``--model-name``) and the fields that
would change the result but are not implemented are checked by m3jax.request_validation, whose messages the
server answers with. The reply models are documentation only: replies are built as dicts (m3jax.serving_replies).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from m3jax.request_validation import FLOAT32_MAX, INT32_MAX, MAX_CHOICES, MAX_PROMPTS, MAX_STOP_CHARS, MAX_STOP_STRINGS

__all__ = ["REQUEST_MODELS", "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "TokenizeRequest",
           "validation_error"]

TokenId = Annotated[int, Field(description="a token id in [0, vocab_size)")]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _Request(BaseModel):
  model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Request):
  include_usage: bool | None = Field(None, description="a last chunk with the usage and no choices")


class _Sampling(_Request):
  """The fields completions and chat share (JSON null: the default)."""

  model: str | None = Field(None, description="the served model's id (GET /v1/models); another gets a 404")
  max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = Field(
      None, description="tokens to generate (default 16 for completions, 256 for chat); prompt + max_tokens must "
                        "fit the engine's max_length; 0 only with echo")
  temperature: Annotated[float, Field(ge=0, le=FLOAT32_MAX)] | None = None
  top_p: Annotated[float, Field(gt=0, le=1)] | None = None
  top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = Field(None, description="-1 or 0: no cut")
  seed: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
  n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = Field(None, description="choices per prompt")
  stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
  stream: bool | None = None
  stream_options: StreamOptions | None = Field(None, description="only with stream: true")
  skip_special_tokens: bool | None = Field(None, description="default true: special tokens stay out of the text")
  user: str | None = None


class CompletionRequest(_Sampling):
  """POST /v1/completions."""

  prompt: Text | TokenIds | Annotated[list[Text | TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
      description="a text, a list of token ids, or a list of either (each its own choice)")
  echo: bool | None = Field(None, description="each choice starts with its prompt (and its log-probabilities)")
  logprobs: Annotated[int, Field(ge=0)] | None = Field(
      None, description="log-probabilities of the chosen token and the k most likely (k <= --max-logprobs)")


class TextPart(_Request):
  type: Literal["text"]
  text: str


class ImageUrl(_Request):
  url: str = Field(description="a data: URL with a base64 image (data:image/png;base64,...: PNG, JPEG, WebP, GIF, "
                               "BMP, TIFF); http(s):// and file: URLs are not fetched (400)")
  detail: str | None = Field(None, description="ignored (every image is resized to at most 672 x 672 pixels)")


class ImagePart(_Request):
  """An image, where the chat template puts the image's placeholder tokens (only on a server with the vision
  tower: a text-only one answers 400)."""

  type: Literal["image_url"]
  image_url: ImageUrl


class ChatMessage(_Request):
  role: str = Field(description="one the chat template takes (OpenAI's: system, user, assistant, ...)")
  content: str | Annotated[list[Annotated[TextPart | ImagePart, Field(discriminator="type")]], Field(min_length=1)]
  name: str | None = None


class ChatCompletionRequest(_Sampling):
  """POST /v1/chat/completions."""

  messages: Annotated[list[ChatMessage], Field(min_length=1)]
  max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = Field(
      None, description="max_tokens' newer name")
  logprobs: bool | None = None
  top_logprobs: Annotated[int, Field(ge=0)] | None = Field(None, description="needs logprobs: true")


class TokenizeRequest(_Request):
  """POST /tokenize."""

  prompt: str
  add_special_tokens: bool | None = Field(None, description="default false")


class DetokenizeRequest(_Request):
  """POST /detokenize."""

  tokens: list[TokenId]


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


# Replies (documentation only).


class ErrorDetail(BaseModel):
  message: str
  type: Literal["invalid_request_error", "server_error"]
  param: str | None
  code: str | None


class ErrorResponse(BaseModel):
  """OpenAI's error shape (every 4xx and 5xx)."""

  error: ErrorDetail


class Unavailable(ErrorResponse):
  """503: the engine cannot serve, or (``"status": "loading"``, every route) the model is still loading."""

  status: Literal["loading"] | None = None


class PromptTokensDetails(BaseModel):
  cached_tokens: int = Field(description="prompt tokens read from the prefix cache (whole pages) instead of "
                                         "prefilled; a prompt with n choices counts its fewest")


class Usage(BaseModel):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int
  prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
  tokens: list[str]
  token_logprobs: list[float | None]
  top_logprobs: list[dict[str, float] | None] | None
  text_offset: list[int]


class CompletionChoice(BaseModel):
  index: int
  text: str
  logprobs: CompletionLogprobs | None
  finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
  """A whole completions reply (``stream: true``: text/event-stream chunks of this shape, ``usage`` null until
  the last chunk with ``stream_options.include_usage``, then ``data: [DONE]``)."""

  id: str
  object: Literal["text_completion"]
  created: int
  model: str
  choices: list[CompletionChoice]
  usage: Usage | None = None


class TokenLogprob(BaseModel):
  token: str
  logprob: float
  bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
  top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
  content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
  role: Literal["assistant"]
  content: str


class ChatChoice(BaseModel):
  index: int
  message: AssistantMessage
  logprobs: ChatLogprobs | None
  finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
  """A whole chat reply (``stream: true``: ``chat.completion.chunk`` events with ``delta`` for ``message``)."""

  id: str
  object: Literal["chat.completion"]
  created: int
  model: str
  choices: list[ChatChoice]
  usage: Usage


class ModelCard(BaseModel):
  id: str
  object: Literal["model"]
  created: int
  owned_by: str
  max_model_len: int


class ModelList(BaseModel):
  object: Literal["list"]
  data: list[ModelCard]


class Health(BaseModel):
  """``{"status": "ok"}``; 503 ``{"status": "error", "message": why}`` once the engine cannot serve."""

  status: Literal["ok", "error"]
  message: str | None = None


class Tokens(BaseModel):
  tokens: list[int]
  count: int
  max_model_len: int


class Detokenized(BaseModel):
  prompt: str


class TokenizerInfo(BaseModel):
  eos_token: str | None
  bos_token: str | None
  pad_token: str | None
  chat_template: str | None
  model_max_length: int
  tokenizer_class: str


def validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
  """pydantic's first error -> (a one-line message naming the field, the field as OpenAI's ``param``:
  "messages.[0].content")."""
  first = errors[0]
  loc = []
  for part in first.get("loc", ()):  # a discriminated union names the tag before the field ("image_url", "image_url")
    if not _is_union_tag(part) and not (loc and isinstance(part, str) and loc[-1] == part):
      loc.append(part)
  param = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc) or None
  return (f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid body")), param


def _is_union_tag(part: Any) -> bool:
  """pydantic names the union member it tried in ``loc`` ("str", "list[int]", "function-after[...]"): not a
  field of the request."""
  return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or "-" in part)
