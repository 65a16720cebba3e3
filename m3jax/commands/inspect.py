"""``m3jax inspect PATH``: config summary, parameter count by component, dtypes and bytes on disk of a checkpoint
directory (safetensors source or m3jax-converted); reads metadata only."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("inspect", help="summarise a checkpoint (config, parameters by component, dtypes, size)",
                     description=__doc__)
  p.add_argument("path", help="checkpoint directory (safetensors or `m3jax convert` output)")
  g = p.add_argument_group("per-device memory plan (m3jax.parallel.memory)")
  g.add_argument("--mesh", default=None, help="plan bytes per device for a mesh, e.g. expert=4,tensor=2 or tensor=8")
  g.add_argument("--batch", type=int, default=1, help="sequences in the cache (default 1)")
  g.add_argument("--context", type=int, default=None, help="cache tokens per sequence (default: max positions)")
  g.add_argument("--sequence-parallel", action="store_true", help="plan with RULES_SP")
  g.add_argument("--keep-quantized", action="store_true",
                 help="plan the weights the checkpoint stores in fp8 kept in fp8 (m3jax.load(..., keep_quantized=True))")
  g.add_argument("--quantize", choices=("mxfp8",), default=None,
                 help="plan the linear weights quantized as `m3jax convert --quantize mxfp8` would")
  g.add_argument("--fp8-experts", action="store_true",
                 help="forecast from the shapes alone: routed experts at 1 + 1/32 bytes per weight, others in bf16")
  g.add_argument("--with-mtp", action="store_true",
                 help="include the MTP module and its cache (what --speculative / with_mtp=True loads)")
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  from m3jax.checkpoint.inspect import inspect_checkpoint  # pylint: disable=g-import-not-at-top

  report = inspect_checkpoint(args.path)
  print("\n".join(report.lines()))
  if getattr(args, "mesh", None):
    from m3jax import sharding  # pylint: disable=g-import-not-at-top
    from m3jax.parallel.memory import FP8_BYTES, plan_memory  # pylint: disable=g-import-not-at-top

    from m3jax.checkpoint.converted import is_converted  # pylint: disable=g-import-not-at-top
    from m3jax.checkpoint.inspect import fp8_specs  # pylint: disable=g-import-not-at-top

    context = args.context or report.config.text.max_position_embeddings
    dtype = "bfloat16" if args.fp8_experts else report.dtype
    quantized = None
    if args.keep_quantized or args.quantize or is_converted(args.path):  # a conversion loads as it is stored
      quantized = fp8_specs(args.path, args.quantize)
      if not args.with_mtp:
        quantized = {p: spec for p, spec in quantized.items() if p[0] != "mtp"}
    plan = plan_memory(report.config, args.mesh, batch=args.batch, context=context, dtype=dtype,
                       expert_bytes=FP8_BYTES if args.fp8_experts else None,
                       rules=sharding.RULES_SP if args.sequence_parallel else sharding.RULES,
                       with_mtp=args.with_mtp, quantized=quantized)
    print("\n".join(plan.lines()))
  return 0
