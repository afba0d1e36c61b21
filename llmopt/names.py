"""The names of the choices the command line offers: methods, checkpoint formats, float types,
devices. Plain strings, importable without torch, so that `llmopt --help` and the commands that do
not compute (`recommend`) start fast; the modules that implement them take their lists from here."""

METHODS: tuple[str, ...] = ("rtn", "gptq", "awq", "awq+gptq")
CHECKPOINT_FORMATS: tuple[str, ...] = ("gptq", "awq", "compressed-tensors", "dense")
SCHEMES: tuple[str, ...] = ("fp8-dynamic", "fp8", "nvfp4a16", "nvfp4", "mxfp4a16")  # `quantize --scheme`: a serving scheme instead of an integer grid
CALIBRATED_SCHEMES: tuple[str, ...] = ("fp8", "nvfp4")  # their activation scales are static, from calibration
SYM_SCALES: tuple[str, ...] = ("gptq", "tight")  # the symmetric integer grid's scale (quant/grids/integer.py)
FLOAT_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")
CALIB_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
