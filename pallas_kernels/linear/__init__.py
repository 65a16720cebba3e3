"""Dense projections of block-scaled fp8 weights (``pallas_kernels.quant.QuantizedWeight``).

``reference.quantized_matmul_reference(x [T, in], w [out, in]) -> [T, out]`` is the specification; the Mosaic GPU
kernel ``quantized_matmul`` (same signature) lands with the fp8 kernels (#47).
"""
from pallas_kernels.linear.reference import quantized_matmul_reference

__all__ = ["quantized_matmul_reference"]
