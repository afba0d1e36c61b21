"""Quantization: the `QuantizedTensor` in the middle, grids, RTN, GPTQ, AWQ and the layer pipeline."""

from llmopt.quant.tensor import QuantizedTensor

__all__ = ["QuantizedTensor"]
