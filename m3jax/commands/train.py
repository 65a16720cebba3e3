"""``m3jax train --config CONFIG.json --data TEXT_OR_DIR --out DIR``: train an M3-architecture model on a text
corpus (a BPE tokenizer trained on it, packed rows, AdamW, the indexer's alignment loss, the MTP loss, router
balancing); DIR/model is a normal m3jax checkpoint. Rerun the same command to resume after an interruption."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
  from m3jax.training.settings import TrainConfig  # pylint: disable=g-import-not-at-top

  d = TrainConfig()
  p = sub.add_parser("train", help="train an M3-architecture model on a text corpus", description=__doc__)
  p.add_argument("--config", default=None,
                 help="config.json of the model to train from scratch (its vision tower is not trained)")
  p.add_argument("--init-from", default=None, metavar="CHECKPOINT",
                 help="fine-tune this m3jax checkpoint instead (its config, tokenizer and weights; no --config)")
  p.add_argument("--data", required=True, help="a UTF-8 text file or a directory of *.txt files; documents are "
                                               "separated by blank lines")
  p.add_argument("--out", required=True, help="output directory (DIR/model is the trained checkpoint)")
  p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
  p.add_argument("--batch", type=int, default=d.batch, help=f"rows per step (default {d.batch})")
  p.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per row (default {d.seq_len})")
  p.add_argument("--mesh", default=None, help="device mesh, e.g. data=8 (data parallel; default: one device)")
  p.add_argument("--lr", type=float, default=d.learning_rate, help=f"peak learning rate (default {d.learning_rate})")
  p.add_argument("--warmup-steps", type=int, default=None, help="linear learning-rate warm-up (default min(100, "
                                                                  "steps/10)); cosine decay after it")
  p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final learning rate / peak")
  p.add_argument("--weight-decay", type=float, default=d.weight_decay)
  p.add_argument("--clip-norm", type=float, default=d.clip_norm, help="global gradient-norm clip")
  p.add_argument("--mtp-weight", type=float, default=d.mtp_weight, help="weight of the MTP loss")
  p.add_argument("--indexer-weight", type=float, default=d.indexer_weight,
                 help="weight of the indexer alignment loss (0: the indexers are not trained)")
  p.add_argument("--indexer-warmup-steps", type=int, default=None,
                 help="steps of the dense warm-up phase (sparse layers attend densely; default steps/5)")
  p.add_argument("--router-bias-rate", type=float, default=d.router_bias_rate,
                 help="correction-bias step of the auxiliary-loss-free router balancing")
  p.add_argument("--eval-every", type=int, default=d.eval_every, help="validation every N steps (and at the end)")
  p.add_argument("--eval-batches", type=int, default=d.eval_batches, help="validation batches per evaluation")
  p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="training-state checkpoints")
  p.add_argument("--holdout", type=float, default=d.holdout_fraction, help="fraction of documents held out")
  p.add_argument("--seed", type=int, default=d.seed, help="initialisation, split and data-order seed")
  p.add_argument("--compute-dtype", default=d.compute_dtype, choices=("bfloat16", "float32"),
                 help="activation / matmul dtype (master weights are always fp32)")
  p.add_argument("--save-dtype", default=d.save_dtype, choices=("bfloat16", "float32"),
                 help="dtype of the exported checkpoint")
  p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                 help="stop after this many seconds of training (at a step boundary), then checkpoint, evaluate and "
                      "export the step reached; rerun the same command to go on")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  from m3jax.training.settings import TrainConfig  # pylint: disable=g-import-not-at-top
  from m3jax.training.trainer import train  # pylint: disable=g-import-not-at-top

  if (args.config is None) == (args.init_from is None):
    raise ValueError("pass exactly one of --config (train from scratch) and --init-from (fine-tune a checkpoint)")
  tc = TrainConfig(init_from=args.init_from, steps=args.steps, batch=args.batch, seq_len=args.seq_len, mesh=args.mesh, learning_rate=args.lr,
                   warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
                   clip_norm=args.clip_norm, mtp_weight=args.mtp_weight, indexer_weight=args.indexer_weight,
                   indexer_warmup_steps=args.indexer_warmup_steps, router_bias_rate=args.router_bias_rate,
                   eval_every=args.eval_every, eval_batches=args.eval_batches,
                   checkpoint_every=args.checkpoint_every, holdout_fraction=args.holdout, seed=args.seed,
                   compute_dtype=args.compute_dtype, save_dtype=args.save_dtype, progress=not args.no_progress,
                   time_limit_s=args.time_limit)
  result = train(args.config, args.data, args.out, tc)
  print(f"[m3jax] trained {result.params:,} parameters for {result.steps} steps: validation loss "
        f"{result.val_loss:.4f}, perplexity {result.val_ppl:.2f}")
  print(f"[m3jax] model: {result.model_dir} ({result.model_bytes / 1e6:.2f} MB); metrics: {result.metrics_path}")
  return 0
