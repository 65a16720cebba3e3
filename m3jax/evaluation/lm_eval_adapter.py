"""An lm-evaluation-harness model over m3jax, in process: ``loglikelihood`` (multiple choice) and
``loglikelihood_rolling`` (perplexity) through ``m3jax.score_continuations``, ``generate_until`` through the
continuous-batching ``Engine`` with stop strings (m3jax.reply), greedy unless a task samples.

Registered with lm-eval as ``m3jax`` when imported; from the command line::

  python -m m3jax.evaluation run --model m3jax --model_args pretrained=CKPT,max_length=2048 --tasks ...

Tokenization is lm-eval's (``TemplateLM``: a context's trailing spaces move to the continuation, the continuation
is the whole encoding past the context's) over the checkpoint's tokenizer.json without special tokens, exactly as
lm-eval's ``local-completions`` with ``tokenizer_backend=remote`` tokenizes through ``m3jax serve``'s /tokenize;
an empty context (and each rolling window's first) is the checkpoint's bos token (else its eos), as there. So the
adapter and the server give the same numbers (tested, tests/test_lm_eval.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval fills its lazy model registry only while it is empty: fill it first)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model


@register_model("m3jax")
class M3JaxLM(TemplateLM):
  """lm-eval's LM over an m3jax checkpoint.

  Args:
    pretrained: checkpoint directory (loaded text only); or pass ``model`` (a loaded M3ForCausalLM) and
      ``checkpoint`` (its directory, for the tokenizer).
    max_length: as lm-eval's API models count it: scored sequences and prompt + generation hold at most
      max_length - 1 tokens (the API keeps one token free for the one the server generates after an echo), longer
      contexts cut from the left; so the adapter and ``local-completions`` with the same max_length score the same
      tokens and the same rolling windows.
    batch_size: sequences scored in one forward, and the engine's slots for generation.
    max_gen_toks: generate_until's budget when a task sets none.
    kernels, prefill_chunk, steps_per_call: as in ``m3jax serve``.
  """

  def __init__(self, pretrained: str | None = None, *, model: Any = None, checkpoint: str | None = None,
               max_length: int = 2048, batch_size: int | str = 8, max_gen_toks: int = 256,
               kernels: str | None = None, prefill_chunk: int | None = None, steps_per_call: int = 4,
               **unused: Any):
    super().__init__()
    import m3jax  # pylint: disable=g-import-not-at-top
    from m3jax import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top

    unknown = set(unused) - {"device", "max_batch_size", "dtype", "trust_remote_code"}
    if unknown:
      raise ValueError(f"m3jax lm-eval model: unknown model_args {sorted(unknown)}")
    checkpoint = checkpoint or pretrained
    if checkpoint is None:
      raise ValueError("m3jax lm-eval model: pass pretrained=CHECKPOINT_DIR (or model= and checkpoint=)")
    if str(batch_size).startswith("auto"):
      raise ValueError("m3jax lm-eval model: batch_size must be an integer (not auto)")
    self.checkpoint = os.fspath(checkpoint)
    self.model = model if model is not None else m3jax.load(self.checkpoint, kernels=kernels, text_only=True)
    limit = self.model.config.text.max_position_embeddings
    self._engine_length = min(int(max_length), limit)
    self.max_length = self._engine_length - 1  # as lm-eval's TemplateAPI: one token kept free
    self.batch_size = int(batch_size)
    self.max_gen_toks, self.prefill_chunk, self.steps_per_call = int(max_gen_toks), prefill_chunk, steps_per_call
    if self.batch_size < 1 or self.max_length < 2:
      raise ValueError(f"m3jax lm-eval model: batch_size >= 1 and max_length >= 3, got {batch_size}, {max_length}")
    self.tokenizer = tok_lib.load_tokenizer(self.checkpoint)
    self._stop_ids = tok_lib.stop_token_ids(self.checkpoint, self.model.config.text.eos_token_ids)
    if not self._stop_ids:
      raise ValueError(f"{self.checkpoint}: no eos token id (config.json / generation_config.json)")
    self._bos_id = self._special_id("bos_token")
    self._engine = None

  def _special_id(self, name: str) -> int | None:
    """tokenizer_config.json's ``name`` token's id (None if absent)."""
    try:
      with open(os.path.join(self.checkpoint, "tokenizer_config.json"), encoding="utf-8") as f:
        value = json.load(f).get(name)
    except (OSError, ValueError, AttributeError):
      return None
    value = value.get("content") if isinstance(value, dict) else value
    return self.tokenizer.token_to_id(value) if isinstance(value, str) else None

  @property
  def eot_token_id(self) -> int:
    return int(self._stop_ids[0])

  @property
  def prefix_token_id(self) -> int:
    return self.eot_token_id if self._bos_id is None else int(self._bos_id)

  @property
  def tokenizer_name(self) -> str:
    return self.checkpoint

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                 **kwargs: Any) -> list[int]:
    ids = self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids
    return ids[-left_truncate_len:] if left_truncate_len else ids

  def tok_decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=True)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
    """((context, continuation) | None, context ids, continuation ids) -> (log p(continuation | context), greedy),
    in batches of batch_size (a short last batch padded with copies, so every forward has the same shape)."""
    from m3jax.scoring import score_continuations  # pylint: disable=g-import-not-at-top

    pairs = []
    for key, context, continuation in requests:
      if not continuation:
        raise ValueError(f"lm-eval request {key!r}: an empty continuation has no log-likelihood")
      whole = (list(context) + list(continuation))[-self.max_length:]  # cut from the left, as lm-eval's API models
      start = len(whole) - len(continuation)
      if start < 1:
        raise ValueError(f"lm-eval request {key!r}: the continuation ({len(continuation)} tokens) leaves no "
                         f"context within max_length ({self.max_length})")
      pairs.append((whole[:start], whole[start:]))
    out: list[tuple[float, bool]] = []
    for first in range(0, len(pairs), self.batch_size):
      batch = pairs[first:first + self.batch_size]
      padded = batch + [batch[0]] * (self.batch_size - len(batch))
      scores = score_continuations(self.model, [p for p, _ in padded], [c for _, c in padded],
                                   prefill_chunk=self.prefill_chunk)
      out += [(float(scores.logprob[i]), bool(scores.greedy[i])) for i in range(len(batch))]
    for (key, _, _), answer in zip(requests, out):
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, answer)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each text's log-likelihood over windows of max_length tokens, the first conditioned on the prefix token
    (lm-eval's rolling windows)."""
    totals = []
    for (text,) in [r.args for r in requests]:
      windows = [(None,) + lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length - 1,
          context_len=1)]  # windows of max_length tokens (context + predicted), as TemplateAPI makes them
      total = sum(x[0] for x in self._loglikelihood_tokens(windows))
      self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
      totals.append(total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Continues each context until one of its ``until`` strings (left out of the text) or its max_gen_toks;
    greedy unless its gen_kwargs sample (do_sample / temperature > 0). Special tokens are left out of the text."""
    from m3jax.engine import Engine  # pylint: disable=g-import-not-at-top
    from m3jax.reply import Reply  # pylint: disable=g-import-not-at-top

    if self._engine is None:
      self._engine = Engine(self.model, slots=self.batch_size, max_length=self._engine_length,
                            eos_token_ids=self._stop_ids, steps_per_call=self.steps_per_call,
                            prefill_chunk=self.prefill_chunk)
    engine = self._engine
    replies = []
    for i, (context, gen_kwargs) in enumerate(r.args for r in requests):
      kwargs = dict(gen_kwargs or {})
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else [u for u in until if u]
      budget = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
      sample = bool(kwargs.pop("do_sample", False)) or float(kwargs.get("temperature") or 0) > 0
      sampling = {"temperature": float(kwargs.get("temperature") or 1.0)} if sample else {"temperature": 0.0}
      if sample and kwargs.get("top_p") is not None:
        sampling["top_p"] = float(kwargs["top_p"])
      if sample and kwargs.get("top_k") is not None:
        sampling["top_k"] = int(kwargs["top_k"])
      if not 0 < budget < self.max_length:
        raise ValueError(f"max_gen_toks ({budget}) must be in [1, max_length - 1 = {self.max_length})")
      ids = self.tok_encode(context)[-(self.max_length - budget):]  # as TemplateAPI cuts contexts
      engine.submit(ids, max_new_tokens=budget, request_id=i, **sampling)
      replies.append(Reply(self.tokenizer, until, skip_special_tokens=True))
    try:
      for update in engine.stream():
        reply = replies[update.request_id]
        if reply.finish_reason is not None:
          continue  # a request its stop string ended: the engine confirming the cancel
        if update.completion is not None and update.completion.finish_reason == "error":
          raise RuntimeError(f"generation failed: {update.completion.error}")
        reply.add(update)
        if reply.cancel:
          engine.cancel(update.request_id)
    except BaseException:
      engine.reset()
      raise
    texts = [r.text for r in replies]
    for request, text in zip(requests, texts):
      self.cache_hook.add_partial("generate_until", request.args, text)
    return texts
