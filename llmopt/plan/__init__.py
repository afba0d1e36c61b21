"""Planning before writing: the memory and speed model behind `llmopt recommend`, and the automatic
mixes behind `--target-size`/`--target-bpw` (a type or bit width per tensor, chosen from the
Fisher-predicted cost of each, `gguf_automix.py` and `gptq_automix.py`)."""
