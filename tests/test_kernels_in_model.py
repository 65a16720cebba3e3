"""The whole model on the Pallas kernels (interpret mode on CPU) against the same model on the references.

Dims are the smallest the kernels accept (block 128, 16 query heads per KV group, head dim 64, MoE output
width 256), so every heavy op runs its kernel: the test fails if any op falls back to the reference.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.config import M3Config, TextConfig
from program_walk import concatenates, hlo_computations, loop_body_computations


def _kernel_ready_config() -> M3Config:
  text = TextConfig(vocab_size=256, hidden_size=256, num_layers=2, num_heads=32, num_kv_heads=2, head_dim=64,
                    intermediate_size=128, dense_intermediate_size=256, shared_intermediate_size=128,
                    num_experts=8, num_experts_per_tok=2, attention_types=("full", "sparse"),
                    mlp_types=("dense", "moe"), index_num_heads=2, index_head_dim=64, index_block_size=128,
                    index_topk_blocks=2, index_local_blocks=1)
  return M3Config(text=text)


def _on_references(model: m3jax.M3ForCausalLM) -> m3jax.M3ForCausalLM:
  """The same model and weights on the pure-jnp references: the golden side of the checks below. Its forwards
  cost a fraction of a second where interpret-mode kernels take tens, and the kernels' own agreement with it is
  bounded by ``test_bf16_model_on_kernels_matches_the_reference_path``."""
  shape = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(
      model.config, dtype=model.dtype, kernels="reference", with_vision=model.vision is not None,
      with_mtp=model.mtp is not None))
  return nnx.merge(nnx.graphdef(shape), nnx.state(model))


def _padded_full_forward(reference: m3jax.M3ForCausalLM, width: int = 512):
  """ids (<= width of them) -> the reference's logits fp32 [len(ids), V] from one forward over the ids right-padded
  to ``width``: one compiled program for every length (causal: the padding does not reach the real positions)."""
  run = jax.jit(lambda i: reference.forward(i, positions=jnp.arange(width, dtype=jnp.int32)[None],
                                            caches=reference.init_caches(1, width)).logits[0])

  def full_forward(ids: list[int]) -> np.ndarray:
    return np.asarray(run(jnp.asarray([ids + [0] * (width - len(ids))], jnp.int32)))[:len(ids)]
  return full_forward


@pytest.mark.slow
def test_bf16_model_on_kernels_matches_the_reference_path(caplog):
  cfg = _kernel_ready_config()
  reference = m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels="reference", rngs=nnx.Rngs(0))
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels="pallas")))
  kernels = nnx.merge(graphdef, nnx.state(reference))
  ids = jax.random.randint(jax.random.key(1), (1, 400), 0, cfg.text.vocab_size)  # > top-k x 128: pruned
  with caplog.at_level(logging.WARNING, logger="m3jax.ops"):
    got = np.asarray(kernels(ids))
  assert not [r.message for r in caplog.records if "falls back" in r.message or "no Pallas kernel" in r.message]
  want = np.asarray(reference(ids))
  per_token = np.abs(got - want).max(-1) / np.abs(want).max()
  # bf16 rounding differs between the two paths; a rare near-tie can flip a block or expert choice.
  assert np.median(per_token) < 5e-3, np.median(per_token)
  assert np.mean(per_token > 2e-2) < 0.02, np.sort(per_token)[-10:]
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95


@pytest.mark.quick
def test_fp32_decode_loop_splits_the_expert_weights_once_outside_the_loop():
  """fp32 expert weights run the MoE kernels through a bf16 hi / lo split (3x K). A decode loop builds it once,
  before the loop (``decode_weights``), not per step: XLA:GPU left the per-call split in the compiled while body
  (twelfth session, BENCHMARKS.md). Same logits with and without the prepared operands."""
  from m3jax.generate import _decode, _generate_jit  # pylint: disable=g-import-not-at-top
  from m3jax.sampling import SamplingParams  # pylint: disable=g-import-not-at-top

  cfg = _kernel_ready_config()
  t = cfg.text
  model = m3jax.M3ForCausalLM(cfg, dtype=jnp.float32, kernels="pallas", rngs=nnx.Rngs(0))
  prepared = model.decode_weights()
  assert prepared[0].experts is None  # dense MLP layer
  experts = prepared[1].experts
  e, h, i, s = t.num_experts, t.hidden_size, t.intermediate_size, t.shared_intermediate_size
  split = {(e, 3 * h, 2 * i), (e, 3 * i, h), (3 * h, 2 * s), (3 * s, h)}
  assert {experts.gate_up.shape, experts.down.shape, experts.shared_gate_up.shape, experts.shared_down.shape} == split
  assert experts.gate_up.dtype == jnp.bfloat16

  graphdef, state = nnx.split(model)
  args = (graphdef, state, jnp.ones((2, 16), jnp.int32), jnp.asarray([16, 12], jnp.int32), jax.random.key(0),
          jnp.asarray([2], jnp.int32), jnp.int32(0), None, jnp.int32(3))
  kw = dict(width=32, sampling=SamplingParams(), cache_len=128)
  found = [(tuple(aval.shape), inside) for aval, inside in concatenates(
      _generate_jit.trace(*args, **kw).jaxpr.jaxpr, lambda aval: aval.dtype == jnp.bfloat16 and aval.shape in split)]
  assert [shape for shape, inside in found if inside] == [], "fp32 expert weights split inside the decode loop"
  # each of the four split once in the prefill's MoE call and once before the loop
  assert sorted(shape for shape, _ in found) == sorted(list(split) * 2), found

  # The compiled program keeps it there (on the GPU this is the check that matters).
  hlo = _generate_jit.lower(*args, **kw).compile().as_text()
  comps = hlo_computations(hlo)
  loop_comps = loop_body_computations(hlo, comps)
  assert loop_comps, "no while loop in the compiled generate program"
  pattern = "|".join(rf"bf16\[{','.join(map(str, shape))}\]" for shape in split)
  in_body = [n for n in loop_comps if re.search(rf"= (?:{pattern})\{{[^}}]*\}} concatenate\(", comps[n])]
  assert not in_body, f"split expert weights concatenated in the loop body: {in_body}"

  # One decode step with and without the prepared operands, and on the reference path: the same logits to fp32
  # rounding (the programs differ around the kernels, so not bit for bit).
  caches = model.init_caches(2, 128)
  tokens, positions = jnp.asarray([3, 5], jnp.int32), jnp.asarray([0, 0], jnp.int32)
  step = lambda m, prep: np.asarray(jax.jit(lambda p: _decode(m, tokens, positions, caches, p)[0])(prep))
  want = step(_on_references(model), None)
  for got in (step(model, prepared), step(model, None)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_speculative_decoding_on_kernels():
  """MTP speculative decoding with every op on its kernel. The verification forward runs k + 1 new tokens per
  sequence against the caches (the decode indexer / attention kernels' few-token path): its logits must match
  one-token steps. The tokens of ``generate_speculative`` must be greedy under the target: each one the argmax of
  the full forward's logits (on the references), up to bf16 near-ties (a k + 1-token forward and one-token steps
  round differently, so an exact tie-break cannot be asked of bf16 kernels)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from m3jax.speculative import generate_speculative  # pylint: disable=g-import-not-at-top

  base = _kernel_ready_config()
  cfg = dataclasses.replace(base, text=dataclasses.replace(base.text, num_mtp_modules=1))
  model = m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels="pallas", rngs=nnx.Rngs(0), with_mtp=True)
  rng = np.random.default_rng(0)

  # Few-token decode against one-token steps, from the same prefilled cache (300 > top-k x 128: pruned). The
  # cache is prefilled on the references (same weights, same cache layout): both sides start from it, and the
  # kernels' prefill into a cache runs in generate_speculative below and in the chunked-prefill test.
  n = 300
  prompt = rng.integers(0, 256, n + 4).tolist()
  ids = jnp.asarray([prompt], jnp.int32)
  pos = jnp.arange(len(prompt), dtype=jnp.int32)[None]
  reference = _on_references(model)
  prefilled = jax.jit(lambda i, p: reference.forward(i, positions=p, caches=reference.init_caches(1, 512)).caches)(
      ids[:, :n], pos[:, :n])
  forward = jax.jit(lambda i, p, c: model.forward(i, positions=p, caches=c))
  steps, caches = [], prefilled
  for i in range(n, n + 4):
    out = forward(ids[:, i:i + 1], pos[:, i:i + 1], caches)
    steps.append(np.asarray(out.logits[0, 0]))
    caches = out.caches
  together = np.asarray(forward(ids[:, n:], pos[:, n:], prefilled).logits[0])
  scale = np.abs(np.stack(steps)).max()
  assert np.abs(together - np.stack(steps)).max() / scale < 2e-2

  # Row 0's rounds verify against 256+ cached tokens (more than top-k x 128: pruned), row 1's against fewer
  # (ragged); 256 is a whole bucket, so the prefill inside is 2 x 256 tokens, not 2 x 512.
  prompts = [rng.integers(0, 256, 256).tolist(), rng.integers(0, 256, 130).tolist()]
  out = generate_speculative(model, prompts, max_new_tokens=6, num_draft_tokens=2, eos_token_ids=())
  assert out.drafts.shape[2] == 2 and out.rounds.min() >= 2
  full_forward = _padded_full_forward(reference)
  for row, p in enumerate(prompts):
    seq = p + out.tokens[row].tolist()
    logits = full_forward(seq)[len(p) - 1:len(seq) - 1]
    chosen = logits[np.arange(6), out.tokens[row]]
    assert np.all(chosen >= logits.max(-1) - 2e-2 * np.abs(logits).max()), (row, logits.max(-1) - chosen)


