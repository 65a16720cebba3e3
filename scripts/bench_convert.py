"""Benchmark of ``m3jax convert`` (and optionally ``m3jax export``) on a synthetic checkpoint with the real M3
hidden sizes: hidden 6144, 64 query heads x 128, 4 KV heads, indexer 4 x 128, experts of 3072, shared expert
3072, dense MLP 12288, vocab 200064 -- but few layers and experts (default: 3 layers = 1 dense + 2 MoE of 8
experts, ~8 GB in bf16).

Writes the source checkpoint (original MiniMax layout, bf16, fp32 router gates, 4 GiB shards) once, then runs
each command in a fresh child process and reports its wall time, throughput (source bytes / wall time, process
start-up and imports included) and peak RSS, next to the RSS of a child that only imports m3jax / jax / orbax,
and the largest single output array. Peak RSS is the child's ``VmHWM`` (/proc/self/status at exit): rusage
``ru_maxrss`` is not usable because Linux carries the parent's RSS at fork/exec over into the child's.

  PYTHONPATH=. python scripts/bench_convert.py --workdir /tmp/m3jax_bench [--layers 3] [--experts 8]
      [--piece-mb 128 4096] [--export] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from m3jax.checkpoint.mapping import text_rules  # noqa: E402
from m3jax.checkpoint.safetensors_dir import INDEX_NAME  # noqa: E402
from m3jax.checkpoint.safetensors_stream import NUMPY_DTYPES, StreamingWriter, read_tensor  # noqa: E402
from m3jax.config import M3Config, TextConfig  # noqa: E402

GB = 1e9
SHARD_BYTES = 4 * 2**30
POOL_ELEMS = 32 * 2**20  # 64 MiB of bf16 random values reused for every tensor


def bench_config(layers: int, experts: int) -> M3Config:
  """Real M3 widths; layer 0 is full attention + dense MLP, the others sparse attention + MoE."""
  text = TextConfig(
      vocab_size=200064, hidden_size=6144, num_layers=layers, num_heads=64, num_kv_heads=4, head_dim=128,
      intermediate_size=3072, dense_intermediate_size=12288, shared_intermediate_size=3072, num_experts=experts,
      num_experts_per_tok=min(4, experts), attention_types=("full",) + ("sparse",) * (layers - 1),
      mlp_types=("dense",) + ("moe",) * (layers - 1), index_num_heads=4, index_head_dim=128,
      bos_token_id=200034, eos_token_ids=(200020,))
  return M3Config(text=text)


def write_source(cfg: M3Config, path: str) -> tuple[int, int]:
  """Writes the synthetic original-layout checkpoint; returns (tensors, bytes)."""
  rng = np.random.default_rng(0)
  pool = (rng.standard_normal(POOL_ELEMS, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
  entries = []
  for rule in text_rules(cfg.text, "original"):
    fp32 = rule.path[-1] in ("router", "correction_bias")
    entries += [(name, shape, "F32" if fp32 else "BF16") for name, shape in zip(rule.sources, rule.source_shapes)]
  shards, size = [[]], 0
  for e in entries:
    n = int(np.prod(e[1])) * NUMPY_DTYPES[e[2]].itemsize
    if shards[-1] and size + n > SHARD_BYTES:
      shards, size = shards + [[]], 0
    shards[-1].append(e)
    size += n
  os.makedirs(path, exist_ok=True)
  weight_map, total, offset = {}, 0, 0
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    with StreamingWriter(os.path.join(path, fname), shard) as w:
      for name, shape, dtype in shard:
        row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        rows_per = max(1, POOL_ELEMS // (2 * row))
        for r0 in range(0, shape[0], rows_per):
          rows = min(rows_per, shape[0] - r0)
          start = offset % (POOL_ELEMS // 2)
          chunk = pool[start:start + rows * row].reshape((rows,) + tuple(shape[1:]))
          offset += 7919
          w.write(name, chunk.astype(np.float32) if dtype == "F32" else chunk)
        weight_map[name] = fname
        total += int(np.prod(shape)) * NUMPY_DTYPES[dtype].itemsize
  with open(os.path.join(path, INDEX_NAME), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=2)
  return len(entries), total


# Runs Python code (argv[1]) in the child and prints its peak RSS (VmHWM) on the way out.
_WRAPPER = """
import atexit, sys
def _hwm():
  for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
      print("BENCH_VMHWM_KB", line.split()[1], flush=True)
