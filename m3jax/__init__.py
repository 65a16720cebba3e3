"""m3jax: MiniMax M3 in JAX / Flax NNX / Pallas.

Public API (stable): ``m3jax.load(path) -> model``; ``model(input_ids int32[B, S]) -> fp32 logits [B, S, V]``.
"""

from m3jax.config import ConfigError, M3Config, TextConfig, VisionConfig, m3_full, tiny
from m3jax.conversation import Conversation
from m3jax.generate import Decoder, GenerateOutput, PrefillOutput, decode_step, generate, generate_stream, prefill
from m3jax.model import ForwardOutput, M3ForCausalLM
from m3jax.scoring import score_continuations, token_logprobs

__all__ = ["ConfigError", "Conversation", "Decoder", "ForwardOutput", "GenerateOutput", "PrefillOutput", "decode_step", "generate",
           "generate_stream", "prefill", "score_continuations", "token_logprobs", "M3Config", "M3ForCausalLM", "TextConfig", "VisionConfig", "m3_full",
           "tiny", "load"]


def load(path, **kwargs):
  """Loads an M3 checkpoint directory (original MiniMax or HF safetensors layout). See m3jax.checkpoint.load.

  With ``mesh=`` (m3jax.sharding.make_mesh, or a jax Mesh lacking some of the axes data / expert / tensor),
  parameters are restored straight into their shards under m3jax.sharding.RULES (or ``axis_rules=``) and the
  model runs sharded (m3jax.checkpoint.loader.load_on_mesh).
  """
  from m3jax.checkpoint import loader  # pylint: disable=g-import-not-at-top

  if kwargs.get("mesh") is not None and kwargs.get("shardings") is None:
    return loader.load_on_mesh(path, **kwargs)
  return loader.load(path, **kwargs)
