"""``m3jax train`` in Python: corpus -> tokenizer -> packed rows -> jit-compiled steps -> an m3jax checkpoint.

Output directory (OUT):
  train.json       the run's settings, config and data summary (a rerun resumes only with the same settings)
  tokenizer/       tokenizer.json, tokenizer_config.json (chat template), generation_config.json
  metrics.jsonl    one JSON object per train step ({"step", "loss", "lm_loss", ...}) and per evaluation
                   ({"step", "val_loss", "val_ppl", ...}); "step" counts completed steps
  checkpoints/     Orbax training-state checkpoints every --checkpoint-every steps (resume after an interruption)
  model/           the trained model: a normal m3jax checkpoint (m3jax.load / generate / serve / export)
Rerunning the same command after an interruption (even kill -9) resumes from the newest complete checkpoint and
reproduces the uninterrupted run's batches, so its loss curve (the data order is a function of the step; there is
no other randomness).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from m3jax import sharding
from m3jax.config import M3Config
from m3jax.logical_axes import ACT_BATCH, ACT_SEQ
from m3jax.training import data, state_checkpoints
from m3jax.training.export_model import export_trained, model_bytes
from m3jax.training.metrics_log import MetricsLog
from m3jax.training.optimizer import OptimizerConfig, make_optimizer
from m3jax.training.params import count_params, init_master, key_of, make_layout
from m3jax.training.settings import TrainConfig, TrainSetupError, check_setup
from m3jax.training.step import ObjectiveConfig, init_state, make_eval_step, make_train_step
from m3jax.training.tokenizer_training import TOKENIZER_FILES, save_tokenizer, special_ids, train_bpe

SETTINGS_FILE = "train.json"


@dataclasses.dataclass
class TrainResult:
  """What a run produced: the checkpoint, the final validation numbers and the run's size."""

  model_dir: str
  steps: int
  val_loss: float
  val_ppl: float
  params: int
  model_bytes: int
  train_tokens: int
  metrics_path: str


def _prepare_output(out: str, settings: dict[str, Any]) -> bool:
  """Creates OUT or checks that it holds this same run; True when it does (a resume)."""
  path = os.path.join(out, SETTINGS_FILE)
  if os.path.exists(path):
    with open(path) as f:
      previous = json.load(f)
    diff = sorted(k for k in set(previous) | set(settings) if k != "train" and previous.get(k) != settings.get(k))
    before, now = previous.get("train", {}), settings["train"]
    diff += sorted(f"--{k.replace('_', '-')} ({before.get(k)} -> {now.get(k)})" for k in set(before) | set(now)
                   if before.get(k) != now.get(k))
    if diff:
      raise TrainSetupError(f"{out} holds a run with other settings ({', '.join(diff)} differ); use a new --out "
                            "or the same settings to resume it")
    return True
  if os.path.isdir(out) and os.listdir(out):
    raise TrainSetupError(f"{out} exists and is not an m3jax training directory (no {SETTINGS_FILE}); m3jax train "
                          "does not write into it")
  os.makedirs(out, exist_ok=True)
  return False


def _tokenizer(out: str, documents: list[str], vocab_size: int, resumed: bool):
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top

  tok_dir = os.path.join(out, "tokenizer")
  if resumed and all(os.path.exists(os.path.join(tok_dir, f)) for f in TOKENIZER_FILES):
    return Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json")), tok_dir
  tok = train_bpe(documents, vocab_size)
  tmp = tok_dir + ".tmp"
  save_tokenizer(tok, tmp)
  os.replace(tmp, tok_dir)
  return tok, tok_dir


def _base_checkpoint(path: str, out: str):
  """Fine-tuning: the base checkpoint's tokenizer (copied to OUT/tokenizer) and its bos / eos ids."""
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top

  tok_dir = os.path.join(out, "tokenizer")
  if not os.path.exists(os.path.join(path, "tokenizer.json")):
    raise TrainSetupError(f"{path}: fine-tuning needs the base checkpoint's tokenizer.json")
  tmp = tok_dir + ".tmp"
  os.makedirs(tmp, exist_ok=True)
  for name in TOKENIZER_FILES + ("chat_template.jinja",):
    if os.path.exists(os.path.join(path, name)):
      shutil.copy2(os.path.join(path, name), os.path.join(tmp, name))
  os.replace(tmp, tok_dir)
  return Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json")), tok_dir


