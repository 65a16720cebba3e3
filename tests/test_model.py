"""Model-level properties: the sparse/dense golden identity, cached decode, input errors, the full preset."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.layers.attention import Attention
from m3jax.layers.rope import rope_cos_sin


@pytest.mark.quick
def test_sparse_layer_equals_dense_attention_below_topk_times_block_size():
  cfg = m3jax.tiny(block_size=16).text  # top-2 x 16 = 32 tokens always fully selected
  sparse = Attention(cfg, sparse=True, dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0))
  dense = Attention(cfg, sparse=False, dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0))
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    getattr(dense, name).set_value(getattr(sparse, name)[...])
  s = 96
  x = jax.random.normal(jax.random.key(2), (2, s, cfg.hidden_size))
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s))
  cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta)
  ys, _, _ = sparse(x, positions=pos, cos=cos, sin=sin, cache=None)
  yd, _, _ = dense(x, positions=pos, cos=cos, sin=sin, cache=None)
  limit = cfg.index_topk_blocks * cfg.index_block_size
  np.testing.assert_allclose(ys[:, :limit], yd[:, :limit], rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(ys[:, limit:] - yd[:, limit:]).max()) > 1e-3


def test_cached_forward_matches_full_forward():
  model = m3jax.M3ForCausalLM(m3jax.tiny(block_size=16), dtype=jnp.float32, rngs=nnx.Rngs(3))
  ids = jax.random.randint(jax.random.key(4), (2, 90), 0, 512)
  full = model(ids)
  caches = model.init_caches(2, 128)
  pos = jnp.broadcast_to(jnp.arange(90, dtype=jnp.int32), (2, 90))
  forward = jax.jit(lambda i, p, c: model.forward(i, positions=p, caches=c))  # 2 programs, not op by op
  out = forward(ids[:, :50], pos[:, :50], caches)
  logits = [out.logits]
  caches = out.caches
  for t in range(50, 90, 8):  # chunks of 8 new tokens against the cache
    out = forward(ids[:, t:t + 8], pos[:, t:t + 8], caches)
    caches = out.caches
    logits.append(out.logits)
  np.testing.assert_allclose(jnp.concatenate(logits, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.quick
def test_bad_inputs_raise_clear_errors():
  model = m3jax.M3ForCausalLM(m3jax.tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"\[batch, seq\]"):
    model(jnp.zeros((5,), jnp.int32))
  with pytest.raises(ValueError, match=r"outside \[0, 512\)"):
    model(jnp.full((1, 3), 600, jnp.int32))
  with pytest.raises(ValueError, match="explicit positions"):
    model.forward(jnp.zeros((1, 3), jnp.int32), caches=model.init_caches(1, 8))
  with pytest.raises(ValueError, match="M3JAX_KERNELS"):
    m3jax.M3ForCausalLM(m3jax.tiny(), kernels="cuda")


@pytest.mark.quick
def test_full_preset_has_about_427b_parameters_without_allocating():
  abstract = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(m3jax.m3_full(), dtype=jnp.bfloat16))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  total = sum(int(np.prod(x.shape)) for x in leaves)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  h, v = 6144, 200064
  expected = (
      57 * 128 * 3 * 3072 * h  # routed experts (~413.1B)
      + 57 * 3 * 3072 * h  # shared experts
      + 57 * 128 * h + 57 * 128  # router gates + correction biases
      + 3 * 3 * 12288 * h  # dense MLPs of layers 0-2
      + 60 * (2 * 8192 * h + 2 * 512 * h + 2 * 128)  # q, o, k, v projections + q/k norms
      + 57 * ((512 + 128) * h + 2 * 128)  # lightning indexer projections + norms
      + 2 * v * h  # embedding + untied LM head
      + 60 * 2 * h + h)  # layer norms + final norm
  assert total == expected
  assert 425e9 < total < 428e9, total  # "~427B" in the model card
