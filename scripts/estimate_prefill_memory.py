"""Temporary (activation + workspace) memory of the prefill program, one shot against chunked (prefill_chunk).

Compiles ``m3jax.generate``'s prefill for one GPU's shard of full M3 (bench_full.shard_config) on abstract
weights, so nothing is allocated and no weights are needed, and prints XLA's buffer assignment for each
program: ``temp`` (activations and workspace: what chunking bounds), ``arguments`` (weights) and ``outputs``
(the caches and logits). On a GPU it compiles the Pallas-kernel path; on the CPU (``JAX_PLATFORMS=cpu``) the
reference path, whose dense attention materialises [heads, S, S] scores per layer.

  PYTHONPATH=$PWD JAX_PLATFORMS=cpu python3 scripts/estimate_prefill_memory.py --layers 4 --prompt 32768 \\
      --chunks 8192,2048
  CPU smoke:  ... --smoke --prompt 256 --chunks 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench_full import model_config, shard_config
from m3jax.generate import _prefill
from m3jax.model import M3ForCausalLM


def prefill_memory(cfg, prompt: int, chunks: list[int | None], kernels: str) -> list[dict]:
  """For each chunk (None = one shot): XLA's temp / argument / output bytes of the compiled prefill program
  of a batch-1 prompt of ``prompt`` tokens into a cache of prompt + 128 slots."""
  abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels=kernels))
  graphdef, state = nnx.split(abstract)
  state = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)
  fn = jax.jit(lambda st, ids, lengths, chunk: _prefill(nnx.merge(graphdef, st), ids, lengths, prompt + 128,
                                                         chunk=chunk), static_argnums=3)
  ids, lengths = jax.ShapeDtypeStruct((1, prompt), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
  rows = []
  for chunk in chunks:
    begin = time.perf_counter()
    analysis = fn.lower(state, ids, lengths, chunk).compile().memory_analysis()
    rows.append({"chunk": chunk, "temp_bytes": int(analysis.temp_size_in_bytes),
                 "argument_bytes": int(analysis.argument_size_in_bytes),
                 "output_bytes": int(analysis.output_size_in_bytes), "compile_s": time.perf_counter() - begin})
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=4, help="leading layers of M3 (3 dense + sparse ones)")
  parser.add_argument("--one-shard", type=int, default=8, metavar="WAYS")
  parser.add_argument("--prompt", type=int, default=32768)
  parser.add_argument("--chunks", default="8192,2048", help="comma-separated prefill_chunk values")
  parser.add_argument("--kernels", default="auto")
  parser.add_argument("--smoke", action="store_true", help="tiny dims")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  cfg = model_config(args.layers, args.smoke)
  if not args.smoke:
    cfg = dataclasses.replace(cfg, text=shard_config(cfg.text, args.one_shard))
  rows = prefill_memory(cfg, args.prompt, [None] + [int(c) for c in args.chunks.split(",") if c], args.kernels)
  print(f"{jax.devices()[0].platform}: prefill of {args.prompt} tokens, {cfg.text.num_layers} layers "
        f"{cfg.text.attention_types} (one GPU of a {args.one_shard}-way split)")
  for r in rows:
    print(f"  chunk {r['chunk'] or 'none (one shot)'}: temp {r['temp_bytes'] / 2**30:.2f} GiB, arguments "
          f"{r['argument_bytes'] / 2**30:.2f} GiB, outputs {r['output_bytes'] / 2**30:.2f} GiB "
          f"(compile {r['compile_s']:.1f}s)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"platform": jax.devices()[0].platform, "prompt": args.prompt, "layers": cfg.text.num_layers,
                 "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
