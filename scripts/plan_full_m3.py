"""Per-device memory plan of full-size M3 (the `m3_full` preset) for several meshes, from the config alone.

The same numbers as `m3jax inspect CKPT --mesh ...` on a real checkpoint, without one: weights by component
(vision tower included), KV + index-key caches (bf16), and the decode-loop workspace, in decimal GB.

  PYTHONPATH=$PWD python3 scripts/plan_full_m3.py --quantize mxfp8 \
      --rows "tensor=8:8x32768,expert=4,tensor=2:8x32768,tensor=4:4x16384"

``--quantize mxfp8`` keeps the linear weights that `m3jax convert --quantize mxfp8` quantizes (routed and shared
experts, dense MLP, attention and indexer projections) in MXFP8: 1 byte a weight plus one E8M0 scale per 32.
"""

from __future__ import annotations

import argparse
import re

from m3jax.checkpoint import fp8_params
from m3jax.checkpoint.loader import build_rules
from m3jax.config import m3_full
from m3jax.parallel.memory import plan_memory


def parse_rows(text: str) -> list[tuple[str, int, int]]:
  """'tensor=8:8x32768,expert=4,tensor=2:8x32768' -> [(mesh, batch, context), ...]."""
  rows = []
  for mesh, batch, context in re.findall(r"([a-z=0-9,]+?):(\d+)x(\d+),?", text):
    rows.append((mesh.strip(","), int(batch), int(context)))
  if not rows:
    raise SystemExit(f"error: --rows {text!r}: expected MESH:BATCHxCONTEXT[,MESH:BATCHxCONTEXT...]")
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", default="tensor=8:8x32768,expert=4,tensor=2:8x32768,tensor=4:4x16384")
  parser.add_argument("--quantize", choices=("mxfp8",), default=None)
  args = parser.parse_args()
  cfg = m3_full()
  specs = fp8_params.quantize_specs(build_rules(cfg, "original"), args.quantize) if args.quantize else None
  print("| mesh | batch x context | routed experts | weights | cache | total / device | + decode-loop workspace |")
  print("|---|---|---|---|---|---|---|")
  for mesh, batch, context in parse_rows(args.rows):
    plan = plan_memory(cfg, mesh, batch=batch, context=context, quantized=specs)
    gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
    print(f"| {mesh} | {batch} x {context} | {gb(plan.weights['routed experts'])} | {gb(plan.weights_per_device)} | "
          f"{gb(plan.cache_per_device)} | {gb(plan.total_per_device)} | {gb(plan.decode_workspace)} |")


if __name__ == "__main__":
  main()
