"""Dense linear projections with block-scaled fp8 weights (``QuantizedWeight``): ``x @ W^T``."""
from pallas_kernels.linear.api import heuristic_linear_tiles, quantized_matmul

__all__ = ["heuristic_linear_tiles", "quantized_matmul"]
