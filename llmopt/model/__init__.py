"""Reading models lazily (HF directories, GGUF files, hub ids), their architectures and tokenizers."""

from llmopt.model.arch import ArchSpec
from llmopt.model.open import open_model
from llmopt.model.source import ModelSource, TensorInfo
from llmopt.model.tokenizer import TokenizerInfo

__all__ = ["ArchSpec", "ModelSource", "TensorInfo", "TokenizerInfo", "open_model"]
