"""M3 MoE block: sigmoid router with selection-only bias, routed experts (SwiGLU-OAI), shared expert."""
from pallas_kernels.moe.reference import moe_block_reference, route_reference, swiglu_oai

__all__ = ["moe_block_reference", "route_reference", "swiglu_oai"]
