"""One tiny served checkpoint for the test files that talk to ``m3jax serve`` (test_serving, test_openai_sdk,
test_lm_eval): the demo checkpoint (with a chat template that refuses unknown roles) behind a Server of the same
shapes in every file (2 slots, max_length 256, 3 steps per call, top-3 log-probabilities), so each file's
programs are the same ones, read back from the persistent compilation cache instead of compiled again."""

import contextlib
import json

import m3jax
from m3jax.demo import build_demo_checkpoint
from m3jax.engine import Engine
from m3jax.serving import Server
from m3jax.serving_http import serve
from m3jax.tokenizer import load_tokenizer

MODEL_NAME = "tiny-m3"
ENGINE_SHAPES = dict(slots=2, max_length=256, steps_per_call=3, logprobs=True, top_logprobs=3)

# HF chat templates refuse conversations they cannot render with raise_exception(...).
_REFUSING = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
             "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}")


def build_checkpoint(directory) -> str:
  """The demo checkpoint under ``directory``, its chat template refusing roles other than system / user /
  assistant."""
  ckpt = build_demo_checkpoint(directory / "tiny")
  with open(f"{ckpt}/tokenizer_config.json") as f:
    config = json.load(f)
  config["chat_template"] = _REFUSING + config["chat_template"]
  with open(f"{ckpt}/tokenizer_config.json", "w") as f:
    json.dump(config, f)
  return ckpt


@contextlib.contextmanager
def served_checkpoint(directory, *, vision: bool = False):
  """A served tiny checkpoint on a free localhost port (m3jax.serving_http, on its own thread) -> {"url", "model",
  "ckpt", "tok", "engine", "server"}; shut down on exit. ``vision``: with the checkpoint's vision tower (chat
  takes images), as ``m3jax serve`` loads it; without, the text backbone (``m3jax serve --no-vision``)."""
  ckpt = build_checkpoint(directory)
  model = m3jax.load(ckpt, kernels="reference", text_only=not vision)
  engine = Engine(model, **ENGINE_SHAPES)
  server = Server(engine, ckpt, model_name=MODEL_NAME)
  httpd = serve(server, port=0)
  try:
    yield {"url": httpd.url, "model": model, "ckpt": ckpt, "tok": load_tokenizer(ckpt), "engine": engine,
           "server": server}
  finally:
    httpd.stop()
    server.close()
