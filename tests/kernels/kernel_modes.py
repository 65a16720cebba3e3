"""The two ways kernel tests run: Mosaic GPU interpret mode (CPU, always) and compiled on an sm90 GPU."""

import collections
import re

import jax
import pytest


def on_sm90() -> bool:
  """True on a Hopper (compute capability 9.0) GPU backend."""
  if jax.default_backend() != "gpu":
    return False
  return getattr(jax.devices()[0], "compute_capability", "") in ("9.0", "9.0a")


NEEDS_SM90 = pytest.mark.skipif(not on_sm90(), reason="needs an sm90 GPU")
CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode runs on the CPU backend")

MODES = [
    pytest.param("interpret", marks=pytest.mark.interpret),
    pytest.param("gpu", marks=NEEDS_SM90),
]


def lowered_kernel_kinds(stablehlo_text: str) -> collections.Counter:
  """Mosaic GPU kernel modules of a program lowered for CUDA, by kind (attention / attention_kv_major / indexer /
  moe); a module called by several layers appears once."""
  names = re.findall(r"m3_(attention_kv_major|attention|indexer)\w*?_mosaic|(moe)_grouped_\w*?_mosaic", stablehlo_text)
  return collections.Counter(a or b for a, b in names)


def lowered_step_kernels(model, *, decode_batch: int, prefill_batch: int) -> dict[str, collections.Counter]:
  """Kernel kinds of a decode step (4096-slot caches) and a prefill (1000-token prompts, 2048-slot caches) of an
  abstract ``model`` lowered for CUDA; the caller makes m3jax.ops dispatch pick compiled kernels. Under the
  model's sharding plan, parameters must carry their shardings; caches get the plan's, token inputs are
  replicated."""
  texts = lowered_step_texts(model, decode_batch=decode_batch, prefill_batch=prefill_batch)
  return {name: lowered_kernel_kinds(text) for name, text in texts.items()}


def lowered_step_texts(model, *, decode_batch: int, prefill_batch: int, decode_weights: bool = False
                       ) -> dict[str, str]:
  """The StableHLO texts of ``lowered_step_kernels``' decode step and prefill; ``decode_weights``: the decode step
  takes the model's ``decode_weights()`` (built in the same program), as a decode loop's steps do."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from m3jax.cache import LayerCache  # pylint: disable=g-import-not-at-top
  from m3jax.generate import _decode, _prefill  # pylint: disable=g-import-not-at-top

  plan = model.sharding_plan
  graphdef, state = nnx.split(model)

  def spec(shape, dtype, names=None):
    if plan is None:
      return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=plan.sharding(names or (None,) * len(shape), shape))

  caches = tuple(
      LayerCache(**{f: None if getattr(c, f) is None else spec(getattr(c, f).shape, getattr(c, f).dtype,
                                                                 LayerCache.LOGICAL_AXES[f])
                    for f in ("k", "v", "idx_k")})
      for c in jax.eval_shape(lambda: model.init_caches(decode_batch, 4096)))

  def lowered(fn, *args) -> str:
    return jax.jit(fn).trace(state, *args).lower(lowering_platforms=("cuda",)).as_text()

  def decode(st, tok, pos, c):
    m = nnx.merge(graphdef, st)
    return _decode(m, tok, pos, c, m.decode_weights() if decode_weights else None)

  return {
      "decode": lowered(decode, spec((decode_batch,), jnp.int32), spec((decode_batch,), jnp.int32), caches),
      "prefill": lowered(lambda st, ids, lengths: _prefill(nnx.merge(graphdef, st), ids, lengths, 2048),
                         spec((prefill_batch, 1000), jnp.int32), spec((prefill_batch,), jnp.int32)),
  }
