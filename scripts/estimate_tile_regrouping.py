"""How much reordering queries into kernel tiles would shrink the sparse prefill's block unions (CPU, numpy).

The sparse attention prefill kernel gives each warpgroup 4 consecutive queries and walks the union of their
selected blocks (BENCHMARKS.md, "Sparse prefill against selection locality"). This script measures the mean
per-warpgroup union on the last --queries queries of an --size-token prefill under four groupings:
consecutive (what the kernel does), the best 4 + 4 split of each 8-query tile, a greedy grouping within
64-query windows, and a sort of each window by MinHash keys of the block sets. It also prices two bounds on
other kernels (per-block packing of users, and hybrid_*: 64-row steps for shared blocks plus 16-wide steps
at --singleton-cost for blocks one query uses) in 64-row steps per 4 queries.

  PYTHONPATH=$PWD JAX_PLATFORMS=cpu python scripts/estimate_tile_regrouping.py [--size 16384] [--queries 2048]

Prints one JSON line per selection kind (random / correlated indexer selections, window-shared selections).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_attention import BLOCK, TOPK, index_inputs, window_shared_selections  # noqa: E402

from pallas_kernels.indexer import indexer_topk_reference  # noqa: E402

GROUP = 4  # queries per warpgroup
WINDOW = 64
# Time of a transposed 16-wide wgmma step over a 64-row step (scripts/bench_row_tile.py, wgmmaT32r on the H200;
# BENCHMARKS.md, "Transposed 16-row tiles").
SINGLETON_COST = 0.695


def block_sets(ids: np.ndarray, num_blocks: int) -> np.ndarray:
  """ids int [N, G, T] (-1 = empty) -> bool [N, G, num_blocks] membership."""
  member = np.zeros(ids.shape[:2] + (num_blocks + 1,), bool)
  np.put_along_axis(member, np.where(ids >= 0, ids, num_blocks), True, axis=-1)
  return member[..., :num_blocks]


def group_users(member: np.ndarray, order: np.ndarray) -> np.ndarray:
  """int [N / GROUP, G, nb]: how many of each consecutive GROUP-query group's queries (after reordering
  queries by order [G, N]) use each block."""
  n, g, nb = member.shape
  regrouped = np.stack([member[order[j], j] for j in range(g)], 1)  # [N, G, nb]
  return regrouped.reshape(n // GROUP, GROUP, g, nb).sum(1)


def mean_union(users: np.ndarray) -> float:
  """Mean union size of the groups of group_users."""
  return float((users > 0).sum(-1).mean())


def single_user_blocks(users: np.ndarray) -> float:
  """Mean number of blocks in a group's union that only one of its GROUP queries uses (each costs a full
  64-row wgmma step for 16 useful rows)."""
  return float((users == 1).sum(-1).mean())


def hybrid_steps(users: np.ndarray, singleton_cost: float) -> float:
  """Mean work per GROUP-query group, in 64-row steps, for a kernel that spends a 64-row step on each block
  2+ of the group's queries use and a 16-wide step costing `singleton_cost` on each block only one uses."""
  return float(((users >= 2).sum(-1) + singleton_cost * (users == 1).sum(-1)).mean())


