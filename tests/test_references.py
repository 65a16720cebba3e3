"""The pure-jnp references: indexer selection contract, sparse == dense identity, MoE dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.reference import causal_attention_reference, sparse_attention_reference
from pallas_kernels.indexer.reference import indexer_topk_reference
from pallas_kernels.moe.reference import moe_block_reference, route_reference, swiglu_oai


def _block_valued_keys(block_values, block_size):
  """idx_k [1, S, 2] whose score against q=[1, 0] is block_values[j // block_size] for every key j."""
  vals = np.repeat(np.asarray(block_values, np.float32), block_size)
  return jnp.asarray(np.stack([vals, np.zeros_like(vals)], -1)[None])


def _select(idx_k, positions, **kw):
  q = jnp.tile(jnp.asarray([1.0, 0.0]), (1, len(positions), 1, 1))
  pos = jnp.asarray(positions, jnp.int32)[None]
  return np.asarray(indexer_topk_reference(q, idx_k, pos, block_size=4, chunk_size=2, **kw))[0, :, 0]


def _as_sets(rows):
  return [set(int(x) for x in r if x >= 0) for r in rows]


@pytest.mark.quick
def test_selection_hand_checked_local_and_init_blocks():
  # block scores: b0 0.1, b1 0.9, b2 0.5, b3 0.7, b4 0.2; block size 4, 20 keys.
  k = _block_valued_keys([0.1, 0.9, 0.5, 0.7, 0.2], 4)
  positions = [2, 5, 19]
  assert _as_sets(_select(k, positions, topk=2, local_blocks=1)) == [{0}, {0, 1}, {4, 1}]
  # vLLM-only sparse_init_block (HF drops it): block 0 is forced in as well.
  assert _as_sets(_select(k, positions, topk=2, local_blocks=1, init_blocks=1)) == [{0}, {0, 1}, {4, 0}]
  assert _as_sets(_select(k, positions, topk=3, local_blocks=1, init_blocks=1)) == [{0}, {0, 1}, {4, 0, 1}]
  assert _as_sets(_select(k, positions, topk=2, local_blocks=2)) == [{0}, {0, 1}, {4, 3}]
  # Left-packed with -1 padding, exactly min(topk, qb + 1) entries.
  rows = _select(k, positions, topk=3, local_blocks=1)
  assert rows[0].tolist()[1:] == [-1, -1] and rows[1].tolist()[2] == -1 and (rows[2] >= 0).all()


@pytest.mark.quick
def test_token_level_causal_mask_applies_before_block_max():
  # Block 2 holds keys 8..11: visible keys 8, 9 score 0.05, future keys 10, 11 score 5.0.
  vals = np.array([0.1] * 4 + [0.9] * 4 + [0.05, 0.05, 5.0, 5.0], np.float32)
  k = jnp.asarray(np.stack([vals, np.zeros_like(vals)], -1)[None])
  assert _as_sets(_select(k, [9], topk=2, local_blocks=0)) == [{1, 0}]
  assert _as_sets(_select(k, [11], topk=2, local_blocks=0)) == [{2, 1}]


def test_selection_contract_on_random_inputs():
  b, s, hi, di, bs, topk = 2, 150, 2, 8, 16, 3
  keys = jax.random.split(jax.random.key(0), 3)
  idx_q = jax.random.normal(keys[0], (b, s, hi, di))
  idx_k = jax.random.normal(keys[1], (b, s, di))
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  ids = np.asarray(indexer_topk_reference(idx_q, idx_k, pos, block_size=bs, topk=topk, local_blocks=2))
  ids_other_chunk = indexer_topk_reference(idx_q, idx_k, pos, block_size=bs, topk=topk, local_blocks=2,
                                           chunk_size=7)
  np.testing.assert_array_equal(ids, ids_other_chunk)
  for p in range(s):
    qb = p // bs
    for row in ids[:, p].reshape(-1, topk):
      valid = row[row >= 0]
      assert len(valid) == min(topk, qb + 1)
      assert (row[len(valid):] == -1).all(), "left-packed"
      assert len(set(valid.tolist())) == len(valid), "no duplicates"
      assert valid.max() <= qb and qb in valid and (qb == 0 or qb - 1 in valid)


def _qkv(b, s, nq, nkv, d, dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(k[0], (b, s, nq, d), dtype), jax.random.normal(k[1], (b, s, nkv, d), dtype),
          jax.random.normal(k[2], (b, s, nkv, d), dtype))


def test_sparse_attention_equals_dense_below_topk_times_block_size():
  b, s, bs, topk = 2, 100, 16, 3
  q, k, v = _qkv(b, s, 4, 2, 16)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  idx = jax.random.normal(jax.random.key(3), (b, s, 2, 8))
  ids = indexer_topk_reference(idx, jax.random.normal(jax.random.key(4), (b, s, 8)), pos, block_size=bs,
                               topk=topk, local_blocks=1)
  sparse = sparse_attention_reference(q, k, v, ids, pos, block_size=bs, scale=0.25, chunk_size=32)
  dense = causal_attention_reference(q, k, v, pos, scale=0.25, chunk_size=32)
  np.testing.assert_allclose(sparse[:, :topk * bs], dense[:, :topk * bs], rtol=1e-6, atol=1e-6)
  assert float(jnp.abs(sparse[:, topk * bs:] - dense[:, topk * bs:]).max()) > 1e-2  # blocks really pruned


def test_sparse_attention_matches_explicit_gather():
  b, s, bs = 1, 40, 8
  q, k, v = _qkv(b, s, 4, 2, 8, seed=5)
  ids = np.full((b, s, 2, 2), -1, np.int32)
  ids[0, 30, 0] = [3, 1]  # group 0 of query 30 sees blocks 3 (keys 24..30 causal) and 1 (8..15)
  ids[0, 30, 1] = [0, -1]
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  out = sparse_attention_reference(q, k, v, jnp.asarray(ids), pos, block_size=bs, scale=0.5)
  for head in range(4):
    g = head // 2
    keys = list(range(24, 31)) + list(range(8, 16)) if g == 0 else list(range(0, 8))
    logits = (q[0, 30, head] @ k[0, keys, g].T) * 0.5
    expect = jax.nn.softmax(logits) @ v[0, keys, g]
    np.testing.assert_allclose(out[0, 30, head], expect, rtol=1e-5, atol=1e-6)


def test_causal_attention_with_offset_positions_reads_only_the_past():
  q, k, v = _qkv(2, 24, 4, 2, 8, seed=7)
  full = causal_attention_reference(q, k, v, jnp.broadcast_to(jnp.arange(24), (2, 24)), scale=0.3)
  # Queries 20..23 against the same 24 cached keys (the decode / chunked-prefill case).
  part = causal_attention_reference(q[:, 20:], k, v, jnp.broadcast_to(jnp.arange(20, 24), (2, 4)), scale=0.3)
  np.testing.assert_allclose(part, full[:, 20:], rtol=1e-6, atol=1e-6)


@pytest.mark.quick
def test_swiglu_oai_clamps():
  gate_up = jnp.asarray([[-20.0, 10.0, -20.0, 10.0]])  # gates (-20, 10), ups (-20, 10)
  out = np.asarray(swiglu_oai(gate_up, alpha=1.702, limit=7.0))[0]
  g = np.array([-20.0, 7.0])  # gate: no lower clamp, upper clamp at 7
  u = np.array([-7.0, 7.0])
  np.testing.assert_allclose(out, (u + 1) * g / (1 + np.exp(-1.702 * g)), rtol=1e-6)


def _naive_moe(x, router_w, bias, w_gu, w_d, s_gu, s_d, top_k, scale):
  logits = x @ router_w
  s = 1 / (1 + np.exp(-logits))
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    chosen = np.argsort(-(s[t] + bias), kind="stable")[:top_k]
    w = s[t, chosen] / s[t, chosen].sum()
    for e, we in zip(chosen, w):
      out[t] += scale * we * (np.asarray(swiglu_oai(x[t] @ w_gu[e], alpha=1.702, limit=7.0)) @ w_d[e])
  return out + np.asarray(swiglu_oai(x @ s_gu, alpha=1.702, limit=7.0)) @ s_d


@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.quick
def test_moe_reference_matches_a_per_token_loop(tokens):
  h, e, i, k = 16, 6, 8, 2
  r = np.random.default_rng(0)
  x = r.normal(size=(tokens, h)).astype(np.float32)
  args = [r.normal(size=(h, e)).astype(np.float32), r.uniform(-0.3, 0.3, size=e).astype(np.float32),
          r.normal(size=(e, h, 2 * i)).astype(np.float32) * 0.5, r.normal(size=(e, i, h)).astype(np.float32) * 0.5,
          r.normal(size=(h, 2 * i)).astype(np.float32) * 0.5, r.normal(size=(i, h)).astype(np.float32) * 0.5]
  got = moe_block_reference(jnp.asarray(x), *map(jnp.asarray, args), top_k=k, routed_scaling_factor=2.0,
                            swiglu_alpha=1.702, swiglu_limit=7.0)
  np.testing.assert_allclose(got, _naive_moe(x, *args, k, 2.0), rtol=2e-5, atol=2e-5)


@pytest.mark.quick
def test_routing_bias_changes_selection_but_not_weights():
  x = jnp.ones((1, 4))
  router = jnp.asarray(np.diag([1.0, 2.0, 3.0, 4.0]).astype(np.float32))  # logits 1, 2, 3, 4
  w0, ids0, _ = route_reference(x, router, jnp.zeros(4), top_k=2)
  w1, ids1, _ = route_reference(x, router, jnp.asarray([5.0, 0, 0, 0]), top_k=2)
  assert set(np.asarray(ids0[0]).tolist()) == {3, 2} and set(np.asarray(ids1[0]).tolist()) == {0, 3}
  s = 1 / (1 + np.exp(-np.array([1.0, 4.0])))
  np.testing.assert_allclose(sorted(np.asarray(w1[0])), sorted(s / s.sum()), rtol=1e-6)
