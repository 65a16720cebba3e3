"""``m3jax batch``: offline generation for a JSONL file of prompts with continuous batching (m3jax.engine), one
JSONL line out per prompt.

Input lines are objects with "prompt" (text, tokenised with the checkpoint's tokenizer.json; ``--chat`` wraps it in
the chat template), "prompt_ids" (a list of token ids) or "messages" (a chat, as OpenAI's chat completions take it,
rendered with the chat template: contents as strings or parts, text and image_url parts; an image is a data: URL
with a base64 image, or a file: URL of a local image, ``file:relative/x.png`` relative to the input file's
directory or ``file:///abs/x.png``, at most MAX_IMAGES per line; lines with images load the vision tower and
prefill the images' embeddings, m3jax.image_urls), and optionally "id" (copied to the output), "stop" (a
string or a list of strings: the completion ends before the first one, and its slot is freed at once), and the
line's own "max_tokens", "temperature", "top_p", "top_k" and "seed" (checked as the server checks them; absent or
null: the command's --max-new-tokens / --temperature / ... / a seed derived from --seed and the line). Output
lines, in input order: {"id", "index", "prompt_tokens", "completion_ids", "completion" (text, with a tokenizer),
"finish_reason": "stop" | "length"}, and with --logprobs "completion_logprobs" (one per completion id); completion_ids end with the stop token, or with the token that completed a
stop string (the completion text ends before the stop string).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from m3jax.commands import CommandFailed, options
from m3jax.parallel import cli as parallel_cli
from m3jax.token_ids import is_token_id

MAX_IMAGES = 64  # image_url parts per "messages" line


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("batch", help="generate for a JSONL file of prompts with continuous batching (JSONL out)")
  p.add_argument("checkpoint", help="checkpoint directory (safetensors or converted)")
  p.add_argument("--input", required=True,
                 help='JSONL: {"prompt": text}, {"prompt_ids": [ids]} or {"messages": [chat messages]} (OpenAI\'s, '
                      'with image_url parts: data: URLs or file: paths relative to this file), optional "id", '
                      '"stop", and per-line "max_tokens", "temperature", "top_p", "top_k", "seed" (default: the '
                      'flags below)')
  p.add_argument("--output", required=True, help="JSONL written in input order (one line per prompt)")
  p.add_argument("--batch-size", type=int, default=8,
                 help="sequences decoded together (default 8); each slot takes the next prompt as soon as its own "
                      "completion stops (continuous batching)")
  p.add_argument("--steps-per-call", type=int, default=4, help="decode steps per device call (default 4)")
  p.add_argument("--max-new-tokens", type=int, default=64, help='tokens per completion, for lines without '
                 '"max_tokens" (default 64)')
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--seed", type=int, default=0,
                 help="sampling seed; prompt i samples with a seed derived from it and i (independent of the schedule)")
  p.add_argument("--logprobs", action="store_true",
                 help='also write "completion_logprobs": each completion token\'s log-probability (raw logits)')
  p.add_argument("--chat", action="store_true", help="wrap text prompts in the checkpoint's chat template")
  options.add_eos_argument(p)
  p.add_argument("--prefill-chunk", type=int, default=None, metavar="N", help="as in m3jax generate")
  p.add_argument("--kernels", default=None, help="reference | pallas | auto (default $M3JAX_KERNELS or auto)")
  parallel_cli.add_mesh_arguments(p)
  p.set_defaults(func=run)


def read_requests(path: str) -> list[dict[str, Any]]:
  """The JSONL requests, each checked: an object with a non-empty "prompt" string, "prompt_ids" list or
  "messages" chat, and its optional fields; "sampling" holds the line's own Engine.submit temperature / top_k /
  top_p / seed; a "messages" line gets "chat" (the messages with string contents, an image marker per image part)
  and "images" (its ImageParts, their URLs' schemes checked)."""
  from m3jax.request_validation import (RequestError, is_int, parse_chat,  # pylint: disable=g-import-not-at-top
                                        parse_sampling)

  requests = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        req = json.loads(line)
      except json.JSONDecodeError as e:  # the decoder's position, as FILE:LINE:COLUMN
        raise ValueError(f"{path}:{number}:{e.colno}: not JSON ({e.msg} at line {number} column {e.colno})") from None
      if not isinstance(req, dict) or sum(k in req for k in ("prompt", "prompt_ids", "messages")) != 1:
        raise ValueError(f'{path}:{number}: expected an object with one of "prompt" (text), "prompt_ids" (ids) and '
                         '"messages" (a chat)')
      if "messages" in req:
        try:
          req["chat"], req["images"] = parse_chat(req["messages"], MAX_IMAGES, local_files=True)
        except RequestError as e:
          raise ValueError(f"{path}:{number}: {e}") from None
      if "prompt" in req and (not isinstance(req["prompt"], str) or not req["prompt"]):
        raise ValueError(f'{path}:{number}: "prompt" must be a non-empty string')
      ids = req.get("prompt_ids")
      if ids is not None and (not isinstance(ids, list) or not ids or not all(is_token_id(t) for t in ids)):
        raise ValueError(f'{path}:{number}: "prompt_ids" must be a non-empty list of ints')
      stop = req.get("stop", [])
      stop = [stop] if isinstance(stop, str) else stop
      if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise ValueError(f'{path}:{number}: "stop" must be a non-empty string or a list of them, got {req["stop"]!r}')
      req["stop"] = stop
      try:
        req["sampling"] = parse_sampling(req)
      except RequestError as e:
        raise ValueError(f"{path}:{number}: {e}") from None
      max_tokens = req.get("max_tokens")
      if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise ValueError(f'{path}:{number}: "max_tokens" must be a positive integer, got {max_tokens!r:.40}')
      requests.append({**req, "line": number})
  if not requests:
    raise ValueError(f"{path}: no requests")
  return requests


def _updates(engine):
  """engine.stream(), with an engine that stopped serving reported as a CommandFailed."""
  from m3jax.engine import EngineBroken  # pylint: disable=g-import-not-at-top

  try:
    yield from engine.stream()
  except EngineBroken as e:
    raise CommandFailed(f"the engine stopped: {e}") from None


def run(args: argparse.Namespace) -> int:
  import m3jax  # pylint: disable=g-import-not-at-top
  from m3jax import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  from m3jax.engine import Engine  # pylint: disable=g-import-not-at-top
  from m3jax.config import M3Config  # pylint: disable=g-import-not-at-top
  from m3jax.reply import Reply  # pylint: disable=g-import-not-at-top
  from m3jax.request_validation import RequestError  # pylint: disable=g-import-not-at-top
  from m3jax.token_ids import check_no_placeholders  # pylint: disable=g-import-not-at-top

  options.check_sampling_args(args)
  parallel_cli.init_distributed(args)
  requests = read_requests(args.input)
  needs_text = any("prompt" in r or "messages" in r for r in requests)
  with_images = [r for r in requests if r.get("images")]
  try:
    tokenizer = tok_lib.load_tokenizer(args.checkpoint)
  except FileNotFoundError:
    if needs_text:
      raise
    tokenizer = None
  if args.chat and not any("prompt" in r for r in requests):
    raise ValueError('--chat needs text prompts ("messages" lines are rendered with the chat template anyway)')
  if tokenizer is None and any(r["stop"] for r in requests):
    raise ValueError(f'{args.input}: "stop" strings need the checkpoint\'s tokenizer.json')
  # The vision tower only when a line has images: text batches load (and run) what they did before.
  model = m3jax.load(args.checkpoint, kernels=args.kernels, text_only=not with_images,
                     **parallel_cli.load_kwargs(args))
  if with_images and getattr(model, "vision", None) is None:
    raise ValueError(f"{args.input}:{with_images[0]['line']}: image parts need a checkpoint with a vision tower "
                     "(its config.json has no vision_config)")
  vocab = model.config.text.vocab_size
  placeholders = M3Config.from_file(args.checkpoint).placeholder_ids  # only image parts bring their images
  prompts, embeds = [], []
  for r in requests:
    where = f"{args.input}:{r['line']}"
    prompt_embeds = None
    if "messages" in r:
      try:
        text = tok_lib.render_messages(args.checkpoint, [dict(m) for m in r["chat"]])
        if r["images"]:
          ids, prompt_embeds = _multimodal_prompt(model, tokenizer, text, r["images"], os.path.dirname(args.input))
        else:
          ids = tokenizer.encode(text, add_special_tokens=False).ids
      except (RequestError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    elif "prompt" in r:
      text = tok_lib.render_chat(args.checkpoint, r["prompt"]) if args.chat else r["prompt"]
      ids = tokenizer.encode(text, add_special_tokens=False).ids
    else:
      ids = r["prompt_ids"]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad or not ids:
      raise ValueError(f"{where}: " + (f"token ids outside [0, {vocab}): {bad[:5]}" if bad
                                       else "the prompt has no tokens"))
    if prompt_embeds is None:
      check_no_placeholders(ids, placeholders, f"{where}: the prompt ids")
    prompts.append(ids)
    embeds.append(prompt_embeds)
  eos = options.stop_ids(args, args.checkpoint, model.config.text.eos_token_ids, vocab)
  budgets = [args.max_new_tokens if r.get("max_tokens") is None else int(r["max_tokens"]) for r in requests]
  # Continuous batching: --batch-size slots decode together, each refilled as soon as its request stops.
  engine = Engine(model, slots=args.batch_size, max_length=max(len(p) + n for p, n in zip(prompts, budgets)),
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  eos_token_ids=eos, steps_per_call=args.steps_per_call, prefill_chunk=args.prefill_chunk,
                  logprobs=args.logprobs)
  replies = [Reply(tokenizer, r["stop"]) for r in requests]
  for i, (ids, r) in enumerate(zip(prompts, requests)):
    try:
      engine.submit(ids, max_new_tokens=budgets[i], request_id=i, prompt_embeds=embeds[i], **r["sampling"])
    except ValueError as e:
      raise ValueError(f"{args.input}:{r['line']}: {str(e).replace(f'request {i!r}: ', '')}") from None
  results: dict[int, dict[str, Any]] = {}
  start = time.perf_counter()
  failed: dict[int, str] = {}
  for update in _updates(engine):
    i = update.request_id
    reply = replies[i]
    if reply.finish_reason is not None:
      continue  # a request its stop string ended: this is the engine confirming the cancel
    if update.completion is not None and update.completion.finish_reason == "error":
      failed[i] = update.completion.error or "unknown error"  # this prompt alone; the others go on
      results[i] = {"id": requests[i].get("id"), "index": i, "prompt_tokens": len(prompts[i]),
                    "finish_reason": "error", "error": failed[i]}
      continue
    reply.add(update)
    if reply.cancel:
      engine.cancel(i)
    if reply.finish_reason is None:
      continue
    results[i] = {"id": requests[i].get("id"), "index": i, "prompt_tokens": len(prompts[i]),
                  "completion_ids": reply.tokens, "finish_reason": reply.finish_reason}
    if reply.text is not None:
      results[i]["completion"] = reply.text
    if args.logprobs:
      results[i]["completion_logprobs"] = reply.logprobs[:len(reply.tokens)]
    if len(results) % max(1, len(prompts) // 10) == 0:
      print(f"[m3jax] {len(results)} / {len(prompts)} prompts", file=sys.stderr)
  generated = sum(len(r.tokens) for r in replies)
  seconds = time.perf_counter() - start
  with open(args.output, "w", encoding="utf-8") as f:
    for i in range(len(prompts)):
      f.write(json.dumps(results[i], ensure_ascii=False) + "\n")
  print(f"[m3jax] {len(prompts)} prompts, {generated} tokens generated in {seconds:.2f}s "
        f"({generated / seconds:.1f} tok/s, compilation included); wrote {args.output}", file=sys.stderr)
  if failed:
    first = min(failed)
    raise CommandFailed(f"{len(failed)} of {len(prompts)} prompts failed (their lines in {args.output} say why; "
                       f"the first, {args.input}:{requests[first]['line']}: {failed[first]})")
  return 0


def _multimodal_prompt(model, tokenizer, text: str, images, base_dir: str):
  """A rendered chat with one image marker per image part -> (its ids, its embeddings [1, S, H]): each image
  decoded (m3jax.image_urls; file: URLs relative to ``base_dir``), the markers expanded, then the vision tower."""
  from m3jax.image_urls import decode_image_url  # pylint: disable=g-import-not-at-top
  from m3jax.vision import IMAGE_MARKER, build_multimodal_inputs  # pylint: disable=g-import-not-at-top

  if text.count(IMAGE_MARKER) != len(images):
    raise ValueError(f"the rendered messages hold {text.count(IMAGE_MARKER)} image markers {IMAGE_MARKER!r} but "
                     f"the line has {len(images)} image_url parts; send images as image_url parts only")
  pixels = [decode_image_url(part.url, part.where, base_dir=base_dir or ".") for part in images]
  inputs = build_multimodal_inputs(text, tokenizer, images=pixels, image_token_id=model.config.image_token_id)
  return inputs.input_ids[0].tolist(), model.embed_multimodal(inputs.input_ids, **inputs.pixel_kwargs())
