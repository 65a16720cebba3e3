"""Command-line options for parallel runs (``--mesh``, sequence parallelism, jax.distributed), shared by the
``m3jax`` subcommands that load a model."""

from __future__ import annotations

import argparse
import os
import sys


def add_mesh_arguments(p: argparse.ArgumentParser, *, distributed: bool = True) -> None:
  g = p.add_argument_group("parallelism (see docs/sharding.md)")
  g.add_argument("--mesh", default=None,
                 help="device mesh over data/expert/tensor, e.g. data=1,expert=4,tensor=2 (default: unsharded)")
  g.add_argument("--sequence-parallel", action="store_true",
                 help="token-shard prefill over expert x tensor (m3jax.sharding.RULES_SP)")
  if distributed:
    g.add_argument("--coordinator", default=None,
                   help="multi-host: host:port of process 0 (jax.distributed.initialize); same command on every host")
    g.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    g.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
  w = p.add_argument_group("weights")
  w.add_argument("--keep-quantized", action="store_true",
                 help="keep the weights the checkpoint stores in MXFP8 / FP8-block in fp8 (default: dequantize them; "
                      "a checkpoint converted with --keep-quantized / --quantize restores them in fp8 either way)")


def init_distributed(args: argparse.Namespace) -> None:
  """jax.distributed.initialize from the flags (before any computation); other processes than 0 stay quiet."""
  if getattr(args, "coordinator", None) is None and getattr(args, "num_processes", None) is None:
    return
  import jax  # pylint: disable=g-import-not-at-top

  jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                             process_id=args.process_id)
  if jax.process_index() != 0:
    sys.stdout = open(os.devnull, "w")  # pylint: disable=consider-using-with
    sys.stderr = open(os.devnull, "w")  # pylint: disable=consider-using-with


def load_kwargs(args: argparse.Namespace) -> dict:
  """``m3jax.load`` keyword arguments for the mesh and weights flags."""
  weights = {"keep_quantized": True} if getattr(args, "keep_quantized", False) else {}
  if args.mesh is None:
    if args.sequence_parallel:
      raise ValueError("--sequence-parallel needs --mesh")
    return weights
  from m3jax import sharding  # pylint: disable=g-import-not-at-top

  rules = sharding.RULES_SP if args.sequence_parallel else sharding.RULES
  return {"mesh": sharding.make_mesh(args.mesh), "axis_rules": rules, **weights}
