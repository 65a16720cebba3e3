"""Benchmarks of the M3 indexer / sparse attention / dense causal kernels at real M3 dims on one GPU.

  PYTHONPATH=$PWD python scripts/bench_attention.py --out $OUT [--sizes 32768,131072] [--quick]

Every kernel result is checked against the pure-XLA reference in the same run before it is timed.
Times are GPU kernel time summed over all launches of one call (CUPTI via jax's Mosaic GPU profiler;
launch gaps excluded), median of --iters calls; wall-clock (block_until_ready) if CUPTI is missing.
Prints a markdown table last and writes it (plus a JSON of all rows) under --out.

Sparse prefill on a trained model's selections (the prefill target depends on how much adjacent queries'
selections overlap, which random index projections cannot show):

  m3jax forward CKPT --prompt-file long.txt --selection-stats --save-selections sel.npz
  PYTHONPATH=$PWD python scripts/bench_attention.py --out $OUT --selections sel.npz --sections dense --sizes S

(S = the prompt length: the dense section gives cuDNN's rate at the same length.) Without a trained model,
`--sections locality,dense` maps selection overlap to kernel speed on synthetic selections with a set number
of per-query blocks (window_shared_selections), and `--sections kvmajor` times the memory floor of the other
loop order (BENCHMARKS.md, "Sparse prefill against selection locality").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import bench_common
from bench_common import gpu_ms
from m3jax.research import selection_locality
from pallas_kernels.attention import (
    KvMajorBlockSizes, SparseAttentionBlockSizes, causal_attention, causal_attention_reference, kv_major_block_sizes,
    sparse_attention, sparse_attention_reference,
)
from pallas_kernels.indexer import IndexerBlockSizes, index_block_scores_reference, indexer_topk
from pallas_kernels.indexer import indexer_topk_reference
from pallas_kernels.indexer.api import select_blocks_sorted

NQ, NKV, D, HI, DI, TOPK, BLOCK = 64, 4, 128, 4, 128, 16, 128
SCALE = D ** -0.5
ROWS: list[dict] = []
INTERPRET = False  # --interpret: CPU dry run of this script on tiny sizes (kernels in GPU interpret mode)


def timed(fn, *args, iters: int = 5):
  """gpu_ms, with one call (no warm-up) per measurement under --interpret (its times mean nothing there)."""
  return gpu_ms(fn, *args, iters=1 if INTERPRET else iters)


def record(section, **kw):
  row = dict(section=section, **kw)
  ROWS.append(row)
  print(json.dumps(row), flush=True)


def guarded(fn):
  @functools.wraps(fn)
  def run(*a, **k):
    try:
      fn(*a, **k)
    except Exception as e:  # noqa: BLE001 - keep benchmarking the other sections
      record(fn.__name__, args=str(a), error=f"{type(e).__name__}: {str(e)[:600]}")
      traceback.print_exc()
  return run


def rel_err(got, ref):
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  return float(np.linalg.norm(got - ref) / np.linalg.norm(ref)), bool(np.isfinite(got).all())


def set_match(got, ref):
  """Fraction of rows whose selected id sets equal the reference's."""
  got, ref = np.asarray(got), np.asarray(ref)
  g = np.sort(np.where(got < 0, 1 << 30, got), -1)
  r = np.sort(np.where(ref < 0, 1 << 30, ref), -1)
  return float((g == r).all(-1).mean())


@guarded
def ceilings():
  n = (1 << 16) if INTERPRET else (1 << 30)
  x = jnp.ones((n,), jnp.float32)  # 4 GiB
  copy, matmul = jax.jit(lambda a: a * 2.0), jax.jit(lambda a, b: a @ b)
  if INTERPRET:  # compiled first: decode's roofline divides by this bandwidth (one call, no warm-up, in timed)
    jax.block_until_ready(copy(x))
  _, ms, how = timed(copy, x)
  record("ceiling", what="copy x*2 (read+write) GB/s", value=round(8 * n / ms / 1e6, 1), timer=how)
  m = 256 if INTERPRET else 8192
  a = jax.random.normal(jax.random.key(0), (m, m), jnp.bfloat16)
  if INTERPRET:
    jax.block_until_ready(matmul(a, a))
  _, ms, how = timed(matmul, a, a)
  record("ceiling", what=f"bf16 matmul {m}^3 TFLOP/s", value=round(2 * m**3 / ms / 1e9, 1), timer=how)


