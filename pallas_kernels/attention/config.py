"""Tile sizes for the block-sparse / dense GQA attention kernel (Hopper, Mosaic GPU) and a heuristic."""

from __future__ import annotations

import dataclasses

ROWS_PER_TILE = 64  # one wgmma M group: queries_per_tile x heads_per_group rows (4 x 16 for M3)
KEY_BLOCK = 128
SMEM_LIMIT_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SparseAttentionBlockSizes:
  """Knobs of one attention launch.

  queries_per_tile: consecutive queries whose heads of one KV group share a CTA (the wgmma M rows are
    queries_per_tile x heads_per_group <= 64). The CTA walks the union of their selected blocks; a
    query masks the blocks it did not select. 1 = strictly one query's own blocks.
  kv_stages: TMA pipeline depth over key blocks (each stage holds one K and one V block).
  num_splits: CTAs per (tile, KV group) along the block list (flash-decoding); partial outputs are
    merged with their log-sum-exp outside the kernel.
  p_in_smem: stage P through shared memory for the P.V wgmma instead of keeping it in registers
    (None: only in interpret mode, which requires it).
  compute_wgs: 1 = one warpgroup per CTA loads and computes (kernel_sm90.py); 2 = warp-specialized
    (kernel_sm90_ws.py): a TMA warpgroup streams the tile's block list to two compute warpgroups, each
    owning queries_per_tile / 2 queries (64 wgmma rows), which skip the blocks none of their queries
    use. Two warpgroups double the wgmma rows fed by each K/V load. Prefill only (num_splits == 1).
  ping_pong: how the two compute warpgroups of compute_wgs=2 take turns on the tensor cores
    (FlashAttention-3's schedule barrier): "every" = a rendezvous on every list entry (a warpgroup that
    skips an entry still takes its turns); "off" = never. Results do not depend on it. Pairing only on
    the entries both warpgroups use deadlocks (measured on the H200): the warpgroup ahead waits at its
    next shared entry for a K/V load whose pipeline slot the warpgroup behind still holds while it waits
    at the rendezvous, whenever two shared entries are >= kv_stages apart.
  """

  queries_per_tile: int = 4
  kv_stages: int = 2
  num_splits: int = 1
  p_in_smem: bool | None = None
  compute_wgs: int = 1
  ping_pong: str = "every"

  def __post_init__(self):
    if self.queries_per_tile < 1:
      raise ValueError(f"queries_per_tile must be >= 1, got {self.queries_per_tile}")
    if not 1 <= self.kv_stages <= 8:
      raise ValueError(f"kv_stages must be in [1, 8], got {self.kv_stages}")
    if self.num_splits < 1:
      raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
    if self.compute_wgs not in (1, 2):
      raise ValueError(f"compute_wgs must be 1 or 2, got {self.compute_wgs}")
    if self.ping_pong not in ("every", "off"):
      raise ValueError(f"ping_pong must be 'every' or 'off', got {self.ping_pong!r}")
    if self.compute_wgs == 2 and (self.num_splits != 1 or self.queries_per_tile % 2):
      raise ValueError(f"compute_wgs=2 needs num_splits=1 and an even queries_per_tile, got {self}")

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    """Query/output tiles + K and V stages + per-row vectors (+ the P tiles when staged in smem)."""
    rows = self.compute_wgs * ROWS_PER_TILE
    p_tile = rows * KEY_BLOCK * itemsize if self.p_in_smem else 0
    # + 4 KB for barriers and the 1 KB alignment of swizzled buffers (measured: 2 warpgroups, 3 stages,
    # D = 128 allocate 233536 B against 230912 B of buffers)
    return (rows + 2 * self.kv_stages * KEY_BLOCK) * head_dim * itemsize + 3 * rows * 4 + p_tile + 4096


