"""Host-side (numpy) layout of a packed vision batch, derived from ``grid_thw`` (M3_SPEC §7.3-7.4).

Pixel rows arrive flattened like HF's processors: one row per patch, all grid rows (images / video chunks)
concatenated, each grid row ``t`` frames of ``h x w`` patches in spatial-merge-block order (block row, block
col, in-block row, in-block col). Attention runs inside *segments*: every grid row is one segment, and a row
with more than ``max_frames`` temporal patches is cut into chunks of at most ``max_frames`` (temporal positions
restart in each chunk). For the tower, segments are packed into a dense ``[S, L]`` slot grid (L = the longest
segment); padding slots are masked out of every key set, so they never reach a real token.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class VisionLayout:
  """Everything the tower needs to know about a batch of grids, as numpy arrays.

  Attributes:
    num_patches: N, the number of pixel rows (sum of t*h*w).
    segments: (start, length) of every attention segment, in row order.
    positions: int32 [N, 3] RoPE coordinates (t, h, w) of every row.
    pack_index: int32 [S, L] row feeding each (segment, slot); N for a padding slot.
    pack_valid: bool [S, L] True for real slots.
    unpack_index: int32 [N] flat slot (s * L + l) holding each row.
    tokens_per_item: merged (LLM) tokens per grid row, t*h*w / merge^2.
  """

  num_patches: int
  segments: tuple[tuple[int, int], ...]
  positions: np.ndarray
  pack_index: np.ndarray
  pack_valid: np.ndarray
  unpack_index: np.ndarray
  tokens_per_item: tuple[int, ...]


def check_grid(grid_thw, merge: int) -> np.ndarray:
  """Validates grid_thw (int [G, 3], each row t >= 1 and h, w positive multiples of ``merge``)."""
  grid = np.asarray(grid_thw)
  if grid.ndim != 2 or grid.shape[1] != 3:
    raise ValueError(f"grid_thw must have shape [num_items, 3], got {grid.shape}")
  if grid.size and not np.issubdtype(grid.dtype, np.integer):
    raise ValueError(f"grid_thw must be integers, got {grid.dtype}")
  grid = grid.astype(np.int64)
  for i, (t, h, w) in enumerate(grid.tolist()):
    if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
      raise ValueError(f"grid_thw row {i} = {[t, h, w]}: t, h, w must be positive and h, w multiples of the "
                       f"spatial merge size {merge}")
  return grid


def split_segments(grid_thw, max_frames: int | None) -> list[tuple[int, int, int]]:
  """Grid rows cut into attention segments of at most ``max_frames`` temporal patches: [(t, h, w), ...]."""
  out = []
  for t, h, w in np.asarray(grid_thw).tolist():
    step = t if not max_frames else max_frames
    out += [(min(step, t - start), h, w) for start in range(0, t, step)]
  return out


def block_order_hw(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
  """(hp, wp) int [h*w] of the patches of one frame in spatial-merge-block order."""
  hp, wp = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
  shape = (h // merge, merge, w // merge, merge)
  return (hp.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
          wp.reshape(shape).transpose(0, 2, 1, 3).reshape(-1))


def vision_layout(grid_thw, *, merge: int, max_frames: int | None, pad_multiple: int = 8) -> VisionLayout:
  """The packed layout of ``grid_thw`` (see module doc). L is rounded up to ``pad_multiple``."""
  grid = check_grid(grid_thw, merge)
  segs = split_segments(grid, max_frames)
  positions, spans, start = [], [], 0
  for t, h, w in segs:
    hp, wp = block_order_hw(h, w, merge)
    tp = np.repeat(np.arange(t), h * w)
    positions.append(np.stack([tp, np.tile(hp, t), np.tile(wp, t)], axis=-1))
    spans.append((start, t * h * w))
    start += t * h * w
  n = start
  longest = max((length for _, length in spans), default=1)
  slots = -(-longest // pad_multiple) * pad_multiple
  pack_index = np.full((max(len(spans), 1), slots), n, np.int32)
  unpack_index = np.zeros((n,), np.int32)
  for s, (begin, length) in enumerate(spans):
    pack_index[s, :length] = np.arange(begin, begin + length)
    unpack_index[begin:begin + length] = s * slots + np.arange(length)
  return VisionLayout(
      num_patches=n,
      segments=tuple(spans),
      positions=(np.concatenate(positions) if positions else np.zeros((0, 3))).astype(np.int32),
      pack_index=pack_index,
      pack_valid=pack_index < n,
      unpack_index=unpack_index,
      tokens_per_item=tuple(int(t * h * w) // merge**2 for t, h, w in grid.tolist()),
  )
