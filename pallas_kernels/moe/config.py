"""Tile sizes for the MoE grouped GEMMs (Hopper, Mosaic GPU) and a shape heuristic."""

from __future__ import annotations

import dataclasses


def _is_pow2(v: int) -> bool:
  return v > 0 and (v & (v - 1)) == 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MoeBlockSizes:
  """Tiles of one grouped GEMM.

  block_m: rows per tile (tokens of one expert); 64 or 128 (one wgmma M=64 per 64 rows).
  block_n: output columns per work item. For gate_up these are intermediate columns: the item
    loads block_n gate + block_n up weight columns.
  wg_split: how the two consumer warpgroups share the [block_m, block_n] tile: "m" (block_m // 2
    rows each; needs block_m=128) or "n" (block_n // 2 columns each).
  block_k: reduction step per pipeline stage (64 bf16 = one 128-byte swizzle row).
  max_concurrent_steps: TMA pipeline depth.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  wg_split: str = "m"

  def __post_init__(self):
    if self.block_m not in (64, 128):
      raise ValueError(f"block_m must be 64 or 128, got {self.block_m}")
    if not _is_pow2(self.block_n) or not 64 <= self.block_n <= 512:
      # The weight tile [block_k, block_n] is stored with a 128-byte swizzle: whole 64-column bf16 tiles.
      raise ValueError(f"block_n must be a power of two in [64, 512], got {self.block_n}")
    if self.block_k not in (32, 64):
      raise ValueError(f"block_k must be 32 or 64, got {self.block_k}")
    if self.wg_split not in ("m", "n"):
      raise ValueError(f"wg_split must be 'm' or 'n', got {self.wg_split!r}")
    if self.wg_split == "m" and self.block_m != 128:
      raise ValueError(f"wg_split='m' needs block_m=128, got {self.block_m}")
    if self.wg_split == "n" and self.block_n < 128:
      # Each warpgroup's half of the weight tile must be whole 64-column swizzle tiles for wgmma (the GPU
      # lowering rejects a 32-column slice; interpret mode would not notice).
      raise ValueError(f"wg_split='n' needs block_n >= 128, got {self.block_n}")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")

  def wg_tile(self) -> tuple[int, int]:
    """(rows, cols) of the output tile owned by one consumer warpgroup."""
    if self.wg_split == "m":
      return self.block_m // 2, self.block_n
    return self.block_m, self.block_n // 2

  def smem_bytes(self, n_parts: int, itemsize: int = 2, out_itemsize: int = 2) -> int:
    """Shared memory of one CTA: pipeline stages plus the epilogue staging tile."""
    stage = (self.block_m * self.block_k + n_parts * self.block_k * self.block_n) * itemsize
    wg_m, wg_n = self.wg_tile()
    epilogue = 2 * wg_m * min(wg_n, 64) * out_itemsize  # 2 consumer WGs
    return stage * self.max_concurrent_steps + epilogue


SMEM_LIMIT_BYTES = 227 * 1024


def _fit_width(block_n: int, widths: tuple[int, ...]) -> int:
  """block_n halved (down to 64) until it divides every output width (e.g. a tensor-parallel expert slice of
  192 columns); unchanged when it already divides them or when no power of two >= 64 does."""
  bn = block_n
  while bn > 64 and any(w % bn for w in widths):
    bn //= 2
  if any(w % bn for w in widths):
    return block_n  # the kernel wrapper names the width that does not tile
  return bn


def heuristic_block_sizes(num_tokens: int, top_k: int, num_experts: int, *,
                          gate_up_widths: tuple[int, ...] = (), down_widths: tuple[int, ...] = (),
                          ) -> tuple[MoeBlockSizes, MoeBlockSizes]:
  """(gate_up, down) tile sizes for a token count.

  Decode-sized batches (<= 64 rows per expert in the worst case) use block_m=64 so each touched
  expert is one m-tile and its weights stream through exactly once; prefill uses 128-row tiles.
  gate_up_widths (expert widths I, and Is when the shared expert runs on the same tiles) and down_widths
  (the hidden size) narrow block_n to a power of two that divides them.
  """
  gate_up, down = _heuristic_tiles(num_tokens, top_k, num_experts)
  gate_up_bn, down_bn = _fit_width(gate_up.block_n, gate_up_widths), _fit_width(down.block_n, down_widths)
  if min(gate_up_bn, down_bn) < 128:
    # A 64-column tile cannot be split between the two warpgroups by columns: split 128 rows instead
    # (both GEMMs, which share block_m). Decode pads its rows to 128; the kernel stays weight-read bound.
    gate_up = dataclasses.replace(gate_up, block_m=128, wg_split="m")
    down = dataclasses.replace(down, block_m=128, wg_split="m")
  return dataclasses.replace(gate_up, block_n=gate_up_bn), dataclasses.replace(down, block_n=down_bn)


def _heuristic_tiles(num_tokens: int, top_k: int, num_experts: int) -> tuple[MoeBlockSizes, MoeBlockSizes]:
  del num_experts
  if num_tokens <= 64:
    gate_up = MoeBlockSizes(block_m=64, block_n=128, max_concurrent_steps=5, wg_split="n")
    down = MoeBlockSizes(block_m=64, block_n=256, max_concurrent_steps=5, wg_split="n")
  else:  # each consumer WG: 64 rows x (128 gate + 128 up) / 64 rows x 256 cols
    gate_up = MoeBlockSizes(block_m=128, block_n=128, max_concurrent_steps=4, wg_split="m")
    down = MoeBlockSizes(block_m=128, block_n=256, max_concurrent_steps=4, wg_split="m")
  del top_k
  return gate_up, down
