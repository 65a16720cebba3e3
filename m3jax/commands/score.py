"""``m3jax score``: the perplexity of a text under a checkpoint (a check of a conversion, a quantized format or a
kernel path), with per-token log-probabilities on request."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from m3jax.parallel import cli as parallel_cli
from m3jax.token_ids import parse_token_ids


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("score", help="perplexity of a text (per-token log-probabilities with --save)")
  p.add_argument("checkpoint", help="checkpoint directory (safetensors or converted)")
  group = p.add_mutually_exclusive_group(required=True)
  group.add_argument("--text-file", help="a text file, tokenised with the checkpoint's tokenizer.json")
  group.add_argument("--prompt-ids", help="comma-separated token ids")
  p.add_argument("--no-bos", action="store_true",
                 help="do not put the config's bos_token_id before a text file's tokens (default: put it, so the "
                      "first token of the text is scored too)")
  p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                 help="run the forward in chunks of N tokens (a power of two >= 16): memory of one chunk's "
                      "activations and logits, for long texts")
  p.add_argument("--save", default=None, metavar="F.npz",
                 help="write ids, logprobs (fp32, 0 for the first token) and greedy (bool) per token")
  p.add_argument("--kernels", default=None, help="reference | pallas | auto (default $M3JAX_KERNELS or auto)")
  parallel_cli.add_mesh_arguments(p)
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  import m3jax  # pylint: disable=g-import-not-at-top
  from m3jax.scoring import token_logprobs  # pylint: disable=g-import-not-at-top

  parallel_cli.init_distributed(args)
  if args.text_file is not None:
    from m3jax.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top

    tokenizer = load_tokenizer(args.checkpoint)
    with open(args.text_file, encoding="utf-8") as f:
      ids = tokenizer.encode(f.read(), add_special_tokens=False).ids
    if not ids:
      raise ValueError(f"{args.text_file}: no tokens")
  else:
    ids = parse_token_ids(args.prompt_ids)
  model = m3jax.load(args.checkpoint, kernels=args.kernels, text_only=True, **parallel_cli.load_kwargs(args))
  bos = model.config.text.bos_token_id
  if args.text_file is not None and not args.no_bos and bos is not None and ids[0] != bos:
    ids = [bos] + ids
  if len(ids) < 2:
    raise ValueError(f"scoring needs at least 2 tokens, got {len(ids)}")
  start = time.perf_counter()
  out = token_logprobs(model, [ids], prefill_chunk=args.prefill_chunk)
  seconds = time.perf_counter() - start
  print(f"tokens {len(ids)} (scored {out.scored_tokens}): mean NLL {out.mean_nll():.4f} nats, perplexity "
        f"{out.perplexity():.4f}, greedy accuracy {out.greedy[0, 1:len(ids)].mean():.4f}")
  print(f"[m3jax] {len(ids) / seconds:.1f} tok/s ({seconds:.3f}s, includes compilation)", file=sys.stderr)
  if args.save:
    np.savez(args.save, ids=np.asarray(ids, np.int32), logprobs=out.logprobs[0, :len(ids)],
             greedy=out.greedy[0, :len(ids)])
    print(f"[m3jax] wrote per-token log-probabilities to {args.save}", file=sys.stderr)
  return 0
