"""Training losses against torch autograd on HF transformers 5.23.0 (tests/fixtures/flat_b16/gradients.npz, written
by scripts/make_hf_fixtures.py --gradients): the LM loss and its gradients, and the indexer alignment loss restated
in torch on HF's modules, in both phases. Plus the alignment loss's own properties and router balancing."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import m3jax
from conftest import FIXTURES
from m3jax.checkpoint.mapping import text_rules
from m3jax.research import Collect
from m3jax.training import indexer_alignment_loss, lm_loss
from m3jax.training.router_balance import balanced_bias, expert_load

FIXTURE = FIXTURES / "flat_b16"


def _rel(got, want) -> float:
  return float(np.max(np.abs(np.asarray(got) - want)) / max(np.max(np.abs(want)), 1e-30))


@pytest.fixture(scope="module")
def hf():
  return np.load(FIXTURE / "gradients.npz")


@pytest.fixture(scope="module")
def model():
  return m3jax.load(FIXTURE / "checkpoint", kernels="reference")


def _hf_layout_grads(model, grads) -> dict[str, np.ndarray]:
  """Our parameter gradients rearranged into HF's in-memory tensors (the checkpoint rules are linear maps)."""
  flat = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}
  out = {}
  for rule in text_rules(model.config.text, "hf"):
    if rule.path in flat:
      out.update(zip(rule.sources, rule.from_param(flat[rule.path])))
  return out


def test_lm_loss_and_gradients_match_torch_autograd(model, hf):
  ids = np.load(FIXTURE / "reference.npz")["input_ids"]
  loss, grads = nnx.value_and_grad(lambda m: lm_loss(m, ids))(model)
  assert abs(float(loss) - float(hf["loss"])) <= 1e-5 * abs(float(hf["loss"]))
  ours = _hf_layout_grads(model, grads)
  names = [k.removeprefix("grad/") for k in hf.files if k.startswith("grad/")]
  assert len(names) == 7 and set(hf["no_grad"]) == {n for n in names if ".indexer." in n}
  for name in names:
    want = hf[f"grad/{name}"]
    if name in set(hf["no_grad"]):  # top-k is discrete: neither engine sends the LM loss into the indexer
      assert np.all(np.asarray(ours[name]) == 0), name
    else:
      assert np.max(np.abs(want)) > 0, name
      assert _rel(ours[name], want) <= 1e-4, f"{name}: {_rel(ours[name], want):.2e}"


def test_lm_loss_mask_and_errors(model):
  ids = np.load(FIXTURE / "reference.npz")["input_ids"][:, :20]
  full = float(lm_loss(model, ids))
  ones = float(lm_loss(model, ids, loss_mask=np.ones_like(ids)))
  assert ones == pytest.approx(full, rel=1e-6)
  half = np.zeros_like(ids)
  half[:, 10:] = 1
  logits = np.asarray(model(ids))
  logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  want = -np.mean(np.take_along_axis(logp[:, 9:-1], ids[:, 10:, None], axis=-1))
  assert float(lm_loss(model, ids, loss_mask=half)) == pytest.approx(float(want), rel=1e-5)
  with pytest.raises(ValueError, match="at least 2 tokens"):
    lm_loss(model, ids[:, :1])
  with pytest.raises(ValueError, match="loss_mask has shape"):
    lm_loss(model, ids, loss_mask=half[:, :5])


