"""Block-FP8 (DeepSeek-format) linear layers: the weight format (``format``), torch quantisation (``quant``), the
Triton kernels (``triton_kernels``) and the dispatching op with its references (``linear``)."""

from .format import BlockFP8Layout, block_fp8_layout, block_fp8_tensors, explain_block_fp8, holds_quantized_weight
from .linear import block_fp8_linear, block_fp8_linear_act_quant_ref, block_fp8_linear_ref
from .quant import dequantize_block_fp8, quantize_block_fp8

__all__ = ["BlockFP8Layout", "block_fp8_layout", "block_fp8_linear", "block_fp8_linear_act_quant_ref",
           "block_fp8_linear_ref", "block_fp8_tensors", "dequantize_block_fp8", "explain_block_fp8",
           "holds_quantized_weight", "quantize_block_fp8"]
