"""Every kernel configuration the model uses lowers to Mosaic GPU for CUDA, checked on a CPU.

Interpret mode runs a kernel's Python semantics, not its Hopper lowering: it accepted a MoE decode tile whose
two warpgroups each took 32 weight columns, which the wgmma lowering rejects (whole 64-column swizzle tiles
only; found on the H200, BENCHMARKS.md "ninth session"). Lowering with ``lowering_platforms=("cuda",)`` builds
the same Mosaic GPU module as a GPU run does, without a GPU and without allocating the operands (shapes only),
so these tests catch such tiles at M3's own shapes -- the full model on one device and one GPU's slice of an
8- and a 16-way tensor-parallel split (4 query heads per KV group, which the attention ops pad to 8) -- in CI.
Compilation to a cubin still needs the GPU (the `gpu` modes of the other kernel tests).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from m3jax.config import M3Config, m3_full
from m3jax.model import M3ForCausalLM
from m3jax.ops import dispatch
from kernel_modes import lowered_step_kernels
from pallas_kernels.attention import KvMajorBlockSizes, causal_attention, sparse_attention
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.moe import moe_block, routed_experts


@dataclasses.dataclass(frozen=True)
class Dims:
  """Per-device shapes of one M3 layer (M3_SPEC §1; a tensor-parallel slice as bench_full.shard_config)."""

  name: str
  q_heads: int
  kv_heads: int
  index_heads: int
  expert_width: int  # routed and shared expert intermediate size


FULL = Dims("full", q_heads=64, kv_heads=4, index_heads=4, expert_width=3072)
TP8 = Dims("tp8", q_heads=8, kv_heads=1, index_heads=1, expert_width=384)
TP16 = Dims("tp16", q_heads=4, kv_heads=1, index_heads=1, expert_width=192)
HIDDEN, HEAD_DIM, EXPERTS, TOP_K, BLOCK, TOP_BLOCKS = 6144, 128, 128, 4, 128, 16
DIMS = [pytest.param(d, id=d.name) for d in (FULL, TP8, TP16)]
# (batch, new tokens, cached tokens before them): prefill not a multiple of the key block, a chunk of prefill
# after a cached prefix, decode of a batch against a long cache.
CALLS = [pytest.param(1, 1000, 0, id="prefill"), pytest.param(1, 300, 1000, id="chunked"),
         pytest.param(8, 1, 4095, id="decode")]


def _spec(shape, dtype=jnp.bfloat16) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype)


def _lower_for_cuda(fn, *args, **kwargs) -> str:
  """The StableHLO text of fn(*args, **kwargs) lowered for CUDA (raises what a GPU run would raise)."""
  return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()


def _assert_mosaic(text: str) -> None:
  assert "mosaic_gpu" in text, "no Mosaic GPU kernel in the lowered program (a reference path ran instead)"


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("tokens", [4, 64, 300], ids=["decode4", "decode64", "prefill300"])
def test_moe_block_lowers(dims: Dims, tokens: int):
  i = dims.expert_width
  args = (_spec((tokens, HIDDEN)), _spec((HIDDEN, EXPERTS), jnp.float32), _spec((EXPERTS,), jnp.float32),
          _spec((EXPERTS, HIDDEN, 2 * i)), _spec((EXPERTS, i, HIDDEN)), _spec((HIDDEN, 2 * i)), _spec((i, HIDDEN)))
  _assert_mosaic(_lower_for_cuda(
      lambda *a: moe_block(*a, top_k=TOP_K, routed_scaling_factor=2.5, swiglu_alpha=1.702, swiglu_limit=7.0,
                           num_sms=132), *args))


@pytest.mark.parametrize("tokens", [4, 300], ids=["decode4", "prefill300"])
def test_moe_block_lowers_in_fp32(tokens: int):
  """fp32 checkpoints run the same kernels on a bf16 hi/lo split."""
  h, e, i = 512, 16, 256
  f32 = jnp.float32
  args = (_spec((tokens, h), f32), _spec((h, e), f32), _spec((e,), f32), _spec((e, h, 2 * i), f32),
          _spec((e, i, h), f32), _spec((h, 2 * i), f32), _spec((i, h), f32))
  _assert_mosaic(_lower_for_cuda(
      lambda *a: moe_block(*a, top_k=TOP_K, routed_scaling_factor=1.0, swiglu_alpha=1.702, swiglu_limit=7.0,
                           num_sms=132), *args))


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("tokens", [4, 300], ids=["decode4", "prefill300"])
def test_expert_parallel_routed_experts_lower(dims: Dims, tokens: int):
  """One device of an 8-way expert-parallel mesh: 16 of the 128 experts."""
  i, local = dims.expert_width, EXPERTS // 8
  args = (_spec((tokens, HIDDEN)), _spec((tokens, TOP_K), jnp.float32), _spec((tokens, TOP_K), jnp.int32),
          _spec((local, HIDDEN, 2 * i)), _spec((local, i, HIDDEN)), _spec((), jnp.int32))
  _assert_mosaic(_lower_for_cuda(
      lambda *a: routed_experts(*a, alpha=1.702, limit=7.0, num_sms=132), *args))


def _positions(batch: int, new: int) -> jax.ShapeDtypeStruct:
  return _spec((batch, new), jnp.int32)


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("batch,new,cached", CALLS)
def test_indexer_lowers(dims: Dims, batch: int, new: int, cached: int):
  args = (_spec((batch, new, dims.index_heads, HEAD_DIM)), _spec((batch, cached + new, HEAD_DIM)),
          _positions(batch, new))
  _assert_mosaic(_lower_for_cuda(
      lambda *a: indexer_topk(*a, block_size=BLOCK, topk=TOP_BLOCKS, local_blocks=1), *args))


@pytest.mark.parametrize("batch,new,cached", CALLS)
@pytest.mark.quick
def test_indexer_lowers_in_fp32(batch: int, new: int, cached: int):
  """fp32 checkpoints: the index scores run on a bf16 hi/lo split of the fp32 operands."""
  f32 = jnp.float32
  args = (_spec((batch, new, FULL.index_heads, HEAD_DIM), f32), _spec((batch, cached + new, HEAD_DIM), f32),
          _positions(batch, new))
  _assert_mosaic(_lower_for_cuda(
      lambda *a: indexer_topk(*a, block_size=BLOCK, topk=TOP_BLOCKS, local_blocks=1), *args))


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("batch,new,cached", CALLS)
def test_sparse_attention_lowers(dims: Dims, batch: int, new: int, cached: int):
  sk = cached + new
  args = (_spec((batch, new, dims.q_heads, HEAD_DIM)), _spec((batch, sk, dims.kv_heads, HEAD_DIM)),
          _spec((batch, sk, dims.kv_heads, HEAD_DIM)), _spec((batch, new, dims.kv_heads, TOP_BLOCKS), jnp.int32),
          _positions(batch, new))
  _assert_mosaic(_lower_for_cuda(
      lambda *a: sparse_attention(*a, block_size=BLOCK, scale=HEAD_DIM ** -0.5), *args))


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("batch,new,cached", CALLS[:2])
def test_kv_major_sparse_attention_lowers(dims: Dims, batch: int, new: int, cached: int):
  """The KV-major prefill kernel alone (two output stagings), and (full dims, 1000-token prefill: 500
  warp-specialized tiles) inside the default, beside the query-major kernel it is chosen against on the
  device."""
  sk = cached + new
  args = (_spec((batch, new, dims.q_heads, HEAD_DIM)), _spec((batch, sk, dims.kv_heads, HEAD_DIM)),
          _spec((batch, sk, dims.kv_heads, HEAD_DIM)), _spec((batch, new, dims.kv_heads, TOP_BLOCKS), jnp.int32),
          _positions(batch, new))
  # the default, 64-column output parts with early Q refills, and stores straight from registers
  for staging in ("q_buffer", "halves", "registers", "q_buffer_one_store"):
    text = _lower_for_cuda(lambda *a: sparse_attention(*a, block_size=BLOCK, scale=HEAD_DIM ** -0.5,
                                                       block_sizes=KvMajorBlockSizes(output_staging=staging)), *args)
    assert f"m3_attention_kv_major_c8_{staging}" in text
  text = _lower_for_cuda(lambda *a: sparse_attention(*a, block_size=BLOCK, scale=HEAD_DIM ** -0.5,
                                                     block_sizes=KvMajorBlockSizes(
                                                         compute_wgs=3, output_staging="separate_one_store")), *args)
  assert "m3_attention_kv_major_c8_separate_one_store_w3" in text  # three warpgroups sharing each block's K and V
  if dims is FULL and cached == 0:
    text = _lower_for_cuda(lambda *a: sparse_attention(*a, block_size=BLOCK, scale=HEAD_DIM ** -0.5), *args)
    assert "m3_attention_kv_major" in text and "m3_attention_ws" in text


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("batch,new,cached", CALLS)
def test_causal_attention_kernel_lowers(dims: Dims, batch: int, new: int, cached: int):
  """The Pallas path of the dense layers (cuDNN takes plain prefills on a GPU; here the kernel is forced)."""
  sk = cached + new
  args = (_spec((batch, new, dims.q_heads, HEAD_DIM)), _spec((batch, sk, dims.kv_heads, HEAD_DIM)),
          _spec((batch, sk, dims.kv_heads, HEAD_DIM)), _positions(batch, new))
  _assert_mosaic(_lower_for_cuda(
      lambda *a: causal_attention(*a, scale=HEAD_DIM ** -0.5, use_cudnn=False), *args))


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("batch,new,cached", CALLS[1:])
def test_paged_kernels_lower(dims: Dims, batch: int, new: int, cached: int):
  """The paged read path (the engine's page pools, m3jax.cache.PagedLayerCache): the indexer, the sparse attention
  (at full dims a prefill chunk on the warp-specialized kernel, decode on the one-warpgroup kernel) and the dense
  layers' causal attention, each reading its key blocks through a page table."""
  pages = -(-(cached + new) // BLOCK)
  pool = batch * pages + 3
  table = _spec((batch, pages), jnp.int32)
  q, positions = _spec((batch, new, dims.q_heads, HEAD_DIM)), _positions(batch, new)
  kv = _spec((pool, BLOCK, dims.kv_heads, HEAD_DIM))
  _assert_mosaic(_lower_for_cuda(
      lambda a, k, p, t: indexer_topk(a, k, p, block_size=BLOCK, topk=TOP_BLOCKS, local_blocks=1, page_table=t),
      _spec((batch, new, dims.index_heads, HEAD_DIM)), _spec((pool, BLOCK, HEAD_DIM)), positions, table))
  ids = _spec((batch, new, dims.kv_heads, TOP_BLOCKS), jnp.int32)
  text = _lower_for_cuda(lambda *a: sparse_attention(*a[:5], block_size=BLOCK, scale=HEAD_DIM ** -0.5,
                                                     page_table=a[5]), q, kv, kv, ids, positions, table)
  _assert_mosaic(text)
  assert "kv_major" not in text
  if dims is FULL:  # the heuristic's warp-specialized kernel for a chunk of many queries, one warpgroup to decode
    assert ("m3_attention_ws" in text) == (new > 1)
  _assert_mosaic(_lower_for_cuda(lambda *a: causal_attention(*a[:4], scale=HEAD_DIM ** -0.5, page_table=a[4]),
                                 q, kv, kv, positions, table))


def _tp8_slice_model():
  """One GPU's 8-way slice of M3 (real widths, 1 dense + 3 sparse MoE layers) on the kernels, as shapes only."""
  text_cfg = dataclasses.replace(
      m3_full().text, num_layers=4, attention_types=("full",) + ("sparse",) * 3, mlp_types=("dense",) + ("moe",) * 3,
      num_heads=TP8.q_heads, num_kv_heads=TP8.kv_heads, index_num_heads=TP8.index_heads,
      intermediate_size=TP8.expert_width, shared_intermediate_size=TP8.expert_width, dense_intermediate_size=1536,
      vocab_size=25008)
  return nnx.eval_shape(lambda: M3ForCausalLM(M3Config(text=text_cfg), dtype=jnp.bfloat16, kernels="pallas"))


def test_model_steps_lower_to_mosaic_gpu(monkeypatch):
  """A decode step and a prefill of one GPU's 8-way slice (real widths, 1 dense + 3 sparse MoE layers) with
  M3JAX_KERNELS=pallas lower for CUDA with every op on its kernel (none fell back to a reference)."""
  monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)  # compiled kernels, as on a GPU backend
  model = _tp8_slice_model()
  steps = lowered_step_kernels(model, decode_batch=4, prefill_batch=1)
  # the dense layer's and the sparse layers' attention, the indexer, the MoE gate/up and down GEMMs
  assert steps["decode"] == {"attention": 2, "indexer": 1, "moe": 2}, steps["decode"]
  assert steps["prefill"] == {"attention": 2, "indexer": 1, "moe": 2}, steps["prefill"]
  # The same on the 8-device meshes, kernels inside shard_map: tests/test_sharding.py (cuda_lowering worker).


def test_engine_paged_steps_lower_to_mosaic_gpu(monkeypatch):
  """The engine's decode call and prefill chunk over page pools (m3jax.engine, same 8-way slice as above) lower
  for CUDA with every op on its kernel: the paged read path takes no reference fallback."""
  import functools  # pylint: disable=g-import-not-at-top
  from kernel_modes import lowered_kernel_kinds  # pylint: disable=g-import-not-at-top
  from m3jax.engine import _admit_jit, _steps_jit  # pylint: disable=g-import-not-at-top
  from m3jax.generate import Decoder, _decode_weights_jit  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)
  model = _tp8_slice_model()
  d = Decoder.of(model)
  pools = jax.eval_shape(lambda: model.init_paged_caches(64, BLOCK))
  weights = jax.eval_shape(functools.partial(_decode_weights_jit, d.graph), d.params)
  rows, width, i32, f32 = 4, 32, jnp.int32, jnp.float32
  logits = _spec((rows, model.config.text.vocab_size), f32)

  def lowered(fn, *args, **kwargs):
    return lowered_kernel_kinds(fn.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text())

  decode = lowered(_steps_jit, d.graph, d.params, weights, logits, pools, _spec((rows, width), i32),
                   _spec((rows,), i32), _spec((rows,), i32), _spec((rows,), f32), _spec((rows,), i32),
                   _spec((rows,), f32), num_steps=2, top_logprobs=-1)
  prefill = lowered(_admit_jit, d.graph, d.params, _spec((1, 256), i32), _spec((1,), i32), _spec((1,), i32),
                    _spec((1,), i32), _spec((1, width), i32), logits, pools)
  assert decode == {"attention": 2, "indexer": 1, "moe": 2}, decode
  assert prefill == {"attention": 2, "indexer": 1, "moe": 2}, prefill


