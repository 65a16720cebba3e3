"""Next-token and multi-token-prediction losses of an M3ForCausalLM (differentiable: ``nnx.value_and_grad``).

Both follow HF's ``labels=input_ids`` convention: the logits at position t are scored against the token at
t + 1 (MTP: t + 2), and the loss is the mean cross-entropy over every scored target (or over the targets
``loss_mask`` keeps). They run on the reference ops: ``reference_view`` gives a model whose layers call the
pure-jnp references (the Pallas kernels have no backward pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax.model import ForwardOutput, M3ForCausalLM
from m3jax.research import Collect


def reference_view(model: M3ForCausalLM) -> M3ForCausalLM:
  """``model`` itself when it already runs the references; otherwise a view of the same parameters (no copy)
  whose layers run the pure-jnp references, which JAX can differentiate (the Pallas kernels cannot be)."""
  if model.kernels == "reference":
    return model
  graphdef, state = nnx.split(model)
  view = nnx.merge(graphdef, state)
  for _, node in nnx.iter_graph(view):
    if isinstance(node, nnx.Module) and getattr(node, "kernels", None) is not None:
      node.kernels = "reference"
  return view


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """logits fp32 [..., V], targets int [...] -> fp32 [...] cross-entropy (natural log)."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return log_z - picked


def masked_mean(values: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Mean of ``values`` over the entries ``mask`` keeps (all without a mask); 0 when it keeps none."""
  if mask is None:
    return jnp.mean(values)
  mask = mask.astype(jnp.float32)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _check_tokens(input_ids: jax.Array, loss_mask: jax.Array | None, min_len: int, what: str) -> None:
  if input_ids.ndim != 2:
    raise ValueError(f"{what}: input_ids must be [batch, seq], got shape {input_ids.shape}")
  if input_ids.shape[1] < min_len:
    raise ValueError(f"{what}: needs sequences of at least {min_len} tokens, got {input_ids.shape[1]}")
  if loss_mask is not None and loss_mask.shape != input_ids.shape:
    raise ValueError(f"{what}: loss_mask has shape {loss_mask.shape}, expected {input_ids.shape} like input_ids")


def lm_loss_from_logits(logits: jax.Array, input_ids: jax.Array, loss_mask: jax.Array | None = None) -> jax.Array:
  """Mean next-token cross-entropy of logits fp32 [B, S, V] against input_ids [B, S] (HF's labels=input_ids:
  position t predicts token t + 1; mean over the B x (S - 1) targets, or over those with loss_mask[b, t + 1])."""
  ce = token_cross_entropy(logits[:, :-1], input_ids[:, 1:])
  return masked_mean(ce, None if loss_mask is None else loss_mask[:, 1:])


def lm_loss(model: M3ForCausalLM, input_ids: jax.Array, loss_mask: jax.Array | None = None) -> jax.Array:
  """Mean next-token cross-entropy of ``model`` on input_ids int [B, S] (HF's ``labels=input_ids``).

  Args:
    model: an M3ForCausalLM (run on the reference ops, see ``reference_view``).
    input_ids: int [B, S], S >= 2; every row starts at position 0.
    loss_mask: optional [B, S] (bool or 0/1): loss_mask[b, t] keeps the target token t (t >= 1; column 0 is
      never a target). Default: every target, i.e. the mean over B x (S - 1).

  Returns:
    fp32 scalar.
  """
  input_ids = jnp.asarray(input_ids)
  _check_tokens(input_ids, loss_mask, 2, "lm_loss")
  out = reference_view(model).forward(input_ids)
  return lm_loss_from_logits(out.logits, input_ids, loss_mask)


def mtp_loss_from_trunk(model: M3ForCausalLM, input_ids: jax.Array, hidden: jax.Array,
                        loss_mask: jax.Array | None = None, *, collect: Collect | None = None,
                        dense_attention: bool = False) -> tuple[jax.Array, ForwardOutput]:
  """The first MTP module's loss (M3_SPEC §8) given the trunk's final-normed hidden states hidden [B, S, H].

  At position t the module reads x_{t+1} and h_t and predicts x_{t+2}: positions 0 .. S - 2 run, and the
  targets are input_ids[:, 2:] (B x (S - 2) of them, or those with loss_mask[b, t + 2]). The trunk's hidden
  states keep their gradient (as DeepSeek-V3 trains its MTP modules: the MTP loss also trains the trunk).

  Returns:
    (fp32 scalar loss, the module's ForwardOutput (intermediates when ``collect``)).
  """
  _check_tokens(input_ids, loss_mask, 3, "mtp_loss")
  b, s = input_ids.shape
  positions = jnp.broadcast_to(jnp.arange(s - 1, dtype=jnp.int32), (b, s - 1))
  out = model.mtp_forward(input_ids[:, 1:], hidden[:, :-1], positions=positions, step=0, collect=collect,
                          dense_attention=dense_attention)
  ce = token_cross_entropy(out.logits[:, :-1], input_ids[:, 2:])
  return masked_mean(ce, None if loss_mask is None else loss_mask[:, 2:]), out


def mtp_loss(model: M3ForCausalLM, input_ids: jax.Array, loss_mask: jax.Array | None = None) -> jax.Array:
  """Mean cross-entropy of the first MTP module predicting the token after next (x_{t+2} from x_{t+1} and the
  trunk's h_t) on input_ids int [B, S], S >= 3; the model needs its MTP modules (``with_mtp=True``). Weight it
  into a training objective yourself (``lm + w * mtp``; m3jax.training.TrainConfig.mtp_weight)."""
  input_ids = jnp.asarray(input_ids)
  _check_tokens(input_ids, loss_mask, 3, "mtp_loss")
  view = reference_view(model)
  hidden = view.forward(input_ids).hidden
  return mtp_loss_from_trunk(view, input_ids, hidden, loss_mask)[0]