atexit.register(_hwm)
code = sys.argv[1]
sys.argv = sys.argv[1:]
exec(compile(code, "<bench-child>", "exec"), {"__name__": "__main__"})
"""


def run_child(code: str, *args: str) -> dict:
  """Runs Python ``code`` (with sys.argv[1:] = args) in a fresh child; wall time, peak RSS (bytes) and the last
  output lines."""
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-c", _WRAPPER, code, *args], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, env=env, text=True)
  wall = time.perf_counter() - start
  if proc.returncode:
    raise RuntimeError(f"{code} {args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
  lines = proc.stdout.strip().splitlines()
  hwm = [int(line.split()[1]) * 1024 for line in lines if line.startswith("BENCH_VMHWM_KB")]
  lines = [line for line in lines if not line.startswith("BENCH_VMHWM_KB")]
  return {"wall_s": wall, "peak_rss_bytes": hwm[-1], "output": lines[-6:]}


CLI = "import sys; from m3jax.cli import main; rc = main(sys.argv[1:]); assert rc == 0, rc"
SAME = "import sys; sys.path.insert(0, sys.argv[3]); from bench_convert import _same_tensors; print('BIT_EXACT', _same_tensors(sys.argv[1], sys.argv[2]))"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", default="/tmp/m3jax_bench")
  ap.add_argument("--layers", type=int, default=3)
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--piece-mb", type=int, nargs="+", default=[128], help="convert --piece-mb values to run")
  ap.add_argument("--export", action="store_true", help="also time `m3jax export` and check it bit-exact")
  ap.add_argument("--keep", action="store_true", help="keep the outputs (the source is always kept)")
  ap.add_argument("--json", default=None, help="write the results here")
  args = ap.parse_args()

  cfg = bench_config(args.layers, args.experts)
  src = os.path.join(args.workdir, f"src_L{args.layers}_E{args.experts}")
  if not os.path.exists(os.path.join(src, "config.json")):
    shutil.rmtree(src, ignore_errors=True)
    t = time.perf_counter()
    n, total = write_source(cfg, src + ".tmp")
    os.rename(src + ".tmp", src)
    print(f"wrote {n} tensors, {total / GB:.2f} GB to {src} in {time.perf_counter() - t:.0f} s")
  with open(os.path.join(src, INDEX_NAME)) as f:
    src_bytes = json.load(f)["metadata"]["total_size"]
  t = cfg.text
  largest = {"embed / lm_head [V, H]": t.vocab_size * t.hidden_size * 2,
             "stacked experts gate_up [E, H, 2I]": t.num_experts * t.hidden_size * 2 * t.intermediate_size * 2,
             "dense MLP gate_up [H, 2F]": t.hidden_size * 2 * t.dense_intermediate_size * 2}
  results = {"config": f"{t.num_layers} layers (1 dense + {t.num_moe_layers} MoE x {t.num_experts} experts), "
                       f"hidden {t.hidden_size}, vocab {t.vocab_size}, bf16",
             "source_bytes": src_bytes, "largest_arrays_bytes": largest, "cpus": os.cpu_count(),
             "load_average_before": os.getloadavg()}
  results["imports_only"] = run_child("import jax, orbax.checkpoint, m3jax.checkpoint.convert, m3jax.checkpoint.export; "
                                      "jax.devices()")
  print(f"source: {src_bytes / GB:.2f} GB; largest single output array: {max(largest.values()) / GB:.2f} GB "
        f"({max(largest, key=largest.get)}); imports-only RSS {results['imports_only']['peak_rss_bytes'] / GB:.2f} GB")
  for piece_mb in args.piece_mb:
    dst = os.path.join(args.workdir, f"dst_piece{piece_mb}")
    r = run_child(CLI, "convert", src, dst, "--force", "--no-progress", "--piece-mb", str(piece_mb))
    r["gb_per_s"] = src_bytes / GB / r["wall_s"]
    results[f"convert_piece{piece_mb}"] = r
    print(f"convert --piece-mb {piece_mb}: {r['wall_s']:.1f} s wall, {r['gb_per_s']:.2f} GB/s, peak RSS "
          f"{r['peak_rss_bytes'] / GB:.2f} GB")
    print("   " + "\n   ".join(r["output"]))
    if args.export:
      out = os.path.join(args.workdir, "export")
      e = run_child(CLI, "export", dst, out, "--force", "--no-progress")
      e["gb_per_s"] = src_bytes / GB / e["wall_s"]
      e["bit_exact"] = "BIT_EXACT True" in run_child(SAME, src, out, os.path.dirname(os.path.abspath(__file__)))["output"]
      results[f"export_piece{piece_mb}"] = e
      print(f"export: {e['wall_s']:.1f} s wall, {e['gb_per_s']:.2f} GB/s, peak RSS {e['peak_rss_bytes'] / GB:.2f} GB, "
            f"bit-exact vs source: {e['bit_exact']}")
      if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
      shutil.rmtree(dst, ignore_errors=True)
  results["load_average_after"] = os.getloadavg()
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)


def _same_tensors(a: str, b: str) -> bool:
  """Every tensor of checkpoint ``a`` is in ``b`` with the same bytes (one tensor in memory at a time)."""
  with open(os.path.join(a, INDEX_NAME)) as f:
    map_a = json.load(f)["weight_map"]
  index_b = os.path.join(b, INDEX_NAME)
  if os.path.exists(index_b):
    with open(index_b) as f:
      map_b = json.load(f)["weight_map"]
  else:
    map_b = {name: "model.safetensors" for name in map_a}
  if set(map_a) != set(map_b):
    return False
  for name, fname in map_a.items():
    x, y = read_tensor(os.path.join(a, fname), name), read_tensor(os.path.join(b, map_b[name]), name)
    if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x.view(np.uint8), y.view(np.uint8)):
      return False
  return True


if __name__ == "__main__":
  main()
