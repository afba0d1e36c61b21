"""Writers: GPTQ checkpoints and dense HF directories, GGUF files, importance-matrix files."""
