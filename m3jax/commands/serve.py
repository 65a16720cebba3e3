"""``m3jax serve``: an OpenAI-compatible HTTP server (completions with echo / prompt lists / logprobs, chat
completions, streaming, /metrics, the tokenizer routes lm-eval reads) over continuous batching (m3jax.serving,
m3jax.engine). One log line per request on stderr."""

from __future__ import annotations

import argparse
import sys

from m3jax.commands import options
from m3jax.parallel import cli as parallel_cli


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)",
                     description="An OpenAI-compatible HTTP server: POST /v1/completions (prompt text, ids or a list "
                                 "of them; echo, logprobs, stop, stream), POST /v1/chat/completions, GET /v1/models, "
                                 "/health, /metrics (Prometheus text), /tokenizer_info, POST /tokenize, /detokenize; "
                                 "the OpenAPI document at /openapi.json (FastAPI on uvicorn: the serve extra). "
                                 "Each request is logged on stderr (method, path, status, tokens, latency). "
                                 "docs/serving.md has the details and the lm-eval recipe.")
  p.add_argument("checkpoint", help="checkpoint directory with tokenizer.json (and a chat template for chat)")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--slots", type=int, default=8, help="sequences decoded together (default 8)")
  p.add_argument("--max-length", type=int, default=8192, help="prompt + completion tokens per request (default 8192)")
  p.add_argument("--cache-tokens", type=int, default=None, metavar="N",
                 help="KV cache size in tokens, paged and shared by all requests (default: --slots x --max-length)")
  p.add_argument("--temperature", type=float, default=0.0, help="default for requests that set none; 0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--steps-per-call", type=int, default=4, help="decode steps per device call (default 4)")
  p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                 help="prompt tokens prefilled per engine step, between decode calls (a power of two; default 2048)")
  p.add_argument("--max-logprobs", type=int, default=5,
                 help="most alternatives per token a request may ask log-probabilities for (default 5; -1 turns "
                      "log-probabilities off, saving a log-softmax over the vocabulary per decode step)")
  p.add_argument("--model-name", default="minimax-m3",
                 help="the id /v1/models reports; a request naming another model gets a 404 (default minimax-m3)")
  p.add_argument("--log-level", default="info", choices=("debug", "info", "warning"),
                 help="request log on stderr: info (default) logs one line per request, debug also /health and "
                      "/metrics polls, warning none")
  p.add_argument("--max-request-bytes", type=int, default=None,
                 help="largest request body accepted, checked from Content-Length before it is read (default: 64 "
                      "bytes per --max-length token + 64 KiB, + 16 MiB per --max-images with the vision tower)")
  p.add_argument("--no-vision", action="store_true",
                 help="load the text backbone only, even for a vision-language checkpoint (chat image_url parts "
                      "then get a 400); by default its vision tower is loaded and chat takes data: URL images")
  p.add_argument("--max-images", type=int, default=8,
                 help="image_url parts a chat request may hold, with the vision tower (default 8; 0: as "
                      "--no-vision)")
  options.add_eos_argument(p)
  p.add_argument("--kernels", default=None, help="reference | pallas | auto (default $M3JAX_KERNELS or auto)")
  parallel_cli.add_mesh_arguments(p, distributed=False)
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  import m3jax  # pylint: disable=g-import-not-at-top
  from m3jax import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  from m3jax.engine import Engine  # pylint: disable=g-import-not-at-top
  from m3jax.interrupts import Terminated  # pylint: disable=g-import-not-at-top
  from m3jax.serving import Server  # pylint: disable=g-import-not-at-top

  options.check_sampling_args(args)
  if args.max_logprobs < -1:
    raise ValueError(f"--max-logprobs must be >= -1 (-1: off), got {args.max_logprobs}")
  if args.max_request_bytes is not None and args.max_request_bytes < 1:
    raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
  if args.max_images < 0:
    raise ValueError(f"--max-images must be >= 0, got {args.max_images}")
  try:
    from m3jax.serving_http import attach, bind  # pylint: disable=g-import-not-at-top
  except ModuleNotFoundError as e:
    if e.name not in ("fastapi", "starlette", "pydantic", "uvicorn", "h11"):
      raise
    raise ValueError(f"m3jax serve needs the serve extra (no module {e.name!r}): pip install 'm3jax[serve]'"
                     ) from None
  tok_lib.load_tokenizer(args.checkpoint)  # fails early without one
  httpd = bind(args.host, args.port).start()  # a port in use fails now; until the model is loaded: 503s
  server = None
  try:
    # The vision tower (when the checkpoint has one) is a small part of the model: loaded unless --no-vision.
    model = m3jax.load(args.checkpoint, kernels=args.kernels, text_only=args.no_vision or not args.max_images,
                       **parallel_cli.load_kwargs(args))
    eos = options.stop_ids(args, args.checkpoint, model.config.text.eos_token_ids, model.config.text.vocab_size)
    engine = Engine(model, slots=args.slots, max_tokens_in_cache=args.cache_tokens,
                    max_length=min(args.max_length, model.config.text.max_position_embeddings),
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    eos_token_ids=eos, steps_per_call=args.steps_per_call, prefill_chunk=args.prefill_chunk,
                    logprobs=args.max_logprobs >= 0, top_logprobs=max(args.max_logprobs, 0))
    server = Server(engine, args.checkpoint, model_name=args.model_name, max_body_bytes=args.max_request_bytes,
                    max_images=args.max_images)
    _log_to_stderr(args.log_level)
    attach(httpd, server)
    host, port = httpd.address
    images = (f", up to {server.limits.max_images} images per chat request" if server.limits.max_images
              else ", text only")
    print(f"[m3jax] serving {args.checkpoint} as {args.model_name!r} on http://{host}:{port}/v1 ({args.slots} "
          f"slots, up to {engine.max_length} tokens per request{images})", file=sys.stderr, flush=True)
    httpd.wait()
  except (KeyboardInterrupt, Terminated):
    if server is None:
      raise  # interrupted while loading: reported as such
  finally:
    httpd.stop()
    if server is not None:
      server.close()
  return 0


def _log_to_stderr(level: str) -> None:
  """The request log (logger m3jax.serving, at ``level``) and uvicorn's own warnings (malformed requests, app
  errors) on stderr, one ``[m3jax]`` line each."""
  import logging  # pylint: disable=g-import-not-at-top

  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("[m3jax] %(message)s"))
  for name, at in (("m3jax.serving", level.upper()), ("uvicorn.error", "WARNING")):
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(at)
    logger.propagate = False