@pytest.mark.slow
def test_chunked_prefill_on_kernels(caplog):
  """A prefill in chunks of 256 tokens (each chunk's queries against the cache of the ones before: the indexer's
  and the attention kernels' cached-prefix path) gives the last-token logits and caches of a one-shot prefill on
  the references, with no op falling back to its reference."""
  cfg = _kernel_ready_config()
  model = m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels="pallas", rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 256, 512).tolist(), rng.integers(0, 256, 300).tolist()]  # 2 chunks; row 1 ends in #2
  whole = m3jax.prefill(_on_references(model), prompts, max_new_tokens=4)
  with caplog.at_level(logging.WARNING, logger="m3jax.ops"):
    chunked = m3jax.prefill(model, prompts, max_new_tokens=4, prefill_chunk=256)
  assert not [r.message for r in caplog.records if "falls back" in r.message or "no Pallas kernel" in r.message]
  want, got = np.asarray(whole.logits), np.asarray(chunked.logits)
  assert np.abs(got - want).max() / np.abs(want).max() < 2e-2
  for layer, (a, b) in enumerate(zip(whole.caches, chunked.caches)):
    for name in ("k", "v", "idx_k"):
      x, y = getattr(a, name), getattr(b, name)
      if x is not None:
        for row, n in enumerate((512, 300)):
          x_r, y_r = np.asarray(x[row, :n], np.float32), np.asarray(y[row, :n], np.float32)
          assert np.abs(x_r - y_r).max() / np.abs(x_r).max() < 2e-2, (layer, name, row)


