"""Writers: dense HF safetensors directories now; GGUF, GPTQ and AWQ checkpoints build on them."""