def index_inputs(b, s, correlated=False, seed=0):
  kq, kk, kb = jax.random.split(jax.random.key(seed), 3)
  idx_q = jax.random.normal(kq, (b, s, HI, DI), jnp.float32)
  if correlated:  # queries of one 64-token window share a base direction -> overlapping selections
    base = jax.random.normal(kb, (b, -(-s // 64), HI, DI), jnp.float32)
    idx_q = 0.3 * idx_q + jnp.repeat(base, 64, axis=1)[:, :s]
  idx_k = jax.random.normal(kk, (b, s, DI), jnp.float32)
  return idx_q.astype(jnp.bfloat16), idx_k.astype(jnp.bfloat16)


def window_shared_selections(s, replaced, *, window=64, groups=NKV, topk=TOPK, seed=0):
  """int32 [1, s, groups, topk] selections of a prefill from position 0 (query i at position i) with a set
  amount of overlap between neighbours, to map selection locality to kernel speed.

  Each (``window``-query window, KV group) draws one selection: block 0, the window's own block and topk - 2
  blocks from those in between; every query of the window then swaps ``replaced`` of those topk - 2 for blocks
  of its own, drawn from the ones the window did not pick. replaced = 0: the window's queries select the same
  blocks (4-query union = topk); replaced = topk - 2: they share only blocks 0 and their own. Queries that see
  <= topk blocks select all of them. Unused slots are -1.
  """
  if BLOCK % window or not 0 <= replaced <= topk - 2:
    raise ValueError(f"window must divide {BLOCK} and 0 <= replaced <= {topk - 2}; got {window}, {replaced}")
  rng = np.random.default_rng(seed)
  ids = np.full((-(-s // window) * window, groups, topk), -1, np.int32)
  for w in range(len(ids) // window):
    rows = slice(w * window, (w + 1) * window)
    own = w * window // BLOCK
    if own < topk:
      ids[rows, :, :own + 1] = np.arange(own + 1)
      continue
    for g in range(groups):
      free = rng.permutation(np.arange(1, own))
      shared, others = free[:topk - 2], free[topk - 2:]
      picked = np.broadcast_to(shared, (window, topk - 2)).copy()
      n = min(replaced, len(others))
      if n:
        slots = np.argpartition(rng.random((window, topk - 2)), n - 1, axis=-1)[:, :n]
        fresh = others[np.argpartition(rng.random((window, len(others))), n - 1, axis=-1)[:, :n]]
        np.put_along_axis(picked, slots, fresh, axis=-1)
      ids[rows, g, 0], ids[rows, g, 1], ids[rows, g, 2:] = 0, own, picked
  return jnp.asarray(ids[None, :s])


@guarded
def locality_sweep(s, with_ref, variants, private=(0, 1, 2, 4, 7, TOPK - 2)):
  """Sparse prefill on window_shared_selections for a range of overlaps (`private` blocks per query): kernel
  rate against the 4- and 8-query unions (the XLA check on the one with 2)."""
  for replaced in private:
    ids = window_shared_selections(s, replaced)
    sparse_prefill_on(ids, f"window-shared, {replaced} private", with_ref and replaced == 2, variants)


@guarded
def kv_major_floor(s):
  """Memory floor of a KV-major sparse prefill ("KV outer, gather Q": each selected block is loaded once for
  all the queries that picked it). That order leaves every (query, group, selected block) pair with a partial
  output (16 heads x D, bf16 here; fp32 doubles it) and a log-sum-exp per head, written by the attention pass
  and read back by a merge. Timed as two XLA passes that do only that traffic, no attention math (and no Q
  gathers, another 4 KB read per pair): their sum is a lower bound on such a kernel's time at this length."""
  hpg = NQ // NKV
  q = jax.random.normal(jax.random.key(7), (s, NKV, hpg, D), jnp.bfloat16)
  weights = jnp.linspace(0.5, 1.5, TOPK, dtype=jnp.float32)
  write = jax.jit(lambda x: (x[:, :, None].astype(jnp.float32) * weights[:, None, None]).astype(jnp.bfloat16))
  lse = jax.random.normal(jax.random.key(8), (s, NKV, TOPK, hpg), jnp.float32)

  def merge(part, lse):
    w = jax.nn.softmax(lse, axis=2)[..., None]
    return jnp.sum(part.astype(jnp.float32) * w, axis=2).astype(jnp.bfloat16)

  part, write_ms, how = timed(write, q, iters=3)
  out, merge_ms, _ = timed(jax.jit(merge), part, lse, iters=3)
  want = (q.astype(jnp.float32) * jnp.sum(jax.nn.softmax(lse, axis=2) * weights[:, None], axis=2)[..., None])
  gb = part.size * 2 / 1e9
  record("kv_major_floor", S=s, partial_GB=round(gb, 2), write_ms=round(write_ms, 3), merge_ms=round(merge_ms, 3),
         write_GBs=round(gb / write_ms * 1e3, 1), merge_GBs=round((gb + lse.size * 4 / 1e9) / merge_ms * 1e3, 1),
         floor_ms=round(write_ms + merge_ms, 3), rel_err=rel_err(out, want), timer=how)


def qkv(b, sq, sk, seed=1):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, sq, NQ, D), jnp.bfloat16), jax.random.normal(kk, (b, sk, NKV, D), jnp.bfloat16),
          jax.random.normal(kv, (b, sk, NKV, D), jnp.bfloat16))


@guarded
def indexer_prefill(s, with_ref):
  idx_q, idx_k = index_inputs(1, s)
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  flops = 2 * HI * DI * s * (s + 1) / 2
  kw = dict(block_size=BLOCK, topk=TOPK, local_blocks=1)
  ref = None
  if with_ref:
    fn = jax.jit(functools.partial(indexer_topk_reference, **kw))
    ref, ms, how = timed(fn, idx_q, idx_k, pos, iters=1 if s > 40000 else 3)
    record("indexer_prefill", S=s, variant="xla_reference", ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), timer=how)
  for name, bs in (("fused_topk", IndexerBlockSizes(kv_stages=2, fused_topk=True)),
                   ("fused_topk_s3", IndexerBlockSizes(kv_stages=3, fused_topk=True)),
                   ("scores+lax.top_k", IndexerBlockSizes(kv_stages=2, fused_topk=False))):
    fn = jax.jit(functools.partial(indexer_topk, block_sizes=bs, interpret=INTERPRET, **kw))
    out, ms, how = timed(fn, idx_q, idx_k, pos, iters=5 if s <= 40000 else 3)
    match = set_match(out, ref) if ref is not None else None
    record("indexer_prefill", S=s, variant=name, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
           set_match=match, timer=how)


def attended_flops(ids, pos):
  """4*D*heads_per_group per attended (query, group, key) over the selected blocks (token-causal)."""
  ids, pos = np.asarray(ids).astype(np.int64), np.asarray(pos).astype(np.int64)
  keys = np.where(ids >= 0, np.clip(pos[:, :, None, None] - ids * BLOCK + 1, 0, BLOCK), 0)
  return 4 * D * (NQ // NKV) * float(keys.sum())


@guarded
def sparse_prefill(s, correlated, with_ref, variants):
  idx_q, idx_k = index_inputs(1, s, correlated)
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  ids = indexer_topk(idx_q, idx_k, pos, block_size=BLOCK, topk=TOPK, local_blocks=1, interpret=INTERPRET)
  sparse_prefill_on(ids, "correlated" if correlated else "random", with_ref, variants)


def load_selections(path):
  """{name: int32 [1, S, NKV, T]} from an npz written by ``m3jax forward --save-selections`` (a prefill
  from position 0, so query i is at position i)."""
  data = np.load(path)
  out = {}
  for name in sorted(n for n in data.files if n.startswith("layer_")):
    ids = data[name]
    if ids.ndim != 4 or ids.shape[0] != 1 or ids.shape[2] != NKV or ids.shape[1] < 1:
      raise ValueError(f"{path}: {name} has shape {ids.shape}; this benchmark needs [1, S, {NKV}, T] "
                       f"(one sequence, M3's {NKV} KV groups)")
    out[name] = jnp.asarray(ids, jnp.int32)
  if not out:
    raise ValueError(f"{path}: no layer_<i> arrays (write them with `m3jax forward --save-selections`)")
  return out


@guarded
def sparse_prefill_on(ids, sel, with_ref, variants):
  """Times sparse attention over the selection ids [1, S, NKV, T] (random q/k/v: the time depends only on
  the selection and the shapes)."""
  s = ids.shape[1]
  q, k, v = qkv(1, s, s)
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  flops = attended_flops(ids, pos)
  locality = selection_locality(ids, pos)  # the statistics `m3jax forward --selection-stats` prints
  union_q4 = round(locality[4]["mean_union"], 1)
  record("sparse_union", S=s, selection=sel, mean_list_len_q4=locality[4]["mean_union"],
         mean_list_len_q8=locality[8]["mean_union"], mean_selected=locality[4]["mean_selected"])
  ref = None
  if with_ref:
    fn = jax.jit(functools.partial(sparse_attention_reference, block_size=BLOCK, scale=SCALE))
    ref, ms, how = timed(fn, q, k, v, ids, pos, iters=1 if s > 40000 else 3)
    record("sparse_prefill", S=s, selection=sel, variant="xla_reference", ms=round(ms, 3),
           tflops=round(flops / ms / 1e9, 1), timer=how)
  for name, bs in variants:
    fn = jax.jit(functools.partial(sparse_attention, block_size=BLOCK, scale=SCALE, block_sizes=bs, interpret=INTERPRET))
    out, ms, how = timed(fn, q, k, v, ids, pos, iters=5 if s <= 40000 else 2)
    err = rel_err(out, ref) if ref is not None else None
    record("sparse_prefill", S=s, selection=sel, union_q4=union_q4, variant=name, ms=round(ms, 3),
           tflops=round(flops / ms / 1e9, 1), rel_err=err, timer=how)
    if (bs is None or isinstance(bs, KvMajorBlockSizes)) and not INTERPRET:  # which kernels ran, and their time
      kernel_breakdown(fn, (q, k, v, ids, pos), s, sel, name)


def kernel_breakdown(fn, args, s, sel, name):
  """GPU time per launch of one call (plan sort, kernel, merge...), biggest first."""
  try:
    from jax.experimental.mosaic.gpu import profiler
    _, per_kernel = profiler.measure(fn, aggregate=False)(*args)
  except Exception as e:  # noqa: BLE001 - a diagnostic only
    record("kernel_breakdown", S=s, selection=sel, variant=name, error=f"{type(e).__name__}: {str(e)[:200]}")
    return
  top = sorted(per_kernel, key=lambda nt: -nt[1])[:8]
  by_name: dict[str, list[float]] = {}  # every launch, summed per kernel name: where the rest of the call goes
  for n, t in per_kernel:
    by_name.setdefault(n[:60], []).append(t)
  totals = sorted(((n, len(ts), round(sum(ts), 3)) for n, ts in by_name.items()), key=lambda r: -r[2])
  record("kernel_breakdown", S=s, selection=sel, variant=name, launches=len(per_kernel),
         kernels=[(n[:60], round(t, 3)) for n, t in top], by_name=totals[:16],
         rest_ms=round(sum(r[2] for r in totals[16:]), 3))


@guarded
def dense_prefill(s, with_ref):
  q, k, v = qkv(1, s, s)
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  flops = 4 * D * NQ * s * (s + 1) / 2
  ref = None
  if with_ref:
    fn = jax.jit(functools.partial(causal_attention_reference, scale=SCALE))
    ref, ms, how = timed(fn, q, k, v, pos, iters=1 if s > 40000 else 3)
    record("dense_prefill", S=s, variant="xla_reference", ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
           timer=how)
  ws = SparseAttentionBlockSizes(queries_per_tile=8, kv_stages=2, compute_wgs=2, ping_pong="every")
  for name, kw in (("cudnn (causal_attention)", dict(use_cudnn=None)),
                   ("pallas dense plan", dict(use_cudnn=False)),
                   ("pallas dense plan, 2 compute WGs", dict(use_cudnn=False, block_sizes=ws)),
                   ("pallas dense plan, 2 compute WGs, no ping-pong",
                    dict(use_cudnn=False, block_sizes=dataclasses.replace(ws, ping_pong="off")))):
    fn = jax.jit(functools.partial(causal_attention, scale=SCALE, interpret=INTERPRET, **kw))
    out, ms, how = timed(fn, q, k, v, pos, iters=5 if s <= 40000 else 2)
    err = rel_err(out, ref) if ref is not None else None
    record("dense_prefill", S=s, variant=name, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), rel_err=err,
           timer=how)
  if not INTERPRET:  # jax's FlashAttention-3 example (2 compute warpgroups + a TMA warpgroup): a Mosaic GPU yardstick
    fa3_baseline(q, k, v, s, flops, ref)


@guarded
def fa3_baseline(q, k, v, s, flops, ref):
  from jax.experimental.pallas.ops.gpu import attention_mgpu  # pylint: disable=g-import-not-at-top

  for bq, stages in ((64, 2), (64, 3)):
    cfg = attention_mgpu.TuningConfig(block_q=bq, block_kv=128, max_concurrent_steps=stages, causal=True)
    fn = jax.jit(lambda q_, k_, v_, cfg=cfg: attention_mgpu.attention(q_ * SCALE, k_, v_, cfg))
    f16 = [a.astype(jnp.float16) for a in (q, k, v)]  # the example's shared-memory buffers are fp16
    out, ms, how = timed(fn, *f16, iters=5 if s <= 40000 else 2)
    err = rel_err(out, ref) if ref is not None else None
    record("dense_prefill", S=s, variant=f"jax attention_mgpu FA3 (block_q={bq}, {stages} stages)", ms=round(ms, 3),
           tflops=round(flops / ms / 1e9, 1), rel_err=err, timer=how)


def decode_layer(idx_q, idx_k, q, k, v, pos, *, reference=False):
  """One sparse layer's decode attention: indexer -> top-16 -> sparse attention."""
  if reference:
    ids = indexer_topk_reference(idx_q, idx_k, pos, block_size=BLOCK, topk=TOPK, local_blocks=1)
    return sparse_attention_reference(q, k, v, ids, pos, block_size=BLOCK, scale=SCALE)
  ids = indexer_topk(idx_q, idx_k, pos, block_size=BLOCK, topk=TOPK, local_blocks=1, interpret=INTERPRET)
  return sparse_attention(q, k, v, ids, pos, block_size=BLOCK, scale=SCALE, interpret=INTERPRET)


@guarded
def decode(b, s, bandwidth_gbs):
  idx_q, idx_k = index_inputs(b, s)
  idx_q = idx_q[:, :1]
  q, k, v = qkv(b, 1, s)
  pos = (s - 1 - jax.random.randint(jax.random.key(5), (b, 1), 0, min(1000, s))).astype(jnp.int32)  # ragged, >= 0
  bytes_read = b * (s * DI * 2 + NKV * TOPK * BLOCK * D * 2 * 2 + NQ * D * 2 + HI * DI * 2)
  roof_us = bytes_read / (bandwidth_gbs * 1e3)
  fn = jax.jit(decode_layer)
  ref_fn = jax.jit(functools.partial(decode_layer, reference=True))
  ref, ref_ms, _ = timed(ref_fn, idx_q, idx_k, q, k, v, pos, iters=3)
  out, ms, how = timed(fn, idx_q, idx_k, q, k, v, pos, iters=10)
  err = rel_err(out, ref)
  # Diagnostics: selections (kernel / XLA reference / reference scores + sort) and attention alone.
  kw = dict(block_size=BLOCK, topk=TOPK, local_blocks=1)
  ids_k = indexer_topk(idx_q, idx_k, pos, interpret=INTERPRET, **kw)
  ids_r = indexer_topk_reference(idx_q, idx_k, pos, **kw)
  ids_s = select_blocks_sorted(index_block_scores_reference(idx_q, idx_k, pos, block_size=BLOCK), pos,
                               topk=TOPK, local_blocks=1, init_blocks=0)
  attn_k = sparse_attention(q, k, v, ids_r, pos, block_size=BLOCK, scale=SCALE, interpret=INTERPRET)
  attn_r = sparse_attention_reference(q, k, v, ids_r, pos, block_size=BLOCK, scale=SCALE)
  record("decode_check", B=b, S=s, ids_kernel_vs_ref=set_match(ids_k, ids_r), ids_kernel_vs_sorted_ref=set_match(ids_k, ids_s),
         ids_ref_vs_sorted_ref=set_match(ids_r, ids_s), attention_only_rel_err=rel_err(attn_k, attn_r))
  record("decode", B=b, S=s, us=round(ms * 1e3, 1), roofline_us=round(roof_us, 1), x_roofline=round(ms * 1e3 / roof_us, 2),
         xla_reference_us=round(ref_ms * 1e3, 1), rel_err=err, timer=how)
  try:
    from jax.experimental.mosaic.gpu import profiler
    _, per_kernel = profiler.measure(fn, aggregate=False)(idx_q, idx_k, q, k, v, pos)
    record("decode_kernels", B=b, S=s, kernels=[(n[:60], round(t * 1e3, 1)) for n, t in per_kernel])
  except Exception:  # noqa: BLE001
    pass


def table() -> str:
  lines = ["| section | case | variant | time | rate | check |", "|---|---|---|---|---|---|"]
  for r in ROWS:
    if "error" in r:
      lines.append(f"| {r['section']} | {r.get('args', '')[:40]} | ERROR | | | {r['error'][:120]} |")
    elif r["section"] == "ceiling":
      lines.append(f"| ceiling | {r['what']} | | | {r['value']} | |")
    elif r["section"] == "decode":
      lines.append(f"| decode | B={r['B']} S={r['S']} | indexer+top16+sparse | {r['us']} us | "
                   f"{r['x_roofline']}x roofline ({r['roofline_us']} us); XLA ref {r['xla_reference_us']} us | "
                   f"rel_err={r['rel_err']} |")
    elif r["section"] == "kv_major_floor":
      lines.append(f"| kv_major_floor | S={r['S']} | {r['partial_GB']} GB of bf16 partials: write + merge | "
                   f"{r['write_ms']} + {r['merge_ms']} = {r['floor_ms']} ms | {r['write_GBs']} / {r['merge_GBs']} GB/s | "
                   f"{r['rel_err']} |")
    elif r["section"] in ("decode_kernels", "decode_check", "sparse_union", "kernel_breakdown"):
      continue
    else:
      case = f"S={r['S']}" + (f" {r['selection']}" if "selection" in r else "")
      case += f" (4-query union {r['union_q4']})" if "union_q4" in r else ""
      check = r.get("rel_err") or r.get("set_match")
      lines.append(f"| {r['section']} | {case} | {r['variant']} | {r['ms']} ms | {r['tflops']} TFLOP/s | {check} |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=".")
  ap.add_argument("--sizes", default="32768,131072")
  ap.add_argument("--quick", action="store_true", help="fewer variants, no 128K XLA references")
  ap.add_argument("--decode", default="1x32768,8x32768,32x32768,64x32768,1x131072", help="BxS list")
  ap.add_argument("--interpret", action="store_true", help="CPU dry run (use tiny --sizes/--decode)")
  ap.add_argument("--sections", default="indexer,sparse,dense,decode",
                  help="comma list of indexer, sparse, locality (sparse prefill against selection overlap), "
                       "kvmajor (memory floor of a KV-major sparse prefill), dense, decode")
  ap.add_argument("--locality-private", default=f"0,1,2,4,7,{TOPK - 2}", metavar="N,N",
                  help="private blocks per query of the locality sweep's selections")
  ap.add_argument("--kv-panels", default="", metavar="N,N",
                  help="also time the tuned KV-major kernel with work items ordered by panels of N queries")
  ap.add_argument("--only", default=None, metavar="REGEX",
                  help="keep only the variants whose name matches (the two defaults always run)")
  ap.add_argument("--selections", default=None, metavar="F.npz",
                  help="also time sparse prefill on saved selections (m3jax forward --save-selections)")
  args = ap.parse_args()
  global INTERPRET
  INTERPRET = args.interpret
  bench_common.DRY_RUN = INTERPRET  # one call per measurement (see timed)
  sizes = [int(x) for x in args.sizes.split(",") if x]
  saved = load_selections(args.selections) if args.selections else {}  # bad files fail before any work
  print(jax.devices(), flush=True)
  ceilings()
  bw = next((r["value"] for r in ROWS if r.get("what", "").startswith("copy")), 3000.0)
  variants = [  # the first is the default (the next one or KV-major, by prefers_kv_major), the second the
      # query-major prefill default (heuristic_block_sizes)
      ("default (query-major Q=8 or KV-major, chosen on the device)", None),
      ("Q=8 2 compute WGs stages=2, no ping-pong",
       SparseAttentionBlockSizes(queries_per_tile=8, kv_stages=2, compute_wgs=2, ping_pong="off")),
      ("Q=8 2 WGs, ping-pong on every entry",
       SparseAttentionBlockSizes(queries_per_tile=8, kv_stages=2, compute_wgs=2, ping_pong="every")),
      ("Q=4 stages=1", SparseAttentionBlockSizes(queries_per_tile=4, kv_stages=1)),
      ("Q=4 stages=2", SparseAttentionBlockSizes(queries_per_tile=4, kv_stages=2)),
      ("Q=2 stages=1", SparseAttentionBlockSizes(queries_per_tile=2, kv_stages=1)),
      ("Q=1 stages=1", SparseAttentionBlockSizes(queries_per_tile=1, kv_stages=1)),
  ]
  kv_major = [(f"KV-major, {c} chunks per CTA, output staged in {where}",
               KvMajorBlockSizes(chunks_per_item=c, output_staging=where))
              for c, where in ((8, "q_buffer"), (8, "separate"), (8, "halves"), (8, "registers"), (8, "q_buffer_one_store"), (16, "q_buffer"))]
  kv_major += [(f"KV-major, {c} chunks per CTA, {w} warpgroups, output staged in {where}",
                KvMajorBlockSizes(chunks_per_item=c, compute_wgs=w, output_staging=where))
               for c, w, where in ((36, 3, "separate_one_store"), (24, 3, "q_buffer_one_store"), (24, 3, "q_buffer"))]
  kv_major += [(f"KV-major tuned (kv_major_block_sizes), panels of {n} queries",
                dataclasses.replace(kv_major_block_sizes(NQ // NKV), query_panel=n))
               for n in map(int, filter(None, args.kv_panels.split(",")))]
  if args.only:  # the defaults stay first: the locality sweep and saved selections use variants[:2]
    keep = re.compile(args.only)
    variants = variants[:2] + [v for v in variants[2:] if keep.search(v[0])]
    kv_major = [v for v in kv_major if keep.search(v[0])] or kv_major[:1]
  if INTERPRET:  # the one-warpgroup kernel, as the heuristic picks when interpreting (see its docstring)
    variants = [v for v in variants if v[1] is not None and v[1].compute_wgs == 1][:1]
    kv_major = kv_major[:1]
  sections = set(args.sections.split(","))
  for s in sizes:
    with_ref = s <= 40000 or not args.quick
    if "indexer" in sections:
      indexer_prefill(s, with_ref)
    if "sparse" in sections:
      few = variants[:4] if args.quick else variants
      sparse_prefill(s, False, with_ref, (variants[:4] if s > 40000 else few) + kv_major)
      sparse_prefill(s, True, False, (few if args.quick or INTERPRET else variants[:4] + variants[5:]) + kv_major)
    if "locality" in sections:
      locality_sweep(s, with_ref, ([variants[0], variants[1]] + kv_major)[:1 if INTERPRET else None],
                     [int(x) for x in args.locality_private.split(",")])
    if "kvmajor" in sections:
      kv_major_floor(s)
    if "dense" in sections and (s <= 40000 or not args.quick):
      dense_prefill(s, s <= 40000)
  for name, ids in saved.items():
    sparse_prefill_on(ids, f"saved {name}", True, variants[:4] + kv_major[:1])
  for case in filter(None, args.decode.split(",") if "decode" in sections else []):
    b, s = map(int, case.split("x"))
    decode(b, s, bw)
  md = table()
  print(md)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "bench_attention.md").write_text(md + "\n")
  (out / "bench_attention.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
  main()
