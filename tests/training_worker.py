"""Training checks on simulated CPU devices, run in a subprocess by tests/test_training.py (the device count must
be set before jax is imported). Prints one JSON object on the last stdout line.

  python tests/training_worker.py step MESH ...   one sharded train step (sparse phase) vs the one-device step

Environment: M3JAX_TEST_DEVICES (default 8) local CPU devices.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                           + os.environ.get("M3JAX_TEST_DEVICES", "8"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def small_config():
  """Two layers (full + dense MLP, sparse + MoE) and one MTP module: every mechanism the step trains."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  import m3jax  # pylint: disable=g-import-not-at-top

  base = m3jax.tiny(mtp=True)
  text = dataclasses.replace(base.text, num_layers=2, attention_types=("full", "sparse"), mlp_types=("dense", "moe"))
  return dataclasses.replace(base, text=text)


def _run_step(cfg, mesh_arg, rows):
  from m3jax import sharding  # pylint: disable=g-import-not-at-top
  from m3jax.logical_axes import ACT_BATCH, ACT_SEQ  # pylint: disable=g-import-not-at-top
  from m3jax.training.optimizer import OptimizerConfig, make_optimizer  # pylint: disable=g-import-not-at-top
  from m3jax.training.params import init_master, make_layout  # pylint: disable=g-import-not-at-top
  from m3jax.training.step import ObjectiveConfig, init_state, make_train_step  # pylint: disable=g-import-not-at-top

  plan = None if mesh_arg is None else sharding.ShardingPlan(sharding.make_mesh(mesh_arg))
  layout = make_layout(cfg, jnp.float32, with_mtp=True, plan=plan)
  opt = OptimizerConfig(total_steps=10, warmup_steps=0)
  tx = make_optimizer(opt)
  master = init_master(layout, 0)
  state = init_state(layout, tx, master)
  step = make_train_step(layout, opt, ObjectiveConfig(), sparse=True,
                         state_shardings=jax.tree.map(lambda x: x.sharding, state))
  x = jnp.asarray(rows) if plan is None else jax.device_put(rows, plan.sharding((ACT_BATCH, ACT_SEQ), rows.shape))
  state, metrics = step(state, x)
  devices = {d.id for v in state["params"].values() for d in v.sharding.device_set}
  return jax.device_get(state["params"]), jax.device_get(metrics), len(devices)


def step(*meshes: str) -> dict:
  cfg = small_config()
  rows = np.random.default_rng(0).integers(0, cfg.text.vocab_size, (8, 48)).astype(np.int32)
  ref_params, ref_metrics, _ = _run_step(cfg, None, rows)
  out = {}
  for mesh in meshes:
    params, metrics, n_devices = _run_step(cfg, mesh, rows)
    out[mesh] = {
        "devices": n_devices,
        "loss": [float(metrics["loss"]), float(ref_metrics["loss"])],
        "max_param_rel": max(float(np.max(np.abs(params[k] - v)) / max(np.max(np.abs(v)), 1e-30))
                             for k, v in ref_params.items()),
        "bias_equal": all(np.array_equal(params[k], v) for k, v in ref_params.items() if k.endswith("correction_bias")),
        "load_max_diff": float(np.max(np.abs(metrics["expert_load"] - ref_metrics["expert_load"]))),
    }
  return out


if __name__ == "__main__":
  command, *args = sys.argv[1:]
  result = {"step": step}[command](*args)
  print(json.dumps(result))
