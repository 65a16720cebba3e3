"""Research API: intermediates recorded on request (jit-compatible), consistent with the forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.research import Collect, mass_outside_selection
from pallas_kernels.indexer.reference import select_blocks_reference


@pytest.fixture(scope="module")
def model():
  return m3jax.M3ForCausalLM(m3jax.tiny(block_size=16), dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(5))


def test_nothing_is_recorded_by_default(model):
  ids = jnp.zeros((1, 8), jnp.int32)
  assert nnx.jit(lambda m, x: m.forward(x))(model, ids).intermediates is None  # a program, not op by op (eager)


@pytest.mark.quick
def test_intermediates_shapes_and_consistency(model):
  cfg = model.config.text
  b, s = 2, 80
  ids = jax.random.randint(jax.random.key(0), (b, s), 0, cfg.vocab_size)
  collect = Collect(block_ids=True, block_scores=True, routing=True, residual=True, attention_queries=(60, 80))
  out = nnx.jit(lambda m, x: m.forward(x, collect=collect))(model, ids)
  np.testing.assert_allclose(out.logits, model(ids), rtol=1e-6, atol=1e-6)  # recording changes nothing
  recs = out.intermediates
  assert len(recs) == cfg.num_layers
  nb = s // cfg.index_block_size
  for i, rec in enumerate(recs):
    assert rec["residual"].shape == (b, s, cfg.hidden_size)
    assert rec["attn_probs"].shape == (b, cfg.num_heads, 20, s)
    np.testing.assert_allclose(rec["attn_probs"].sum(-1), 1.0, rtol=1e-5)
    if cfg.attention_types[i] == "sparse":
      assert rec["block_ids"].shape == (b, s, cfg.index_num_heads, cfg.index_topk_blocks)
      assert rec["block_scores"].shape == (b, s, cfg.index_num_heads, nb)
      # The selection is the top-k of the recorded scores (plus the forced local block).
      pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
      again = select_blocks_reference(rec["block_scores"], pos, block_size=cfg.index_block_size,
                                      topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks)
      np.testing.assert_array_equal(np.sort(np.asarray(again), -1), np.sort(np.asarray(rec["block_ids"]), -1))
      mass = mass_outside_selection(recs, i)
      assert mass.shape == (b, cfg.num_heads, 20)
      assert float(mass.min()) >= -1e-6 and float(mass.max()) > 1e-4  # positions >= 32 really lose mass
      # Sparse probabilities are zero outside the selected blocks.
      blocks = np.arange(s) // cfg.index_block_size
      sel = np.asarray(rec["block_ids"])[0, 70, 0]
      outside = ~np.isin(blocks, sel[sel >= 0])
      assert np.all(np.asarray(rec["attn_probs"])[0, 0, 10][outside] == 0)
    else:
      assert "block_ids" not in rec and "dense_probs" not in rec
    if cfg.mlp_types[i] == "moe":
      assert rec["router_logits"].shape == (b, s, cfg.num_experts)
      assert rec["expert_ids"].shape == (b, s, cfg.num_experts_per_tok)
      np.testing.assert_allclose(rec["expert_weights"].sum(-1), 1.0, rtol=1e-6)
    else:
      assert "router_logits" not in rec
  assert np.isfinite(np.asarray(recs[-1]["residual"])).all()


def test_mass_outside_selection_is_zero_where_everything_is_selected(model):
  ids = jax.random.randint(jax.random.key(1), (1, 32), 0, 512)
  out = nnx.jit(lambda m, x: m.forward(x, collect=Collect(attention_queries=(0, 32))))(model, ids)
  for layer, kind in enumerate(model.config.text.attention_types):
    if kind == "sparse":
      np.testing.assert_allclose(mass_outside_selection(out.intermediates, layer), 0.0, atol=1e-6)
  with pytest.raises(ValueError, match="not sparse"):
    mass_outside_selection(out.intermediates, 0)
  with pytest.raises(ValueError, match="start < stop"):
    Collect(attention_queries=(5, 5))


@pytest.mark.quick
def test_selection_locality_counts_the_kernel_tiles():
  from m3jax.research import selection_locality
  from pallas_kernels.attention.plan import sparse_plan

  # Two queries, one group, top-2: {0, 1} and {0, 2} -> one 2-query union of 3 blocks; 4 of 6 rows attended.
  ids = np.array([[[[0, 1]], [[0, 2]]]], np.int32)
  stats = selection_locality(ids, np.array([[300, 301]], np.int32), tile_sizes=(1, 2))
  assert stats[1] == {"mean_selected": 2.0, "mean_union": 2.0, "row_efficiency": 1.0}
  assert stats[2]["mean_union"] == 3.0 and stats[2]["row_efficiency"] == pytest.approx(4 / 6)
  # Against the kernel's own plan (the union it walks) on indexer selections with padding queries.
  rng = np.random.default_rng(0)
  pos = np.where(np.arange(40) < 37, np.arange(1000, 1040), -1)[None].astype(np.int32)
  scores = jnp.asarray(rng.standard_normal((1, 40, 3, 8)), jnp.float32)
  ids = np.asarray(select_blocks_reference(scores, jnp.asarray(pos), block_size=128, topk=4, local_blocks=1))
  plan = sparse_plan(jnp.asarray(ids), jnp.asarray(pos), num_keys=1040, queries_per_tile=4, heads_per_group=16)
  count = np.asarray(plan.count)
  stats = selection_locality(ids, pos)
  assert stats[4]["mean_union"] == pytest.approx(count[count > 0].mean())
  assert stats[4]["mean_selected"] == 4.0 and 0.25 < stats[4]["row_efficiency"] < 1.0
  assert stats[8]["mean_union"] > stats[4]["mean_union"]
  with pytest.raises(ValueError, match="block_ids must be"):
    selection_locality(ids[0], pos)
