"""``m3jax chat``: a multi-turn conversation on stdin / stdout that keeps its caches between turns."""

from __future__ import annotations

import argparse
import os
import sys
import time

from m3jax.commands import options
from m3jax.commands.generate import _multimodal_prompt, _TokenPrinter
from m3jax.parallel import cli as parallel_cli

_HELP = ("one user turn per line; /image PATH attaches an image to the next turn, /reset starts over, /exit (or end "
         "of input) quits")


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("chat", help="chat with a checkpoint, keeping the caches between turns",
                     description=f"Chat on stdin / stdout ({_HELP}). Each turn renders the whole conversation with "
                                 "the checkpoint's chat template and prefills only what the caches do not already "
                                 "hold.")
  p.add_argument("checkpoint", help="checkpoint directory with tokenizer.json and a chat template")
  p.add_argument("--system", default=None, help="a system message opening the conversation")
  p.add_argument("--max-new-tokens", type=int, default=256, help="per reply (default 256)")
  p.add_argument("--max-length", type=int, default=None,
                 help="tokens the whole conversation may hold (default: 8192, or the model's limit if lower)")
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--seed", type=int, default=0)
  options.add_eos_argument(p)
  p.add_argument("--kernels", default=None, help="reference | pallas | auto (default $M3JAX_KERNELS or auto)")
  p.add_argument("--steps-per-call", type=int, default=4, help="decode steps per device call (default 4)")
  p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                 help="prefill each turn's new tokens in chunks of N (a power of two >= 16)")
  parallel_cli.add_mesh_arguments(p, distributed=False)
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  import m3jax  # pylint: disable=g-import-not-at-top
  from m3jax import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  from m3jax.conversation import Conversation  # pylint: disable=g-import-not-at-top

  options.check_sampling_args(args)
  tokenizer = tok_lib.load_tokenizer(args.checkpoint)
  tok_lib.render_messages(args.checkpoint, [{"role": "user", "content": ""}])  # fails early without a template
  model = m3jax.load(args.checkpoint, kernels=args.kernels, **parallel_cli.load_kwargs(args))
  limit = model.config.text.max_position_embeddings
  max_length = args.max_length if args.max_length is not None else min(8192, limit)
  eos = options.stop_ids(args, args.checkpoint, model.config.text.eos_token_ids, model.config.text.vocab_size)
  conv = Conversation(model, max_length=max_length, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, seed=args.seed, eos_token_ids=eos, steps_per_call=args.steps_per_call,
                      prefill_chunk=args.prefill_chunk)
  opening = [] if args.system is None else [{"role": "system", "content": args.system}]
  messages = list(opening)
  images: list[str] = []  # every image of the conversation, in order
  pending: list[str] = []  # attached with /image, for the next user turn
  interactive = sys.stdin.isatty()
  print(f"[m3jax] chat ({_HELP}); up to {max_length} tokens", file=sys.stderr)
  turn = 0
  while True:
    if interactive:
      print("you> ", end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line or line.strip() == "/exit":
      return 0
    user = line.rstrip("\n")
    if not user.strip():
      continue
    if user.strip() == "/reset":
      messages, images, pending = list(opening), [], []
      conv.reset()
      print("[m3jax] conversation reset", file=sys.stderr)
      continue
    if user.startswith("/image "):
      path = user[len("/image "):].strip()
      if getattr(model, "vision", None) is None:
        print("[m3jax] this checkpoint has no vision tower: /image ignored", file=sys.stderr)
      elif not os.path.isfile(path):
        print(f"[m3jax] {path}: no such file: /image ignored", file=sys.stderr)
      else:
        pending.append(path)
        print(f"[m3jax] {path} attached to the next turn", file=sys.stderr)
      continue
    turn_images = images + pending
    if pending:
      from m3jax.vision import IMAGE_MARKER  # pylint: disable=g-import-not-at-top
      user = IMAGE_MARKER * len(pending) + user
    messages.append({"role": "user", "content": user})
    try:  # a turn the model cannot take (too long, a template refusal, ...) is dropped; the chat goes on
      ids, embeds = _prompt(model, tokenizer, tok_lib.render_messages(args.checkpoint, messages), turn_images)
      tokens_of_turn = conv.reply(ids, max_new_tokens=args.max_new_tokens, prompt_embeds=embeds)
    except ValueError as e:
      messages.pop()
      print(f"[m3jax] error: {e}; turn dropped", file=sys.stderr)
      continue
    images, pending = turn_images, []
    turn += 1
    start = time.perf_counter()
    first_at = None
    printer = _TokenPrinter(tokenizer)
    try:
      for tokens in tokens_of_turn:
        first_at = first_at or time.perf_counter()
        printer.write([int(t) for t in tokens if int(t) not in eos])
    except KeyboardInterrupt:  # Ctrl-C stops the reply, not the chat; the reply so far stays in the conversation
      print(" [interrupted]", file=sys.stderr)
    printer.finish()
    end = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()
    messages.append({"role": "assistant", "content": printer.printed})
    stats = conv.last_turn
    decode_s = end - (first_at or end)
    print(f"[m3jax] turn {turn}: {stats.reused} tokens from the cache, {stats.prefilled} prefilled, "
          f"{stats.generated} generated; first token after {(first_at or end) - start:.3f}s, decode "
          f"{(stats.generated - 1) / decode_s if decode_s > 0 else float('nan'):.1f} tok/s; conversation "
          f"{len(conv.history)} / {max_length} tokens", file=sys.stderr)



def _prompt(model, tokenizer, text: str, images: list[str]):
  """The rendered conversation -> (token ids, embeddings [1, S, H] or None without images). The vision tower
  runs over every image of the conversation; the caches decide what is prefilled again (Conversation.reply)."""
  if not images:
    return tokenizer.encode(text, add_special_tokens=False).ids, None
  return _multimodal_prompt(model, tokenizer, text, images)
