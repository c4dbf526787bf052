"""MX (OCP Microscaling) quantization and quantization-aware training.

    mx.py   pure tensor functions: quantize_mx / dequantize_mx / fake_quant_mx,
            pack_fp4 / unpack_fp4 (MXFP4 E2M1, MXFP8 E4M3 / E5M2)
    qat.py  QATConfig, apply_qat / remove_qat, quantized_expert_weights,
            qat_fake_quant (fake quantization with a straight-through gradient)
"""

from k3post.quant.mx import (
    E2M1_VALUES,
    MX_FORMATS,
    MXFormat,
    dequantize_mx,
    fake_quant_mx,
    pack_fp4,
    quantize_mx,
    unpack_fp4,
)
from k3post.quant.qat import QATConfig, apply_qat, qat_fake_quant, quantized_expert_weights, remove_qat

__all__ = [
    "E2M1_VALUES",
    "MX_FORMATS",
    "MXFormat",
    "QATConfig",
    "apply_qat",
    "dequantize_mx",
    "fake_quant_mx",
    "pack_fp4",
    "qat_fake_quant",
    "quantize_mx",
    "quantized_expert_weights",
    "remove_qat",
    "unpack_fp4",
]
