"""``m3jax generate``: stream a completion from a checkpoint; throughput figures on stderr."""

from __future__ import annotations

import argparse
import sys
import time

from m3jax.commands import options
from m3jax.detokenize import IncrementalText
from m3jax.parallel import cli as parallel_cli
from m3jax.token_ids import parse_token_ids


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("generate", help="generate text from a checkpoint (streams to stdout)")
  p.add_argument("checkpoint", help="checkpoint directory (safetensors or converted)")
  add_generation_arguments(p)
  parallel_cli.add_mesh_arguments(p)
  p.set_defaults(func=run)


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
  group = p.add_mutually_exclusive_group()
  group.add_argument("--prompt", help="prompt text (tokenised with the checkpoint's tokenizer.json)")
  group.add_argument("--prompt-ids", help="comma-separated prompt token ids")
  group.add_argument("--prompt-file", help="a text file holding the prompt (long prompts; as --prompt otherwise)")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--seed", type=int, default=0)
  options.add_eos_argument(p)
  p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
  p.add_argument("--image", action="append", default=[], metavar="PATH",
                 help="an image for the prompt (repeatable); placed at the prompt's image markers, or before the "
                      "prompt text when it has none")
  p.add_argument("--kernels", default=None, help="reference | pallas | auto (default $M3JAX_KERNELS or auto)")
  p.add_argument("--steps-per-call", type=int, default=4,
                 help="decode steps per device call (default 4): tokens stream in groups of this size, and the "
                      "per-call host cost (milliseconds at full size) is paid once per group; 1 = token by token. "
                      "With --speculative: verification rounds per call")
  p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                 help="prefill the prompt in chunks of N tokens (a power of two >= 16), bounding the prefill's "
                      "activation memory; default: one forward")
  p.add_argument("--speculative", type=int, default=0, metavar="K",
                 help="speculative decoding with the checkpoint's MTP module, K draft tokens per round (loads it "
                      "with with_mtp); 0 = off (default)")


def run(args: argparse.Namespace) -> int:
  import m3jax  # pylint: disable=g-import-not-at-top
  from m3jax import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  from m3jax.generate import generate_stream  # pylint: disable=g-import-not-at-top

  if args.prompt_file is not None:
    with open(args.prompt_file, encoding="utf-8") as f:
      args.prompt = f.read()
    if not args.prompt.strip():
      raise ValueError(f"{args.prompt_file}: empty prompt")
  if args.prompt is None and args.prompt_ids is None:
    raise ValueError("give --prompt TEXT, --prompt-file PATH or --prompt-ids 1,2,3")
  if args.speculative < 0:
    raise ValueError(f"--speculative must be >= 0, got {args.speculative}")
  options.check_sampling_args(args)
  if args.prompt_ids is not None:
    parse_token_ids(args.prompt_ids)  # a malformed list fails before the model loads
  if hasattr(args, "mesh"):
    parallel_cli.init_distributed(args)
  model = m3jax.load(args.checkpoint, kernels=args.kernels, with_mtp=args.speculative > 0,
                     **(parallel_cli.load_kwargs(args) if hasattr(args, "mesh") else {}))
  tokenizer = None
  prompt_embeds = None
  if args.prompt is not None:
    tokenizer = tok_lib.load_tokenizer(args.checkpoint)
    user = args.prompt
    if args.image:
      from m3jax.vision import IMAGE_MARKER  # pylint: disable=g-import-not-at-top
      if IMAGE_MARKER not in user:
        user = IMAGE_MARKER * len(args.image) + user
    text = tok_lib.render_chat(args.checkpoint, user) if args.chat else user
    if args.image:
      ids, prompt_embeds = _multimodal_prompt(model, tokenizer, text, args.image)
    else:
      ids = tokenizer.encode(text, add_special_tokens=False).ids
  else:
    if args.chat or args.image:
      raise ValueError("--chat and --image need --prompt TEXT")
    ids = parse_token_ids(args.prompt_ids)
    try:
      tokenizer = tok_lib.load_tokenizer(args.checkpoint)
    except FileNotFoundError:
      tokenizer = None
  eos = options.stop_ids(args, args.checkpoint, model.config.text.eos_token_ids, model.config.text.vocab_size)
  if args.speculative:
    return _run_speculative(args, model, ids, eos, tokenizer, prompt_embeds)
  timings: dict[str, float] = {}
  start = time.perf_counter()
  first_token_at = None
  printer = _TokenPrinter(tokenizer)
  for step_tokens in generate_stream(model, [ids], max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                     seed=args.seed, eos_token_ids=eos, timings=timings,
                                     prompt_embeds=prompt_embeds, steps_per_call=args.steps_per_call,
                                     prefill_chunk=args.prefill_chunk):
    first_token_at = first_token_at or time.perf_counter()
    if int(step_tokens[0]) < 0:
      break
    printer.write([int(step_tokens[0])])
  printer.finish()
  end = time.perf_counter()
  sys.stdout.write("\n")
  sys.stdout.flush()
  prefill_s = timings.get("prefill_s", float("nan"))
  ttft = (first_token_at or end) - start
  decode_tokens = max(len(printer.ids) - 1, 0)
  decode_s = end - (first_token_at or end)
  print(f"[m3jax] prompt {len(ids)} tokens, generated {len(printer.ids)}; time to first token {ttft:.3f}s; "
        f"prefill {len(ids) / prefill_s:.1f} tok/s ({prefill_s:.3f}s); decode "
        f"{decode_tokens / decode_s if decode_s > 0 else float('nan'):.1f} tok/s "
        f"(first call includes compilation)", file=sys.stderr)
  return 0