@pytest.mark.parametrize("phase", ["dense", "sparse"])
def test_indexer_alignment_loss_matches_torch(model, hf, phase):
  ids = jnp.asarray(np.load(FIXTURE / "reference.npz")["input_ids"])
  sparse_layers = [i for i, t in enumerate(model.config.text.attention_types) if t == "sparse"]

  def losses(m):
    out = m.forward(ids, collect=Collect(indexer_alignment=True, block_ids=True))
    recs = out.intermediates
    return [indexer_alignment_loss(recs[i]["alignment_target"], recs[i]["alignment_scores"],
                                   recs[i]["block_ids"] if phase == "sparse" else None) for i in sparse_layers]

  for j, layer in enumerate(sparse_layers):
    loss, grads = nnx.value_and_grad(lambda m: losses(m)[j])(model)
    want = float(hf[f"alignment/{layer}/{phase}/loss"])
    assert abs(float(loss) - want) <= 1e-5 * want, (layer, float(loss), want)
    ours = _hf_layout_grads(model, grads)
    for proj in ("q_proj", "k_proj"):
      ref = hf[f"alignment/{layer}/{phase}/grad/{proj}"]
      got = ours[f"model.language_model.layers.{layer}.self_attn.indexer.{proj}.weight"]
      assert _rel(got, ref) <= 1e-4, (layer, proj, _rel(got, ref))
    # Only the indexer learns from it: every other parameter's gradient is exactly zero.
    for path, var in nnx.to_flat_state(grads):
      if "indexer" not in path or path[1] != layer:
        assert not np.any(np.asarray(var.get_value())), path


@pytest.mark.quick
def test_alignment_loss_is_zero_at_the_target_and_ignores_invisible_blocks():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 3, 4)).astype(np.float32)
  visible = np.arange(4)[None, None, None, :] <= np.arange(5)[None, :, None, None] // 2  # causal-like
  target = np.where(visible, np.exp(logits), 0)
  target /= target.sum(-1, keepdims=True)
  scores = np.where(visible, logits + 3.0, -np.inf)  # a shift does not change the softmax
  assert float(indexer_alignment_loss(target, scores)) == pytest.approx(0.0, abs=1e-6)
  worse = np.where(visible, -logits, -np.inf)
  assert float(indexer_alignment_loss(target, worse)) > 0.05
  # Restricting to a selection renormalises both sides: still zero at the target.
  sel = np.broadcast_to(np.array([0, 1, -1], np.int32), (2, 5, 3, 3))
  assert float(indexer_alignment_loss(target, scores, sel)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.quick
def test_router_balancing_moves_bias_towards_underloaded_experts():
  ids = jnp.array([[[0, 1], [0, 2], [0, 1]]])  # expert 0 in every token, 3 never
  load = expert_load(ids, 4)
  np.testing.assert_allclose(np.asarray(load), [3 / 6, 2 / 6, 1 / 6, 0.0])
  bias = balanced_bias(jnp.zeros(4), load, 0.01)
  np.testing.assert_allclose(np.asarray(bias), [-0.01, -0.01, 0.01, 0.01])


def test_dense_attention_turns_the_selection_off(model):
  """forward(dense_attention=True) (the indexer's warm-up phase): identical where the top-k keeps every block
  (positions < top-k x block), different past it, where the sparse layers really prune."""
  ids = jnp.asarray(np.load(FIXTURE / "reference.npz")["input_ids"])
  t = model.config.text
  live = t.index_topk_blocks * t.index_block_size
  sparse = np.asarray(model.forward(ids).logits)
  dense = np.asarray(model.forward(ids, dense_attention=True).logits)
  np.testing.assert_allclose(dense[:, :live], sparse[:, :live], rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(dense[:, live:] - sparse[:, live:])) > 1e-3


def test_lm_loss_differentiates_a_kernel_model_through_its_reference_view(model):
  """A model built for the Pallas kernels (no backward pass) gets the same loss and gradients: lm_loss runs a
  reference view of the same weights; the model itself keeps its kernels."""
  ids = np.load(FIXTURE / "reference.npz")["input_ids"][:, :40]
  kernel_model = m3jax.load(FIXTURE / "checkpoint", kernels="pallas")
  loss, grads = nnx.value_and_grad(lambda m: lm_loss(m, ids))(kernel_model)
  want_loss, want = nnx.value_and_grad(lambda m: lm_loss(m, ids))(model)
  assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
  for (path, g), (_, w) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want)):
    np.testing.assert_allclose(np.asarray(g.get_value()), np.asarray(w.get_value()), rtol=1e-5, atol=1e-7,
                               err_msg=str(path))
  assert kernel_model.kernels == "pallas" and kernel_model.layers[0].attn.kernels == "pallas"
