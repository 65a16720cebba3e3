"""pallas_kernels.moe.moe_block (Mosaic GPU) against moe_block_reference.

CPU: the kernels run in the Mosaic-GPU interpreter (``interpret=True``) on small dims that still
tile (H, I multiples of 128). On an sm90 GPU (``JAX_PLATFORMS=cuda``) the same cases run compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import (ExpertOperands, MoeBlockSizes, heuristic_block_sizes, moe_block, moe_block_reference,
                                prepare_expert_weights, route_reference, routed_experts, routed_experts_reference)
from pallas_kernels.moe.routing import route, top_k_all_pairs
from pallas_kernels.moe.dispatch import build_broadcast_dispatch, build_dispatch, max_routed_tiles
import kernel_modes

_KW = dict(routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)
_SMALL_TILES = (
    MoeBlockSizes(block_m=64, block_n=128, block_k=64, max_concurrent_steps=2, wg_split="n"),
    MoeBlockSizes(block_m=64, block_n=128, block_k=64, max_concurrent_steps=3, wg_split="n"),
)
_PREFILL_TILES = (  # prefill layout: 128-row tiles, warpgroups split rows
    MoeBlockSizes(block_m=128, block_n=128, max_concurrent_steps=2, wg_split="m"),
    MoeBlockSizes(block_m=128, block_n=128, max_concurrent_steps=2, wg_split="m"),
)


MODES = kernel_modes.MODES


def _tolerance(dtype, reduce_len: int) -> float:
  """Relative tolerance scaled with dtype and reduction length (tokamax style)."""
  base = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 2e-2}[jnp.dtype(dtype)]
  return base * max(1.0, np.sqrt(reduce_len / 128))


def _make(t, h, inter, e, shared_inter, dtype, seed=0, force_experts=()):
  """Random MoE block inputs; ``force_experts`` get a large selection bias (all tokens pick them)."""
  ks = jax.random.split(jax.random.key(seed), 7)
  normal = lambda k, shape, scale: (jax.random.normal(k, shape, jnp.float32) * scale)
  bias = normal(ks[2], (e,), 0.1)
  if force_experts:
    bias = bias.at[jnp.asarray(force_experts)].add(100.0)
  return (
      normal(ks[0], (t, h), 1.0).astype(dtype),
      normal(ks[1], (h, e), h ** -0.5),
      bias,
      normal(ks[3], (e, h, 2 * inter), 3 * h ** -0.5).astype(dtype),
      normal(ks[4], (e, inter, h), inter ** -0.5).astype(dtype),
      normal(ks[5], (h, 2 * shared_inter), 3 * h ** -0.5).astype(dtype),
      normal(ks[6], (shared_inter, h), shared_inter ** -0.5).astype(dtype),
  )


def _check(args, top_k, mode, block_sizes=_SMALL_TILES, **extra):
  out = moe_block(*args, top_k=top_k, **_KW, interpret=mode == "interpret",
                  block_sizes=block_sizes, **extra)
  ref = moe_block_reference(*args, top_k=top_k, **_KW)
  assert out.shape == ref.shape and out.dtype == ref.dtype
  out = np.asarray(out.astype(jnp.float32))
  ref = np.asarray(ref.astype(jnp.float32))
  assert np.isfinite(out).all()
  tol = _tolerance(args[0].dtype, args[0].shape[1])
  np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())


# (name, T, E, top_k, forced experts): single token, ragged counts not a multiple of the tile,
# several m-tiles per expert, every token on the same experts (all others empty).
CASES = [
    ("single_token", 1, 8, 2, ()),
    ("ragged_37", 37, 8, 2, ()),
    ("multi_tile", 150, 4, 2, ()),
    ("one_expert", 70, 8, 2, (5, 2)),
]


# fp32 multi_tile is not generated in interpret mode (bf16 covers that tiling; it keeps the CPU run short).
_MATRIX = [pytest.param(mode.values[0], dtype, *case, marks=mode.marks,
                        id=f"{mode.values[0]}-{jnp.dtype(dtype).name}-{case[0]}")
           for mode in MODES for dtype in (jnp.bfloat16, jnp.float32) for case in CASES
           if not (dtype == jnp.float32 and case[0] == "multi_tile" and mode.values[0] == "interpret")]


@pytest.mark.parametrize("mode,dtype,name,t,e,top_k,force", _MATRIX)
def test_moe_block_matches_reference(mode, dtype, name, t, e, top_k, force):
  args = _make(t, 128, 128, e, 128, dtype, seed=len(name), force_experts=force)
  _check(args, top_k, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_prefill_tiles_row_split(mode, dtype):
  # 300 assignments over 4 experts: several 128-row tiles per expert, ragged last tiles.
  args = _make(150, 128, 128, 4, 128, dtype, seed=5)
  _check(args, 2, mode, block_sizes=_PREFILL_TILES)


@pytest.mark.parametrize("mode", MODES)
def test_unfused_shared_expert_wider_than_routed(mode):
  # Is != I: the shared expert runs as a one-expert grouped GEMM beside the routed one.
  args = _make(9, 128, 128, 8, 256, jnp.bfloat16, seed=3)
  _check(args, 2, mode)


@pytest.mark.parametrize("mode", MODES)
def test_default_decode_tiles(mode):
  # Heuristic tiles (block_m 64, gate_up block_n 128, down block_n 256) with top-4 of 16.
  args = _make(3, 256, 128, 16, 128, jnp.bfloat16, seed=4)
  _check(args, 4, mode, block_sizes=None)


@pytest.mark.parametrize("mode", MODES)
def test_default_tiles_narrow_to_a_tensor_parallel_expert_slice(mode):
  # Expert width 64 and shared width 192 (neither divisible by the default gate_up block_n of 128): the
  # heuristic narrows block_n to 64 instead of refusing the shape.
  args = _make(3, 256, 64, 16, 192, jnp.bfloat16, seed=5)
  _check(args, 4, mode, block_sizes=None)


def test_heuristic_block_n_divides_the_widths():
  full = heuristic_block_sizes(4, 4, 128)
  assert (full[0].block_n, full[1].block_n) == (128, 256)
  assert heuristic_block_sizes(4, 4, 128, gate_up_widths=(3072, 384), down_widths=(6144,)) == full
  gate_up, down = heuristic_block_sizes(4, 4, 128, gate_up_widths=(192,), down_widths=(6144,))
  assert (gate_up.block_n, down.block_n) == (64, 256)
  # 64 columns cannot be split between the warpgroups: both GEMMs switch to 128-row tiles split by rows.
  assert (gate_up.block_m, gate_up.wg_split, down.block_m, down.wg_split) == (128, "m", 128, "m")
  assert heuristic_block_sizes(4, 4, 128, down_widths=(640,))[1].block_n == 128
  # No power of two >= 64 divides 96: the tiles stay as they are and the kernel names the width.
  assert heuristic_block_sizes(4, 4, 128, gate_up_widths=(96,))[0].block_n == 128
  with pytest.raises(ValueError, match="block_n must be a power of two in \\[64, 512\\]"):
    MoeBlockSizes(block_m=64, block_n=32, wg_split="n")
  with pytest.raises(ValueError, match="wg_split='n' needs block_n >= 128"):
    MoeBlockSizes(block_m=64, block_n=64, wg_split="n")


# (name, T, E total, E held, first held expert, forced experts): the expert-parallel entry point.
_SLICES = [
    ("upper_half", 37, 8, 4, 4, ()),
    ("lower_half_prefill_tiles", 150, 8, 4, 0, ()),
    ("no_token_here", 20, 8, 4, 4, (0, 1)),  # every token routed to experts held elsewhere
    ("all_experts", 5, 8, 8, 0, ()),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,t,e,e_held,first,force", _SLICES, ids=[c[0] for c in _SLICES])
def test_routed_experts_on_a_slice_of_experts(mode, name, t, e, e_held, first, force):
  x, router_w, bias, w_gu, w_dn, _, _ = _make(t, 128, 128, e, 128, jnp.bfloat16, seed=len(name),
                                              force_experts=force)
  weights, ids, _ = route_reference(x, router_w, bias, top_k=2)
  held = (slice(first, first + e_held),)
  kw = dict(alpha=_KW["swiglu_alpha"], limit=_KW["swiglu_limit"])
  tiles = _PREFILL_TILES if t > 64 else _SMALL_TILES
  run = jax.jit(lambda f: routed_experts(x, weights, ids, w_gu[held], w_dn[held], f, **kw,
                                         interpret=mode == "interpret", block_sizes=tiles))
  out = np.asarray(run(jnp.int32(first)))  # first_expert traced, as under shard_map
  ref = np.asarray(routed_experts_reference(x, weights, ids, w_gu[held], w_dn[held], first, **kw))
  assert out.shape == (t, 128) and out.dtype == np.float32 and np.isfinite(out).all()
  here = np.asarray((ids >= first) & (ids < first + e_held)).any(axis=1)
  assert (out[~here] == 0).all()  # tokens with no expert here get exact zeros
  if force:
    assert not here.any()
  else:
    assert here.sum() > t // 4 and np.abs(ref[here]).min() > 0
    tol = _tolerance(jnp.bfloat16, 128)
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_routed_experts_reference_slices_sum_to_all_experts():
  x, router_w, bias, w_gu, w_dn, _, _ = _make(30, 128, 64, 8, 64, jnp.float32, seed=9)
  weights, ids, _ = route_reference(x, router_w, bias, top_k=3)
  kw = dict(alpha=_KW["swiglu_alpha"], limit=_KW["swiglu_limit"])
  full = routed_experts_reference(x, weights, ids, w_gu, w_dn, **kw)
  parts = sum(routed_experts_reference(x, weights, ids, w_gu[f:f + 2], w_dn[f:f + 2], f, **kw) for f in range(0, 8, 2))
  np.testing.assert_allclose(np.asarray(parts), np.asarray(full), rtol=1e-5, atol=1e-5 * np.abs(full).max())


@pytest.mark.parametrize("method", ["sort", "onehot"])
def test_dispatch_drops_foreign_experts(method):
  t, k, e, bm = 25, 2, 4, 16
  ids = jax.random.randint(jax.random.key(1), (t, k), -4, 8)  # ids outside [0, 4): held elsewhere
  d = build_dispatch(ids, num_experts=e, block_m=bm, fuse_shared=False, method=method, drop_foreign=True)
  meta, row_token, pos, kept = (np.asarray(a) for a in (d.meta, d.row_token, d.pos, d.kept))
  ids = np.asarray(ids)
  np.testing.assert_array_equal(kept, (ids >= 0) & (ids < e))
  counts = np.bincount(ids[kept], minlength=e)
  assert meta[0] == sum(-(-c // bm) for c in counts)
  np.testing.assert_array_equal(meta[1 + pos[kept] // bm], ids[kept])
  np.testing.assert_array_equal(row_token[pos[kept]], np.nonzero(kept)[0])
  assert len(np.unique(pos[kept])) == kept.sum() and (pos[~kept] == 0).all()


@pytest.mark.parametrize("method", ["sort", "onehot"])
def test_dispatch_layout_invariants(method):
  t, k, e, bm = 40, 3, 6, 16
  ids = jax.random.randint(jax.random.key(0), (t, k), 0, e - 1)  # expert e-1 stays empty
  d = build_dispatch(ids, num_experts=e, block_m=bm, fuse_shared=True, method=method)
  meta, row_token, pos = (np.asarray(a) for a in (d.meta, d.row_token, d.pos))
  assert d.shared_tiles == 3 and meta.shape == (1 + 3 + max_routed_tiles(t, k, e, bm),)
  counts = np.bincount(np.asarray(ids).ravel(), minlength=e)
  assert meta[0] == 3 + sum(-(-c // bm) for c in counts)
  np.testing.assert_array_equal(row_token[:t], np.arange(t))  # shared rows first, in token order
  assert (meta[1:4] == e).all()
  tile_of = pos // bm
  np.testing.assert_array_equal(meta[1 + tile_of], np.asarray(ids))  # each row sits in its expert's tile
  np.testing.assert_array_equal(row_token[pos], np.repeat(np.arange(t)[:, None], k, 1))
  assert len(np.unique(pos)) == t * k and (tile_of < meta[0]).all()
  other = build_dispatch(ids, num_experts=e, block_m=bm, fuse_shared=True,
                         method="onehot" if method == "sort" else "sort")
  np.testing.assert_array_equal(pos, np.asarray(other.pos))  # both keep assignment order per expert


@pytest.mark.parametrize("fuse_shared", [False, True])
def test_broadcast_dispatch_layout(fuse_shared):
  # Decode layout: one tile per touched expert (increasing id), row t of every tile is token t.
  t, k, e, bm = 5, 3, 16, 8
  ids = jax.random.randint(jax.random.key(2), (t, k), -3, e)  # negative ids: held elsewhere
  d = build_broadcast_dispatch(ids, num_experts=e, block_m=bm, fuse_shared=fuse_shared, drop_foreign=True)
  assert d.row_token is None
  meta, pos, kept = (np.asarray(a) for a in (d.meta, d.pos, d.kept))
  ids = np.asarray(ids)
  np.testing.assert_array_equal(kept, ids >= 0)
  touched = np.unique(ids[kept])
  s = int(fuse_shared)
  assert meta.shape == (1 + s + min(t * k, e),) and meta[0] == s + len(touched)
  assert (meta[1:1 + s] == e).all()
  np.testing.assert_array_equal(meta[1 + s:1 + s + len(touched)], touched)
  np.testing.assert_array_equal(meta[1 + pos[kept] // bm], ids[kept])  # each assignment in its expert's tile
  np.testing.assert_array_equal((pos % bm)[kept], np.nonzero(kept)[0])  # ... at its token's row
  assert (pos[~kept] == 0).all()
  with pytest.raises(ValueError, match="T <= block_m"):
    build_broadcast_dispatch(jnp.zeros((bm + 1, k), jnp.int32), num_experts=e, block_m=bm, fuse_shared=False)


def test_all_pairs_top_k_matches_lax_top_k_with_ties():
  v = jax.random.normal(jax.random.key(3), (9, 32), jnp.float32)
  v = v.at[:, 5].set(v[:, 7]).at[:, 20].set(v[:, 7])  # three-way ties in every row
  v = v.at[0].set(0.0)  # a row of all-equal values
  for k in (1, 4, 32):
    np.testing.assert_array_equal(np.asarray(top_k_all_pairs(v, k)), np.asarray(jax.lax.top_k(v, k)[1]))


@pytest.mark.parametrize("t", [1, 7, 300])  # 300 tokens x 128 x 128 falls back to lax.top_k
@pytest.mark.quick
def test_kernel_routing_matches_reference(t):
  x, router_w, bias, *_ = _make(t, 128, 128, 128, 128, jnp.bfloat16, seed=t)
  weights, ids = route(x, router_w, bias, top_k=4)
  ref_w, ref_ids, _ = route_reference(x, router_w, bias, top_k=4)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_w), rtol=1e-6)


def test_input_validation():
  args = list(_make(4, 128, 128, 8, 128, jnp.bfloat16))
  with pytest.raises(ValueError, match="w_down"):
    moe_block(*args[:4], args[4][:, :64], *args[5:], top_k=2, **_KW, interpret=True)
  with pytest.raises(ValueError, match="top_k"):
    moe_block(*args, top_k=9, **_KW, interpret=True)
  with pytest.raises(ValueError, match="block_m"):
    bad = (MoeBlockSizes(block_m=64, wg_split="n"), MoeBlockSizes(block_m=128))
    moe_block(*args, top_k=2, **_KW, interpret=True, block_sizes=bad)
  with pytest.raises(NotImplementedError):  # quantized weights
    moe_block(*args[:3], args[3].astype(jnp.int8), *args[4:], top_k=2, **_KW, interpret=True)
  with pytest.raises(NotImplementedError):  # H=96 does not tile with block_k=64
    moe_block(*_make(4, 96, 128, 8, 128, jnp.bfloat16), top_k=2, **_KW, interpret=True)
  with pytest.raises(NotImplementedError):  # integer activations
    moe_block(args[0].astype(jnp.int8), *args[1:], top_k=2, **_KW, interpret=True)
  weights, ids, _ = route_reference(*args[:3], top_k=2)
  kw = dict(alpha=_KW["swiglu_alpha"], limit=_KW["swiglu_limit"], interpret=True)
  with pytest.raises(ValueError, match="w_down"):
    routed_experts(args[0], weights, ids, args[3], args[4][:, :64], **kw)
  with pytest.raises(ValueError, match="expert_ids"):
    routed_experts(args[0], weights, ids[:, :1], args[3], args[4], **kw)
  with pytest.raises(NotImplementedError):  # quantized expert weights
    routed_experts(args[0], weights, ids, args[3].astype(jnp.int8), args[4], **kw)


# (dtype, T, shared width): decode (broadcast layout) with the shared expert fused, prefill with it unfused.
_PREPARED = [(jnp.float32, 3, 128), (jnp.float32, 70, 256), (jnp.bfloat16, 3, 128)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,t,shared_inter", _PREPARED, ids=["f32-decode", "f32-prefill-unfused", "bf16-decode"])
def test_prepared_operands_give_the_same_result(mode, dtype, t, shared_inter):
  # Operands built once (prepare_expert_weights, as before a decode loop) give bit-identical outputs to operands
  # built per call, for moe_block and routed_experts; the fp32 operands are the [hi; lo; hi] split along K.
  args = _make(t, 128, 128, 8, shared_inter, dtype, seed=t)
  x, router_w, bias, w_gu, w_dn, s_gu, s_dn = args
  prepared = jax.jit(prepare_expert_weights, static_argnums=0)(dtype, w_gu, w_dn, s_gu, s_dn)
  k = 3 if dtype == jnp.float32 else 1
  assert prepared.gate_up.shape == (8, k * 128, 256) and prepared.down.shape == (8, k * 128, 128)
  assert prepared.shared_gate_up.shape == (k * 128, 2 * shared_inter)
  assert prepared.gate_up.dtype == jnp.bfloat16
  tiles = _PREFILL_TILES if t > 64 else _SMALL_TILES
  run = lambda **kw: np.asarray(moe_block(*args, top_k=2, **_KW, interpret=mode == "interpret", block_sizes=tiles,
                                          **kw).astype(jnp.float32))
  per_call, once = run(), run(prepared=prepared)
  np.testing.assert_array_equal(once, per_call)
  tol = _tolerance(dtype, 128)
  ref = np.asarray(moe_block_reference(*args, top_k=2, **_KW).astype(jnp.float32))
  np.testing.assert_allclose(once, ref, rtol=tol, atol=tol * np.abs(ref).max())
  weights, ids, _ = route_reference(x, router_w, bias, top_k=2)
  kw = dict(alpha=_KW["swiglu_alpha"], limit=_KW["swiglu_limit"], interpret=mode == "interpret", block_sizes=tiles)
  routed = ExpertOperands(prepared.gate_up, prepared.down)
  np.testing.assert_array_equal(np.asarray(routed_experts(x, weights, ids, w_gu, w_dn, **kw, prepared=routed)),
                                np.asarray(routed_experts(x, weights, ids, w_gu, w_dn, **kw)))


def test_prepared_operands_are_checked_against_the_weights():
  x, router_w, bias, w_gu, w_dn, s_gu, s_dn = args = _make(4, 128, 128, 8, 128, jnp.float32)
  kw = dict(top_k=2, **_KW, interpret=True)
  with pytest.raises(ValueError, match=r"prepared.gate_up .* expected bfloat16\[8, 384, 256\], got bfloat16\[8, 128"):
    moe_block(*args, **kw, prepared=prepare_expert_weights(jnp.bfloat16, w_gu, w_dn, s_gu, s_dn))  # built for bf16
  with pytest.raises(ValueError, match=r"prepared.shared_gate_up .* got None"):
    moe_block(*args, **kw, prepared=prepare_expert_weights(jnp.float32, w_gu, w_dn))
  with pytest.raises(ValueError, match=r"prepared.down"):
    other = prepare_expert_weights(jnp.float32, w_gu[:4], w_dn[:4], s_gu, s_dn)
    moe_block(*args, **kw, prepared=ExpertOperands(prepare_expert_weights(jnp.float32, w_gu, w_dn).gate_up,
                                                   other.down, other.shared_gate_up, other.shared_down))
  with pytest.raises(TypeError, match="ExpertOperands"):
    moe_block(*args, **kw, prepared=(w_gu, w_dn))
  with pytest.raises(ValueError, match="both shared_gate_up and shared_down"):
    prepare_expert_weights(jnp.float32, w_gu, w_dn, s_gu)
  with pytest.raises(NotImplementedError, match="int8"):
    prepare_expert_weights(jnp.int8, w_gu, w_dn)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.quick
def test_expert_parallel_block_runs_the_kernel_inside_shard_map(mode, caplog, monkeypatch):
  # m3jax.parallel.moe on a one-device mesh: the per-device routed experts go through run_op to the
  # Pallas kernel (no fallback) inside shard_map. (The interpreter keeps one global simulated GPU, so
  # several CPU devices cannot interpret kernels concurrently; slices of experts are covered above.)
  from m3jax import sharding
  from m3jax.parallel import moe as parallel_moe

  if mode == "interpret":
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # run_op: 'pallas' on CPU = interpret
  args = _make(12, 256, 128, 8, 128, jnp.bfloat16, seed=11)
  plan = sharding.ShardingPlan(sharding.make_mesh("expert=1"))
  kw = dict(top_k=2, **_KW)
  with sharding.use_plan(plan), caplog.at_level("WARNING", logger="m3jax.ops"):
    out = jax.jit(lambda x, *w: parallel_moe.moe_block(plan, x, *w, **kw, kernels="pallas"))(args[0][None], *args[1:])
  assert not [r for r in caplog.records if "falls back" in r.getMessage()]
  ref = moe_block_reference(*args, **kw)
  out = np.asarray(out[0].astype(jnp.float32))
  ref = np.asarray(ref.astype(jnp.float32))
  tol = _tolerance(jnp.bfloat16, 256)
  np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("mode", MODES)
def test_expert_parallel_block_takes_prepared_fp32_operands(mode, caplog, monkeypatch):
  # fp32 weights: the routed experts' split operands built once per device (prepare_routed, in the expert layout)
  # and passed into shard_map give the same result as splitting inside every call; shared operands are refused
  # (the shared expert runs outside the kernels there).
  from m3jax import sharding
  from m3jax.ops import moe as moe_ops
  from m3jax.parallel import moe as parallel_moe

  if mode == "interpret":
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  args = _make(5, 128, 128, 8, 128, jnp.float32, seed=12)
  plan = sharding.ShardingPlan(sharding.make_mesh("expert=1"))
  kw = dict(top_k=2, **_KW)
  with sharding.use_plan(plan), caplog.at_level("WARNING", logger="m3jax.ops"):
    prepared = jax.jit(lambda gu, d: parallel_moe.prepare_routed(plan, gu, d))(args[3], args[4])
    assert prepared.shared_gate_up is None and prepared.gate_up.shape == (8, 384, 256)
    run = jax.jit(lambda x, p, *w: parallel_moe.moe_block(plan, x, *w, **kw, kernels="pallas", prepared=p))
    once, per_call = run(args[0][None], prepared, *args[1:]), run(args[0][None], None, *args[1:])
    with pytest.raises(ValueError, match="routed operands only"):
      run(args[0][None], prepare_expert_weights(jnp.float32, *args[3:]), *args[1:])
    assert moe_ops.prepare_experts(*args[3:], kernels="reference") is None
    assert moe_ops.prepare_experts(*(w.astype(jnp.bfloat16) for w in args[3:]), kernels="pallas") is None
  assert not [r for r in caplog.records if "falls back" in r.getMessage()]
  np.testing.assert_array_equal(np.asarray(once), np.asarray(per_call))
  ref = np.asarray(moe_block_reference(*args, **kw))
  tol = _tolerance(jnp.float32, 128)
  np.testing.assert_allclose(np.asarray(once[0]), ref, rtol=tol, atol=tol * np.abs(ref).max())
