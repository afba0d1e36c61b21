"""The fixed value tables of llama.cpp's non-uniform GGUF types, as data.

Origin: ggml/src/ggml-common.h of llama.cpp commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f (the
copy vendored by llama-cpp-python 0.3.36, under vendor/llama.cpp), tables `kvalues_iq4nl` and
`kvalues_fp4` (alias `kvalues_mxfp4`). Read for the values only; the code that uses them is ours.
"""

from __future__ import annotations

# IQ4_NL / IQ4_XS: the 16 int8 levels a 4-bit index stands for (w = d * IQ4_VALUES[index]), sorted.
IQ4_VALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# MXFP4 / NVFP4: the E2M1 values doubled (index bit 3 is the sign), w = (scale / 2) * FP4_VALUES[index].
FP4_VALUES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