@pytest.mark.slow
def test_conversation_on_kernels(caplog):
  """A second turn prefilled against the first turn's caches on the kernels (the cached-prefix path at an offset
  that is not a multiple of the block), its padding clipped at the end of the caches (303 cached + 150 new ids
  pad to 256, past the 512 slots): each reply token is greedy under the whole conversation's full forward (on the
  references), up to bf16 near-ties, and no op falls back to its reference."""
  from m3jax.conversation import Conversation  # pylint: disable=g-import-not-at-top

  cfg = _kernel_ready_config()
  model = m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels="pallas", rngs=nnx.Rngs(0))
  rng = np.random.default_rng(2)
  conv = Conversation(model, max_length=512, eos_token_ids=(), steps_per_call=3)
  reference = _on_references(model)
  full_forward = _padded_full_forward(reference)
  prompt = rng.integers(0, 256, 300).tolist()
  with caplog.at_level(logging.WARNING, logger="m3jax.ops"):
    for turn in range(2):
      reply = np.concatenate(list(conv.reply(prompt, max_new_tokens=3))).tolist()
      if turn == 1:
        assert (conv.last_turn.reused, conv.last_turn.prefilled) == (303, 150)
      seq = prompt + reply
      logits = full_forward(seq)[len(prompt) - 1:len(seq) - 1]
      chosen = logits[np.arange(3), reply]
      assert np.all(chosen >= logits.max(-1) - 2e-2 * np.abs(logits).max()), (turn, logits.max(-1) - chosen)
      prompt = seq + rng.integers(0, 256, 150).tolist()
  # The caches built over two turns hold what one prefill of the whole conversation writes.
  n = len(conv.history)
  whole = m3jax.prefill(reference, [conv.history], max_new_tokens=1)
  for layer, (a, b) in enumerate(zip(whole.caches, conv.caches)):
    for name in ("k", "v", "idx_k"):
      if getattr(a, name) is not None:
        x, y = (np.asarray(getattr(c, name)[0, :n], np.float32) for c in (a, b))
        assert np.abs(x - y).max() / np.abs(x).max() < 2e-2, (layer, name)
  assert not [r.message for r in caplog.records if "falls back" in r.message or "no Pallas kernel" in r.message]
