"""Does XLA's lax.top_k agree with a full sort on the GPU for the selection's inputs?

BENCHMARKS.md records a wrong 128K, B = 1 decode (rel L2 1.36) when the indexer's selection ran lax.top_k on
the kernel's block scores (XLA:GPU lowers k <= 16 over >= 1024 entries to its __gpu$TopK kernel), and exact
ids with lax.sort. This script isolates it: block scores shaped like a decode step ([B, 1, 4, nb] fp32),
with the selection's special values (+inf on forced blocks, -inf on blocks past the query, ties), go through
lax.top_k and through a descending lax.sort; it reports, per case, how many rows select a different set of
ids (ties broken by the lower id in both, so sets must match exactly) and whether the values differ.

  PYTHONPATH=$PWD JAX_PLATFORMS=cuda python3 scripts/check_xla_topk.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np


def sorted_topk(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """lax.top_k's contract by a full sort: descending values, ties to the lower index."""
  idx = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
  neg, ids = jax.lax.sort((-x, idx), dimension=x.ndim - 1, num_keys=2)
  return -neg[..., :k], ids[..., :k]


def make_case(kind: str, b: int, nb: int, seed: int) -> np.ndarray:
  """fp32 [b, 1, 4, nb] block scores of one decode step."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((b, 1, 4, nb)).astype(np.float32)
  if kind == "finite":
    return x
  pos = rng.integers(nb // 2, nb, size=b)  # each row's query block; blocks after it are invalid
  blk = np.arange(nb)
  valid = blk[None, :] <= pos[:, None]  # [b, nb]
  if kind in ("masked", "forced_masked"):
    x = np.where(valid[:, None, None, :], x, -np.inf)
  if kind in ("forced", "forced_masked"):
    forced = (blk[None, :] == pos[:, None]) | (blk[None, :] < 1)
    x = np.where(forced[:, None, None, :], np.inf, x)
  if kind == "ties":
    x = np.round(x * 2) / 2  # many equal values
  if kind == "short":  # fewer valid blocks than k: -inf fill inside the top k
    x[..., 10:] = -np.inf
  return x.astype(np.float32)


def check(kind: str, b: int, nb: int, k: int) -> dict:
  x = jnp.asarray(make_case(kind, b, nb, seed=b * 7919 + nb))
  top_k = jax.jit(lambda a: jax.lax.top_k(a, k)).lower(x).compile()
  tv, ti = top_k(x)
  sv, si = jax.jit(lambda a: sorted_topk(a, k))(x)
  tv, ti, sv, si = map(np.asarray, (tv, ti, sv, si))
  values_differ = ~np.all(np.isclose(tv, sv, equal_nan=True), axis=-1)  # isclose(inf, inf) is True
  same_sets = np.array([set(a) == set(c) for a, c in zip(ti.reshape(-1, k), si.reshape(-1, k))])
  hlo = top_k.as_text()
  return {"kind": kind, "b": b, "nb": nb, "k": k, "rows": int(same_sets.size),
          "rows_with_other_ids": int((~same_sets).sum()), "rows_with_other_values": int(values_differ.sum()),
          "gpu_topk_kernel": "__gpu$TopK" in hlo}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  rows = []
  for nb in (256, 1024, 2048):
    for b in (1, 32):
      for kind in ("finite", "masked", "forced", "forced_masked", "ties", "short"):
        r = check(kind, b, nb, 16)
        rows.append(r)
        print(json.dumps(r), flush=True)
  # sampling's use: k of a vocabulary
  for k in (1, 16, 50):
    r = check("finite", 4, 200064, k)
    rows.append(r)
    print(json.dumps(r), flush=True)
  bad = [r for r in rows if r["rows_with_other_ids"] or r["rows_with_other_values"]]
  print(json.dumps({"cases": len(rows), "cases_with_differences": len(bad), "device": str(jax.devices()[0])}))
  if args.out:
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(args.out) / "xla_topk.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
