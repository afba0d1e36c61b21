"""llmopt: quantize, convert and validate large language models."""

__version__ = "0.1.0"
