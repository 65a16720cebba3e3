"""Orbax checkpoints of the training state (fp32 master weights, optimizer state, step) for resuming.

One directory per saved step under OUT/checkpoints/ (Orbax CheckpointManager: a step appears only once fully
written, so a run killed mid-save leaves the previous step as the latest). ``restore_latest`` reads the newest
one straight into the layout of a freshly initialised state.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

State = dict[str, Any]


def manager(directory: str | os.PathLike, keep: int = 2) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True)
  return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options)


def save(mngr: ocp.CheckpointManager, step: int, state: State) -> None:
  """Saves ``state`` as step ``step`` (synchronously; returns once it is complete on disk)."""
  mngr.save(step, args=ocp.args.StandardSave(state), force=True)
  mngr.wait_until_finished()


def restore_latest(mngr: ocp.CheckpointManager, like: State) -> tuple[int, State] | None:
  """(step, state) of the newest complete checkpoint, laid out like ``like`` (shapes, dtypes, shardings);
  None when there is none."""
  step = mngr.latest_step()
  if step is None:
    return None
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
  try:
    state = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # pylint: disable=broad-except  (Orbax / TensorStore raise many types)
    raise ValueError(f"{mngr.directory}: cannot restore training step {step} ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}); delete that step's directory to resume from "
                     "an earlier one") from None
  return step, state