def best_split_union(member: np.ndarray) -> float:
  """Mean per-group union when each 8-query tile is split into the best two groups of 4."""
  n, g, nb = member.shape
  tiles = member.reshape(n // 8, 8, g, nb)
  best = None
  for first in (c for c in itertools.combinations(range(8), GROUP) if 0 in c):
    rest = [i for i in range(8) if i not in first]
    total = tiles[:, list(first)].any(1).sum(-1) + tiles[:, rest].any(1).sum(-1)
    best = total if best is None else np.minimum(best, total)
  return float(best.mean() / 2)


def greedy_order(member: np.ndarray) -> np.ndarray:
  """[G, N]: within each window, repeatedly start a group at the first free query and add the GROUP - 1
  queries that grow the group's union least."""
  n, g, _ = member.shape
  order = np.empty((g, n), np.int64)
  for j in range(g):
    out = []
    for start in range(0, n, WINDOW):
      free = list(range(start, min(start + WINDOW, n)))
      while free:
        group = [free.pop(0)]
        union = member[group[0], j].copy()
        for _ in range(GROUP - 1):
          grown = [int((union | member[i, j]).sum()) for i in free]
          pick = free.pop(int(np.argmin(grown)))
          group.append(pick)
          union |= member[pick, j]
        out += group
    order[j] = out
  return order


def minhash_order(member: np.ndarray, keys: int = 2, seed: int = 0) -> np.ndarray:
  """[G, N]: within each window, queries sorted by `keys` MinHash values of their block sets."""
  n, g, nb = member.shape
  rng = np.random.default_rng(seed)
  ranks = [rng.permutation(nb) for _ in range(keys)]
  window = np.arange(n) // WINDOW
  order = np.empty((g, n), np.int64)
  for j in range(g):
    hashes = [np.where(member[:, j], r, nb).min(-1) for r in ranks]
    order[j] = np.lexsort(tuple(reversed([window] + hashes)))
  return order


def per_block_packing(member: np.ndarray, window: int) -> float:
  """Work per GROUP queries (in 64-row steps) if, within each `window` queries, every block's users were
  packed GROUP at a time into its own steps: sum over blocks of ceil(users / GROUP), times GROUP / window.
  The bound of any grouping inside a window, but it needs per-step gathers of Q and O rows."""
  n, g, nb = member.shape
  users = member.reshape(n // window, window, g, nb).sum(1)
  return float(np.ceil(users / GROUP).sum(-1).mean() * GROUP / window)


def estimate(ids: np.ndarray, num_blocks: int, singleton_cost: float = SINGLETON_COST) -> dict[str, float]:
  member = block_sets(ids, num_blocks)
  n, g, _ = member.shape
  consecutive = group_users(member, np.broadcast_to(np.arange(n), (g, n)))
  greedy = group_users(member, greedy_order(member))
  return {
      "consecutive": round(mean_union(consecutive), 2),
      "single_user_blocks": round(single_user_blocks(consecutive), 2),
      "best_split_of_8": round(best_split_union(member), 2),
      "greedy_64_window": round(mean_union(greedy), 2),
      "minhash_sort_64_window": round(mean_union(group_users(member, minhash_order(member))), 2),
      "per_block_packing_16": round(per_block_packing(member, 16), 2),
      "per_block_packing_64": round(per_block_packing(member, WINDOW), 2),
      "hybrid_consecutive": round(hybrid_steps(consecutive, singleton_cost), 2),
      "hybrid_greedy_64_window": round(hybrid_steps(greedy, singleton_cost), 2),
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--size", type=int, default=16384, help="prefill length (tokens)")
  ap.add_argument("--queries", type=int, default=2048, help="last queries to group (a multiple of 64)")
  ap.add_argument("--singleton-cost", type=float, default=SINGLETON_COST,
                  help="time of a 16-wide step over a 64-row step, for the hybrid_* columns")
  args = ap.parse_args()
  s, n = args.size, args.queries
  if n % WINDOW or not 0 < n <= s:
    raise SystemExit(f"--queries must be a positive multiple of {WINDOW} and <= --size; got {n}, {s}")
  num_blocks = -(-s // BLOCK)
  for correlated in (False, True):
    idx_q, idx_k = index_inputs(1, s, correlated)
    pos = jnp.arange(s - n, s, dtype=jnp.int32)[None]
    ids = indexer_topk_reference(idx_q[:, s - n:], idx_k, pos, block_size=BLOCK, topk=TOPK, local_blocks=1)
    name = "correlated indexer" if correlated else "random indexer"
    print(json.dumps({"selection": name, **estimate(np.asarray(ids)[0], num_blocks, args.singleton_cost)}), flush=True)
  for replaced in (1, 2, 4):
    ids = np.asarray(window_shared_selections(s, replaced))[0, s - n:]
    row = {"selection": f"window-shared, {replaced} private", **estimate(ids, num_blocks, args.singleton_cost)}
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