# fp8 (QuantizedWeight) kernels: MXFP8 (the release format) and FP8-block weights in the checkpoint orientation.
def _quantized_spec(shape, fmt: str = "mxfp8"):
  from pallas_kernels.quant import QuantizedWeight  # pylint: disable=g-import-not-at-top
  values = _spec(shape, jnp.float8_e4m3fn)
  if fmt == "mxfp8":
    return QuantizedWeight(values, _spec((*shape[:-1], shape[-1] // 32), jnp.uint8), "mxfp8", (1, 32))
  grid = (*shape[:-2], shape[-2] // 128, shape[-1] // 128)
  return QuantizedWeight(values, _spec(grid, jnp.float32), "fp8_block", (128, 128))


_FP8_CASES = [pytest.param(FULL, "mxfp8", id="full-mxfp8"), pytest.param(TP8, "mxfp8", id="tp8-mxfp8"),
              pytest.param(FULL, "fp8_block", id="full-fp8_block")]


@pytest.mark.parametrize("dims,fmt", _FP8_CASES)
@pytest.mark.parametrize("tokens", [4, 64, 300], ids=["decode4", "decode64", "prefill300"])
def test_fp8_moe_block_lowers(dims: Dims, fmt: str, tokens: int):
  i = dims.expert_width
  args = (_spec((tokens, HIDDEN)), _spec((HIDDEN, EXPERTS), jnp.float32), _spec((EXPERTS,), jnp.float32),
          _quantized_spec((EXPERTS, 2 * i, HIDDEN), fmt), _quantized_spec((EXPERTS, HIDDEN, i), fmt),
          _quantized_spec((2 * i, HIDDEN), fmt), _quantized_spec((HIDDEN, i), fmt))
  text = _lower_for_cuda(lambda *a: moe_block(*a, top_k=TOP_K, routed_scaling_factor=2.5, swiglu_alpha=1.702,
                                              swiglu_limit=7.0, num_sms=132), *args)
  assert f"moe_grouped_fp8_{fmt}_swiglu" in text and f"moe_grouped_fp8_{fmt}_none" in text


def _nvfp4_spec(shape, parts: int = 1):
  """An NVFP4 QuantizedWeight [..., out, in] of shapes only: packed uint8 values, e4m3 group scales, fp32 global
  multipliers per row part."""
  from pallas_kernels.quant import QuantizedWeight  # pylint: disable=g-import-not-at-top
  return QuantizedWeight(_spec((*shape[:-1], shape[-1] // 2), jnp.uint8),
                         _spec((*shape[:-1], shape[-1] // 16), jnp.float8_e4m3fn), "nvfp4", (1, 16),
                         _spec((*shape[:-2], parts), jnp.float32))


@pytest.mark.parametrize("tokens", [4, 300], ids=["decode4", "prefill300"])
def test_nvfp4_moe_block_lowers(tokens: int):
  """M3's MoE block with NVFP4 routed experts (the W4A16 kernel) and the bf16 shared expert, as m3jax.load(...,
  keep_quantized=True) keeps an NVFP4 checkpoint."""
  i = FULL.expert_width
  args = (_spec((tokens, HIDDEN)), _spec((HIDDEN, EXPERTS), jnp.float32), _spec((EXPERTS,), jnp.float32),
          _nvfp4_spec((EXPERTS, 2 * i, HIDDEN), parts=2), _nvfp4_spec((EXPERTS, HIDDEN, i)),
          _spec((HIDDEN, 2 * i)), _spec((i, HIDDEN)))
  text = _lower_for_cuda(lambda *a: moe_block(*a, top_k=TOP_K, routed_scaling_factor=2.5, swiglu_alpha=1.702,
                                              swiglu_limit=7.0, num_sms=132), *args)
  assert "moe_grouped_w4a16_nvfp4_swiglu" in text and "moe_grouped_w4a16_nvfp4_none" in text


@pytest.mark.parametrize("tokens", [4, 300], ids=["decode4", "prefill300"])
def test_fp8_expert_parallel_routed_experts_lower(tokens: int):
  """One device of an 8-way expert-parallel mesh with MXFP8 experts: 16 whole experts."""
  i, local = FULL.expert_width, EXPERTS // 8
  args = (_spec((tokens, HIDDEN)), _spec((tokens, TOP_K), jnp.float32), _spec((tokens, TOP_K), jnp.int32),
          _quantized_spec((local, 2 * i, HIDDEN)), _quantized_spec((local, HIDDEN, i)), _spec((), jnp.int32))
  text = _lower_for_cuda(lambda *a: routed_experts(*a, alpha=1.702, limit=7.0, num_sms=132), *args)
  assert "moe_grouped_fp8_mxfp8_swiglu" in text


# M3's dense projections [out, in]: attention q / k (= v) / o, the dense MLP's gate_up and down.
_PROJECTIONS = {"q": (8192, HIDDEN), "k": (512, HIDDEN), "o": (HIDDEN, 8192), "mlp_gate_up": (24576, HIDDEN),
                "mlp_down": (HIDDEN, 12288)}


@pytest.mark.parametrize("proj", list(_PROJECTIONS))
@pytest.mark.parametrize("tokens", [1, 64, 300], ids=["decode1", "decode64", "prefill300"])
def test_quantized_matmul_lowers(proj: str, tokens: int):
  from pallas_kernels.linear import quantized_matmul  # pylint: disable=g-import-not-at-top
  out_f, in_f = _PROJECTIONS[proj]
  _assert_mosaic(_lower_for_cuda(lambda x, w: quantized_matmul(x, w, num_sms=132), _spec((tokens, in_f)),
                                 _quantized_spec((out_f, in_f))))


@pytest.mark.parametrize("tokens", [1, 64, 300], ids=["decode1", "decode64", "prefill300"])
def test_quantized_matmul_fp32_output_lowers(tokens: int):
  """fp32 output (the dense MLP's gate_up at decode): stored transposed as the accumulators hold it."""
  from pallas_kernels.linear import quantized_matmul  # pylint: disable=g-import-not-at-top
  text = _lower_for_cuda(lambda x, w: quantized_matmul(x, w, num_sms=132, out_dtype=jnp.float32),
                         _spec((tokens, HIDDEN)), _quantized_spec((3072, HIDDEN)))
  _assert_mosaic(text)


@pytest.mark.parametrize("width", [12288, 1536], ids=["full", "tp8"])
@pytest.mark.parametrize("tokens", [4, 300], ids=["decode4", "prefill300"])
def test_quantized_gated_mlp_lowers(width: int, tokens: int):
  """M3's dense MLP (and one GPU's 8-way slice of it) with MXFP8 weights: split-K matmuls at decode, the
  grouped-GEMM pair with the SwiGLU epilogue at prefill."""
  from pallas_kernels.linear import quantized_gated_mlp  # pylint: disable=g-import-not-at-top
  text = _lower_for_cuda(lambda x, gu, dn: quantized_gated_mlp(x, gu, dn, alpha=1.702, limit=7.0, num_sms=132),
                         _spec((tokens, HIDDEN)), _quantized_spec((2 * width, HIDDEN)),
                         _quantized_spec((HIDDEN, width)))
  _assert_mosaic(text)
  if tokens > 64:
    assert "moe_grouped_fp8_mxfp8_swiglu" in text
