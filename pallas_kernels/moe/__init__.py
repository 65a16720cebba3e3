"""M3 MoE block: sigmoid router with selection-only bias, routed experts (SwiGLU-OAI), shared expert."""
from pallas_kernels.moe.api import ExpertOperands, moe_block, prepare_expert_weights, routed_experts
from pallas_kernels.moe.config import MoeBlockSizes, heuristic_block_sizes
from pallas_kernels.moe.fp8 import heuristic_fp8_tiles
from pallas_kernels.moe.kernel_sm90_fp8 import Fp8Tiles
from pallas_kernels.moe.reference import moe_block_reference, route_reference, routed_experts_reference, swiglu_oai

__all__ = [
    "ExpertOperands",
    "Fp8Tiles",
    "MoeBlockSizes",
    "heuristic_block_sizes",
    "heuristic_fp8_tiles",
    "moe_block",
    "moe_block_reference",
    "prepare_expert_weights",
    "route_reference",
    "routed_experts",
    "routed_experts_reference",
    "swiglu_oai",
]