def one_warpgroup_queries_per_tile(heads_per_group: int, num_queries: int) -> int:
  """Queries per tile heuristic_block_sizes gives the one-warpgroup kernel (decode, short query counts):
  up to 4, as many as fit one 64-row wgmma group, at most num_queries."""
  return max(1, min(4, ROWS_PER_TILE // heads_per_group, num_queries))


def heuristic_block_sizes(
    batch: int, num_queries: int, num_kv_heads: int, heads_per_group: int, list_len: int, *,
    num_sms: int = 132, warp_specialized: bool = True, sparse: bool = True,
) -> SparseAttentionBlockSizes:
  """Prefill (at least one CTA per SM): the warp-specialized kernel, two compute warpgroups of
  64 // heads_per_group queries each (8-query tiles for M3), 2 stages. Measured on the H200 at 32K (M3
  dims): dense causal plan 589 vs 448 TFLOP/s for the one-warpgroup kernel; sparse with correlated
  selections 8.3 vs 8.8 ms; with uncorrelated selections 14.1 vs 13.4 ms (both bound by K/V loads).
  The ping-pong (ping_pong="every") helps the dense plan, whose two warpgroups use nearly every block
  (574.9 vs 557.9 TFLOP/s without), and hurts sparse lists, where a warpgroup that skips an entry would
  wait for its partner's turns: sparse plans (sparse=True) run without it (32K: 12.87 vs 14.09 ms on
  uncorrelated selections, 7.86 vs 8.25 ms on correlated ones; 128K: 71.5 vs 76.9 and 38.7 vs 40.4).

  Decode / short query counts: one warpgroup, up to 4 queries per tile, the block list split so that
  about two CTAs per SM are launched (every split streams distinct K/V blocks: the op is bandwidth-bound
  there) with a deeper pipeline.

  warp_specialized=False (the GPU interpreter) keeps the one-warpgroup kernel: the interpreter runs each
  simulated warpgroup as its own XLA computation and deadlocked intermittently on a 2-core CPU when many
  warp-specialized CTAs (132, a 528-token model prefill) waited on each other's barriers.
  """
  per_wg = max(1, ROWS_PER_TILE // heads_per_group)
  if warp_specialized and num_queries >= 2 * per_wg and batch * num_kv_heads * -(-num_queries // (2 * per_wg)) >= num_sms:
    return SparseAttentionBlockSizes(
        queries_per_tile=2 * per_wg, kv_stages=2, compute_wgs=2, ping_pong="off" if sparse else "every"
    )
  per_tile = one_warpgroup_queries_per_tile(heads_per_group, num_queries)
  ctas = batch * num_kv_heads * -(-num_queries // per_tile)
  if ctas >= num_sms:
    return SparseAttentionBlockSizes(queries_per_tile=per_tile, kv_stages=1, num_splits=1)
  splits = max(1, min(-(-2 * num_sms // ctas), list_len))
  return SparseAttentionBlockSizes(queries_per_tile=per_tile, kv_stages=3, num_splits=splits)


_STAGINGS = ("q_buffer", "q_buffer_one_store", "separate", "separate_one_store", "halves", "registers")
# Stagings whose partial outputs are laid out by (item, chunk) (KvMajorPlan.pair_slab maps them to the pairs).
CHUNK_LAYOUT_STAGINGS = ("registers", "q_buffer_one_store", "separate_one_store")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KvMajorBlockSizes:
  """Knobs of the KV-major sparse prefill (kernel_sm90_kv_major.py): the other loop order, for selections
  that adjacent queries do not share.

  A CTA owns one selected key block of one KV group and up to chunks_per_item chunks of the queries that
  selected it; a chunk is 64 // heads_per_group queries (64 wgmma rows: 4 for M3), so every row of every
  wgmma is a (query, block) pair that was selected, and each K/V block is loaded once per item instead of
  once per query tile that touches it. The price: a partial output per (query, group, selected block),
  written and merged with its log-sum-exp outside the kernel.

  chunks_per_item: query chunks per CTA (K/V reuse inside the CTA).
  output_staging: where a chunk's output waits in shared memory for its stores to global memory, which
    sets how early the next chunks' queries can load (two query buffers in every mode):
    "q_buffer": in the chunk's own query buffer (96 KB per CTA, two CTAs per SM); the next chunk's queries
      load while this chunk computes (one chunk ahead), after the previous chunk's stores have left.
    "separate": in a [64, D] buffer (112 KB per CTA: one CTA per SM); loads as "q_buffer".
    "halves": in a [64, 64] buffer, the output's column halves one after the other (104 KB per CTA, two
      CTAs per SM); a query buffer is refilled as soon as S = QK^T has read it, so the queries of two chunks
      load while one computes. Needs D % 64 == 0.
    "q_buffer_one_store": as "q_buffer", but the chunk's output leaves in one [64, D] store (and its
      log-sum-exps in one [64] store) into its own rows of a partial buffer laid out by (item, chunk), as
      with "registers", instead of one store per query into the (query, group, slot) layout. Needs heads
      per group dividing 64.
    "separate_one_store": in a [64, D] buffer of its own per warpgroup, leaving in one store into the
      (item, chunk) layout as "q_buffer_one_store"; a query buffer is refilled right after S = QK^T (two
      chunks of the warpgroup ahead), as with "halves". 112 KB per CTA with one warpgroup (one CTA per SM),
      208 KB with three. Needs heads per group dividing 64.
    "registers": none: each thread stores its part of the chunk's output and log-sum-exp straight from
      registers to global memory, into the chunk's own rows of a partial buffer laid out by (item, chunk)
      (no shared-memory staging, no TMA store to wait for; the merge gathers each pair's rows back). Query
      buffers are refilled as with "halves" (96 KB per CTA). Needs heads per group (padded to a multiple of 8)
      dividing 64.
    Measured on an H100 (M3 dims, random selections): kernel 6.75 ("q_buffer") vs 9.85 ms ("separate") at
    32K, 27.8 vs 40.1 ms at 128K; "halves" 1.85 vs 1.73 ms per pass of 8192 queries for "q_buffer" (+7 %:
    early query loads do not pay for the second round of output stores); "registers" 2.15-2.45 ms per pass
    (slower), "q_buffer_one_store" 1.53; with 3 warpgroups and 36 chunks "separate_one_store" 1.34 (the
    tuned default, kv_major_block_sizes).
  compute_wgs: warpgroups per CTA, sharing the block's K and V, each taking every W-th chunk of the item
    with its own two query buffers (W = 1: 96 KB per CTA with "q_buffer", two CTAs per SM; W = 3: 160 KB,
    one CTA per SM running three chunks at a time).
  query_chunk: at most this many queries (over the batch) per pass: the partial outputs of a pass take
    query_chunk x KV groups x T x heads per group x D x 2 B (8192 queries of M3: 2.1 GB); longer prefills
    run in several passes.
  query_panel: order the work items by panels of this many consecutive queries of a sequence, then by
    block (None: by block over the whole pass). CTAs running together then gather the Q rows of one panel,
    which stay in L2, at the cost of loading each block's K/V once per panel that selects it.
  """

  chunks_per_item: int = 8
  output_staging: str = "q_buffer"
  compute_wgs: int = 1
  query_chunk: int = 8192
  query_panel: int | None = None

  def __post_init__(self):
    if not 1 <= self.chunks_per_item <= 64:
      raise ValueError(f"chunks_per_item must be in [1, 64], got {self.chunks_per_item}")
    if self.output_staging not in _STAGINGS:
      raise ValueError(f"output_staging must be one of {_STAGINGS}, got {self.output_staging!r}")
    if self.query_chunk < 1:
      raise ValueError(f"query_chunk must be >= 1, got {self.query_chunk}")
    if not 1 <= self.compute_wgs <= 4:
      raise ValueError(f"compute_wgs must be in [1, 4], got {self.compute_wgs}")
    if self.query_panel is not None and self.query_panel < 1:
      raise ValueError(f"query_panel must be >= 1 or None, got {self.query_panel}")

  def output_buffer_columns(self, head_dim: int) -> int | None:
    """Columns of each warpgroup's [64, columns] output staging buffer; None: the staging has none."""
    return {"separate": head_dim, "separate_one_store": head_dim, "halves": 64}.get(self.output_staging)

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    """K and V of the block + per warpgroup: two query buffers, their row limits, the output staging buffer
    and the log-sum-exps (+ 4 KB for barriers and the alignment of swizzled buffers, as
    SparseAttentionBlockSizes.smem_bytes)."""
    staging_cols = self.output_buffer_columns(head_dim) or 0
    lse = 0 if self.output_staging == "registers" else ROWS_PER_TILE * 4
    per_wg = (2 * head_dim + staging_cols) * ROWS_PER_TILE * itemsize + 2 * ROWS_PER_TILE * 4 + lse
    return 2 * KEY_BLOCK * head_dim * itemsize + self.compute_wgs * per_wg + 4096


def kv_major_block_sizes(heads_per_group: int) -> KvMajorBlockSizes:
  """The KV-major prefill's tuned knobs (sparse_attention's default when it picks this loop order).

  heads_per_group: as the kernel runs them (a multiple of 8). Where it divides 64: three warpgroups per CTA,
  items of 36 chunks, each chunk's output leaving in one store from a buffer of its own
  ("separate_one_store"); measured on an H100 (M3 dims, 32K, random selections, scripts/profile_kv_major.py):
  kernel 1.34 ms per pass of 8192 queries against 1.74 for KvMajorBlockSizes() (one warpgroup, 8 chunks,
  "q_buffer"), 1.43 with "q_buffer_one_store" and 24 chunks, 1.60 with "q_buffer" and 24 chunks. Otherwise
  (24, 40, 48 or 56 heads: a chunk's rows are not whole slabs of a per-chunk layout) KvMajorBlockSizes().
  """
  if ROWS_PER_TILE % heads_per_group:
    return KvMajorBlockSizes()
  return KvMajorBlockSizes(chunks_per_item=36, output_staging="separate_one_store", compute_wgs=3)

