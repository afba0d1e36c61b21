"""GGUF output: llama.cpp names and metadata, block packing of llmopt's grids, and llama.cpp's mixes."""