def _base_master(layout, path: str) -> dict[str, jax.Array]:
  """The base checkpoint's weights as fp32 masters, placed like freshly initialised ones."""
  from m3jax.checkpoint.loader import load  # pylint: disable=g-import-not-at-top

  model = load(path, dtype=jnp.float32, kernels="reference", text_only=True, with_mtp=layout.with_mtp)
  flat = {key_of(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  out = {}
  for key in layout.keys:
    target = layout.sharding(key)
    out[key] = flat[key] if target is None else jax.device_put(flat[key], target)
  return out


def _text_config(cfg: M3Config, tok) -> M3Config:
  """The config with the tokenizer's special ids (vocab_size stays: the tokenizer fits inside it)."""
  ids = special_ids(tok)
  if tok.get_vocab_size() > cfg.text.vocab_size:
    raise TrainSetupError(f"the tokenizer has {tok.get_vocab_size()} tokens, more than the config's vocab_size "
                          f"{cfg.text.vocab_size}")
  text = dataclasses.replace(cfg.text, bos_token_id=ids["bos"], eos_token_ids=(ids["eos"],))
  return dataclasses.replace(cfg, text=text, vision=None, image_token_id=ids["image"], video_token_id=ids["video"],
                             projector_hidden_size=None)


def train(config: M3Config | str | os.PathLike | None, corpus: str | os.PathLike, out: str | os.PathLike,
          tc: TrainConfig = TrainConfig()) -> TrainResult:
  """Trains (or resumes training) an M3-architecture model on a text corpus; see the module docstring.

  Args:
    config: an M3Config or a config.json path (its vision tower, if any, is not trained: text only); None when
      fine-tuning (``tc.init_from``: the base checkpoint's config, tokenizer and weights are used).
    corpus: a UTF-8 text file or a directory of *.txt files; documents separated by blank lines.
    out: the output directory (created; reused only by a rerun of the same settings, which resumes).
    tc: the run's settings.
  """
  if tc.init_from is not None:
    if config is not None:
      raise TrainSetupError("fine-tuning (init_from) takes the base checkpoint's config; pass config=None")
    config = tc.init_from
  cfg = config if isinstance(config, M3Config) else M3Config.from_file(config)
  out = os.fspath(out)
  check_setup(cfg, tc)
  documents = data.read_documents(corpus)
  train_docs, val_docs = data.split_documents(documents, tc.holdout_fraction, tc.seed)
  settings = {"train": tc.resume_key(), "config": cfg.to_dict(), "corpus_documents": len(documents),
              "corpus_chars": sum(len(d) for d in documents)}
  resumed = _prepare_output(out, settings)
  if not resumed:
    with open(os.path.join(out, SETTINGS_FILE), "w") as f:
      json.dump(settings, f, indent=2)
  if tc.init_from is None:
    tok, tok_dir = _tokenizer(out, train_docs, cfg.text.vocab_size, resumed)
    cfg = _text_config(cfg, tok)
  else:
    tok, tok_dir = _base_checkpoint(tc.init_from, out)
    cfg = dataclasses.replace(cfg, vision=None)
    if cfg.text.bos_token_id is None or not cfg.text.eos_token_ids:
      raise TrainSetupError(f"{tc.init_from}: config.json names no bos / eos token id to separate documents with")
  bos, eos = cfg.text.bos_token_id, cfg.text.eos_token_ids[0]
  train_rows = data.pack_documents([e.ids for e in tok.encode_batch(train_docs)], tc.seq_len, bos, eos, "training")
  val_rows = data.pack_documents([e.ids for e in tok.encode_batch(val_docs)], tc.seq_len, bos, eos, "validation")

  plan = None
  if tc.mesh is not None:
    plan = sharding.ShardingPlan(sharding.make_mesh(tc.mesh))
  with_mtp = cfg.text.num_mtp_modules > 0
  layout = make_layout(cfg, jnp.dtype(tc.compute_dtype), with_mtp=with_mtp, plan=plan)
  opt_cfg = OptimizerConfig(learning_rate=tc.learning_rate, warmup_steps=tc.warmup, total_steps=tc.steps,
                            min_lr_ratio=tc.min_lr_ratio, weight_decay=tc.weight_decay, clip_norm=tc.clip_norm)
  tx = make_optimizer(opt_cfg)
  master = init_master(layout, tc.seed) if tc.init_from is None else _base_master(layout, tc.init_from)
  state = init_state(layout, tx, master)
  mngr = state_checkpoints.manager(os.path.join(out, "checkpoints"))
  restored = state_checkpoints.restore_latest(mngr, state) if resumed else None
  start = 0
  if restored is not None:
    start, state = restored
  log = MetricsLog(os.path.join(out, "metrics.jsonl"))
  log.truncate_after(start)

  # Under a plan the step keeps the state's layout; without one, jit's default placement (an out_shardings of
  # the single device would commit the outputs and make the second step compile again).
  shardings = None if plan is None else jax.tree.map(lambda x: x.sharding, state)
  if plan is None:
    # Every array of the state committed to the one device, whichever way it was made (initialised, read from a
    # base checkpoint, restored): each step then compiles to the same program, for a fresh run, a fine-tune and
    # a resumed one alike, where a mix of committed and uncommitted inputs compiled the step again.
    state = jax.device_put(state, jax.devices()[0])
  objective = ObjectiveConfig(mtp_weight=tc.mtp_weight, indexer_weight=tc.indexer_weight,
                              router_bias_rate=tc.router_bias_rate)
  steps = {sparse: make_train_step(layout, opt_cfg, objective, sparse=sparse,
                                   state_shardings=shardings) for sparse in (False, True)}
  evaluate = make_eval_step(layout)

  def put(rows: np.ndarray) -> jax.Array:
    if plan is None:
      return jnp.asarray(rows)
    return jax.device_put(rows, plan.sharding((ACT_BATCH, ACT_SEQ), rows.shape))

  val_batches = [val_rows.rows[i:i + tc.batch] for i in range(0, len(val_rows.rows), tc.batch)][:tc.eval_batches]

  def validation(step: int) -> dict[str, float]:
    sums: dict[str, float] = {}
    weights = 0
    for rows in val_batches:
      m = jax.device_get(evaluate(state["params"], put(rows)))
      for k, v in m.items():
        sums[k] = sums.get(k, 0.0) + float(v) * len(rows)
      weights += len(rows)
    rec = {f"val_{k.removesuffix('_loss')}_loss" if k != "lm_loss" else "val_loss": v / weights
           for k, v in sums.items()}
    rec["val_ppl"] = math.exp(min(rec["val_loss"], 50.0))
    log.write({"step": step, **rec})
    return rec

  tokens_per_step = tc.batch * tc.seq_len
  if tc.progress:
    print(f"[m3jax] {count_params(state['params']):,} parameters; training split {train_rows.tokens:,} tokens "
          f"({len(train_rows.rows):,} rows of {tc.seq_len}, {train_rows.dropped} tail tokens unused), validation "
          f"{val_rows.tokens:,} tokens; {tc.steps} steps x {tokens_per_step:,} tokens = "
          f"{tc.steps * tokens_per_step / train_rows.tokens:.1f} epochs" + (f"; resuming at step {start}" if start else ""))
  bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", disable=not tc.progress, dynamic_ncols=True)
  last_val: dict[str, float] | None = None
  reached = start
  loop_start = time.perf_counter()
  try:
    for step in range(start, tc.steps):
      if tc.time_limit_s is not None and step > start and time.perf_counter() - loop_start >= tc.time_limit_s:
        break
      sparse = step >= tc.indexer_warmup
      rows = put(train_rows.rows[data.batch_indices(len(train_rows.rows), tc.batch, step, tc.seed)])
      t0 = time.perf_counter()
      state, metrics = steps[sparse](state, rows)
      metrics = jax.device_get(metrics)
      seconds = time.perf_counter() - t0
      done = reached = step + 1
      log.write({"step": done, "phase": "sparse" if sparse else "dense", **metrics,
                 "tokens_per_s": tokens_per_step / seconds, "step_seconds": seconds})
      bar.update(1)
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", lm=f"{float(metrics['lm_loss']):.3f}",
                      tok_s=f"{tokens_per_step / seconds:,.0f}", phase="sparse" if sparse else "dense")
      if done % tc.eval_every == 0 or done == tc.steps:
        last_val = validation(done)
        bar.write(f"step {done}: val_loss {last_val['val_loss']:.4f}  val_ppl {last_val['val_ppl']:.2f}")
      if done % tc.checkpoint_every == 0 or done == tc.steps:
        state_checkpoints.save(mngr, done, state)
    if reached < tc.steps:  # stopped by the time limit: keep the state of the step reached
      bar.write(f"time limit of {tc.time_limit_s:g} s reached after step {reached} of {tc.steps}")
      if reached % tc.checkpoint_every:  # else the loop saved it
        state_checkpoints.save(mngr, reached, state)
      if reached % tc.eval_every:  # else the loop evaluated it (last_val)
        last_val = validation(reached)
  finally:
    bar.close()
    mngr.close()
  if last_val is None:  # rerun after the last step: the final evaluation is already logged
    logged = [r for r in log.read() if "val_loss" in r and r["step"] == tc.steps]
    last_val = logged[-1] if logged else validation(tc.steps)
  model_dir = os.path.join(out, "model")
  export_trained(state["params"], cfg, model_dir, dtype=tc.save_dtype, tokenizer_dir=tok_dir,
                 provenance={"corpus": os.path.abspath(os.fspath(corpus)), "steps": reached}, force=True)
  return TrainResult(model_dir=model_dir, steps=reached, val_loss=last_val["val_loss"], val_ppl=last_val["val_ppl"],
                     params=count_params(state["params"]), model_bytes=model_bytes(state["params"], tc.save_dtype),
                     train_tokens=train_rows.tokens, metrics_path=log.path)