def _run_speculative(args: argparse.Namespace, model, ids: list[int], eos: tuple[int, ...], tokenizer,
                     prompt_embeds) -> int:
  """Streams a completion with MTP speculative decoding; prints the acceptance figures on stderr."""
  from m3jax.speculative import generate_speculative_stream  # pylint: disable=g-import-not-at-top

  stats: dict = {}
  start = time.perf_counter()
  first_token_at = None
  printer = _TokenPrinter(tokenizer)
  for chunk in generate_speculative_stream(model, [ids], max_new_tokens=args.max_new_tokens,
                                           num_draft_tokens=args.speculative, temperature=args.temperature,
                                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_ids=eos,
                                           prompt_embeds=prompt_embeds, rounds_per_call=args.steps_per_call,
                                           stats=stats, prefill_chunk=args.prefill_chunk):
    first_token_at = first_token_at or time.perf_counter()
    printer.write(chunk[0].tolist())
  printer.finish()
  end = time.perf_counter()
  sys.stdout.write("\n")
  sys.stdout.flush()
  rounds, accepted = int(stats["rounds"][0]), int(stats["accepted"][0])
  decode_s = end - first_token_at
  print(f"[m3jax] prompt {len(ids)} tokens, generated {len(printer.ids)} in {rounds} verification rounds of "
        f"{args.speculative} drafts: acceptance {accepted / max(rounds * args.speculative, 1):.2f}, "
        f"{(len(printer.ids) - 1) / max(rounds, 1):.2f} tokens per target forward; time to first token "
        f"{first_token_at - start:.3f}s; decode {(len(printer.ids) - 1) / decode_s if decode_s > 0 else float('nan'):.1f} "
        "tok/s (first call includes compilation)", file=sys.stderr)
  return 0


class _TokenPrinter:
  """Streams generated ids to stdout: as text (m3jax.detokenize: a character spanning several tokens prints once
  complete), or as ids without a tokenizer. ``finish()`` prints what was held back; ``printed`` is the text."""

  def __init__(self, tokenizer):
    self.tokenizer, self.ids, self.printed = tokenizer, [], ""
    self._text = None if tokenizer is None else IncrementalText(tokenizer)

  def write(self, tokens: list[int]) -> None:
    self.ids.extend(tokens)
    if self._text is None:
      sys.stdout.write("".join(f"{t} " for t in tokens))
    else:
      self._show(self._text.add(tokens))
    sys.stdout.flush()

  def finish(self) -> None:
    if self._text is not None:
      self._show(self._text.finish())
      sys.stdout.flush()

  def _show(self, delta: str) -> None:
    sys.stdout.write(delta)
    self.printed += delta


def _multimodal_prompt(model, tokenizer, text: str, images: list[str]):
  """Prompt text with image markers + image paths -> (token ids, prompt embeddings [1, S, H])."""
  from m3jax.vision import build_multimodal_inputs  # pylint: disable=g-import-not-at-top

  if getattr(model, "vision", None) is None:
    raise ValueError("--image needs a checkpoint with a vision tower (config.json has no vision_config, or it was "
                     "loaded text-only)")
  inputs = build_multimodal_inputs(text, tokenizer, images=images, image_token_id=model.config.image_token_id)
  embeds = model.embed_multimodal(inputs.input_ids, **inputs.pixel_kwargs())
  print(f"[m3jax] {len(images)} image(s): grids {inputs.image_grid_thw.tolist()}", file=sys.stderr)
  return inputs.input_ids[0].tolist(), embeds
