"""Dense linear projections with block-scaled fp8 weights (``pallas_kernels.quant.QuantizedWeight``): ``x @ W^T``.

``reference.quantized_matmul_reference(x [T, in], w [out, in]) -> [T, out]`` is the specification; ``quantized_matmul``
(same signature plus ``interpret`` / tiles) is the Mosaic GPU W8A16 kernel. ``quantized_gated_mlp`` (a dense
SwiGLU-OAI MLP, gate_up [2F, H] and down [H, F]) runs on the same kernels; its reference is
``reference.quantized_gated_mlp_reference``.
"""
from pallas_kernels.linear.api import heuristic_linear_tiles, quantized_matmul
from pallas_kernels.linear.mlp import quantized_gated_mlp
from pallas_kernels.linear.reference import quantized_gated_mlp_reference, quantized_matmul_reference

__all__ = ["heuristic_linear_tiles", "quantized_gated_mlp", "quantized_gated_mlp_reference", "quantized_matmul",
           "quantized_matmul_reference"]
