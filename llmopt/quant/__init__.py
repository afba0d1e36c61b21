"""Quantization: grids (the integer grid and every GGUF type), methods (RTN, GPTQ) and the
layer-sequential pipeline that runs them. `QuantizedTensor` itself is in llmopt/quantized_tensor.py."""
