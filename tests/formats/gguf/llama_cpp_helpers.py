"""Helpers that run llama.cpp (through llama-cpp-python) on GGUF files, as the outside reference."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np

from llmopt.formats.gguf.mixes import file_type

if TYPE_CHECKING:
    import torch


def llama_quantize(src: Path, dst: Path, mix: str, **kwargs) -> Path:
    """Requantize `src` to `mix` with llama.cpp's own `llama_model_quantize`."""
    return _quantize(src, dst, mix, **kwargs)


def _quantize(src: Path, dst: Path, mix: str, *, nthread: int = 1, imatrix: dict[str, np.ndarray] | None = None,
              overrides: list[tuple[str, str]] = (), output_tensor_type: str | None = None,
              dry_run: bool = False) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = file_type(mix)
    params.nthread = nthread
    params.allow_requantize = True
    params.dry_run = dry_run
    if output_tensor_type is not None:
        params.output_tensor_type = int(gguf.GGMLQuantizationType[output_tensor_type])
    keep = []  # ctypes buffers that must outlive the call
    if imatrix is not None:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(imatrix.items()):
            arr = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(arr)
            entries[i].name = name.encode()
            entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = arr.size
        entries[len(imatrix)].name = None
        keep.append(entries)
        params.imatrix = entries
    if overrides:
        tt = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pattern, type_name) in enumerate(overrides):
            tt[i].pattern = pattern.encode()
            tt[i].type = int(gguf.GGMLQuantizationType[type_name])
        tt[len(overrides)].pattern = None
        keep.append(tt)
        params.tt_overrides = tt
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize failed with {rc}"
    return dst


def gguf_types(path: Path) -> dict[str, str]:
    """Tensor name -> GGML type name of a GGUF file, read with the gguf package."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name for t in reader.tensors}


def _writer_with_hparams(path: Path, arch: str, hidden: int, ffn: int, layers: int, heads: int,
                         kv_heads: int) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_file_type(1)
    return w


def dense_shapes(*, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int, tie: bool = False,
                 qkv_bias: bool = False) -> dict[str, tuple[int, ...]]:
    """GGUF name -> HF-orientation shape of a dense Llama-shaped decoder, in convert_hf_to_gguf's order."""
    kv = hidden // heads * kv_heads
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (hidden,), b + "attn_q.weight": (hidden, hidden),
                       b + "attn_k.weight": (kv, hidden), b + "attn_v.weight": (kv, hidden),
                       b + "attn_output.weight": (hidden, hidden), b + "ffn_norm.weight": (hidden,),
                       b + "ffn_gate.weight": (ffn, hidden), b + "ffn_up.weight": (ffn, hidden),
                       b + "ffn_down.weight": (hidden, ffn)})
        if qkv_bias:
            shapes.update({b + "attn_q.bias": (hidden,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
    shapes["output_norm.weight"] = (hidden,)
    if not tie:
        shapes["output.weight"] = (vocab, hidden)
    return shapes


def write_random_f16_gguf(path: Path, *, arch: str = "llama", hidden: int = 256, ffn: int = 512, layers: int = 16,
                          heads: int = 8, kv_heads: int = 2, vocab: int = 384, tie: bool = False,
                          qkv_bias: bool = False, seed: int = 0) -> dict[str, tuple[int, ...]]:
    """A random model as an F16 GGUF laid out as convert_hf_to_gguf.py does; returns name -> HF shape."""
    rng = np.random.default_rng(seed)
    w = _writer_with_hparams(path, arch, hidden, ffn, layers, heads, kv_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    shapes = dense_shapes(hidden=hidden, ffn=ffn, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab,
                          tie=tie, qkv_bias=qkv_bias)
    for name, shape in shapes.items():
        value = rng.standard_normal(shape).astype(np.float32) * 0.05
        w.add_tensor(name, value if len(shape) == 1 else value.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return shapes


def write_sparse_f16_gguf(path: Path, shapes: dict[str, tuple[int, ...]], *, arch: str = "llama", hidden: int,
                          ffn: int, layers: int, heads: int, kv_heads: int, experts: tuple[int, int] | None = None) -> Path:
    """An F16 GGUF with the given tensor shapes (HF orientation) and no data (a sparse file); `experts`
    (count, used per token) for a mixture-of-experts model, whose router stays F32 as the converter writes it.

    Enough for llama.cpp's `--dry-run`, which plans types without reading tensor data.
    """
    w = _writer_with_hparams(path, arch, hidden, ffn, layers, heads, kv_heads)
    if experts is not None:
        w.add_expert_count(experts[0])
        w.add_expert_used_count(experts[1])
    total = 0
    for name, shape in shapes.items():
        dtype = np.float32 if len(shape) == 1 or "ffn_gate_inp" in name else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
        total += gguf.GGUFWriter.ggml_pad(nbytes, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    fout.truncate(fout.tell() + total)
    w.close()
    return path


def llama_dry_run_types(src: Path, mix: str, **kwargs) -> dict[str, str]:
    """Tensor name -> type that llama.cpp's quantizer plans for `src` under `mix` (its --dry-run log)."""
    import re

    import llama_cpp

    chunks: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(level, text, user_data):  # noqa: ANN001
        chunks.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        _quantize(src, src.with_suffix(".dry"), mix, dry_run=True, **kwargs)
    finally:
        llama_cpp.llama_log_set(ctypes.cast(0, llama_cpp.llama_log_callback), ctypes.c_void_p(0))
    log = "".join(chunks)
    types: dict[str, str] = {}
    line = re.compile(r"\]\s+(\S+)\s+- \[[^\]]*\], type =\s+(\w+), size =[^\n]*?(?:\((\w+)\))?\n")
    for m in line.finditer(log):
        types[m.group(1)] = (m.group(3) or m.group(2)).upper()
    assert types, log[-2000:]
    return types


def llama_cpp_model(path: Path, n_ctx: int = 128):  # noqa: ANN201 - a llama_cpp.Llama
    """llama.cpp (llama-cpp-python) on `path`, keeping every position's logits."""
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2)


def llama_cpp_logits(path: Path, tokens: list[int], n_ctx: int = 128) -> torch.Tensor:
    """llama.cpp's logits [len(tokens), vocab] for `tokens` run as one prompt."""
    import torch

    llm = llama_cpp_model(path, n_ctx)
    llm.eval(tokens)
    return torch.tensor(np.asarray(llm.scores[: len(tokens)]))


def assert_same_top1(ours: torch.Tensor, theirs: torch.Tensor, label: str, atol: float = 1e-2,
                     min_clear: float = 0.5) -> float:  # fmt: skip
    """The logits within `atol` of llama.cpp's, its most likely token ours at every position clear of a
    near-tie (our top two further apart than 4x the measured difference: no kernel's rounding flips
    those), and at least `min_clear` of the positions clear, so the check means something; prints and
    returns the largest difference. (At a near-tie either engine may pick either token, on either CPU.)"""
    diff = (theirs - ours).abs().max().item()
    print(f"{label}: max |llama.cpp - llmopt| logit = {diff:.3g}")
    top2 = ours.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 4 * diff
    assert diff < atol and int(clear.sum()) >= ours.shape[0] * min_clear, (diff, int(clear.sum()))
    assert (theirs.argmax(-1) == ours.argmax(-1))[clear].all()
    return diff


def assert_same_tensors(first: Path, second: Path, ordered: bool = True) -> None:
    """Two GGUF files hold the same tensors bit for bit: names (in the same order, with `ordered`),
    types and data."""
    a, b = gguf.GGUFReader(str(first)), gguf.GGUFReader(str(second))
    names_a, names_b = [t.name for t in a.tensors], [t.name for t in b.tensors]
    assert names_a == names_b if ordered else set(names_a) == set(names_b)
    theirs = {t.name: t for t in b.tensors}
    for t in a.tensors:
        other = theirs[t.name]
        assert t.tensor_type == other.tensor_type and np.array_equal(np.asarray(t.data), np.asarray(other.data)), t.name


def assert_type_map_equals_llama_quantize(hf_dir: Path, tmp_path: Path, mix: str) -> None:
    """The types in our `mix` file of `hf_dir` equal those llama.cpp's quantizer plans for our F16 file."""
    from llmopt.api import convert_to_gguf

    f16, ours = tmp_path / "f16.gguf", tmp_path / f"{mix}.gguf"
    convert_to_gguf(hf_dir, f16, "F16")
    convert_to_gguf(hf_dir, ours, mix)
    assert gguf_types(ours) == llama_dry_run_types(f16, mix)


def llama_cpp_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's `n` greedy tokens after `prompt` on `path`, one decode step at a time."""
    llm = llama_cpp_model(path, n_ctx=len(prompt) + n + 8)
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.asarray(llm.scores[llm.n_tokens - 1]).argmax()))
        llm.eval([out[-1]])
    return out


TIE = 1e-2  # two logits closer than this are a tie that another kernel's rounding may break either way


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The index of the first token where two greedy runs of one length differ (None: equal)."""
    assert len(ours) == len(theirs)
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def assert_near_tie(first: int, length: int, gap: float) -> None:
    """A greedy split allowed between two engines: at least half the tokens agree before it, and the
    two tokens' logits are within TIE there, so the check keeps its teeth."""
    assert first >= length // 2 and gap < TIE, (first, gap)


def assert_same_greedy(path: Path, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    """Our greedy continuation on `path` equals llama.cpp's, except that one may break a near-tie the
    other way: the first differing token must be one our decoder, fed llama.cpp's tokens, ranks within
    TIE of its top (`assert_near_tie`)."""
    import torch

    from llmopt.model import open_model
    from llmopt.model.decoder import Decoder

    first = first_difference(ours, theirs)
    if first is None:
        return
    with open_model(path) as src, torch.no_grad():
        logits = Decoder.from_source(src)(torch.tensor([prompt + theirs[:first]]))[0, -1]
    gap = (logits.max() - logits[theirs[first]]).item()
    print(f"greedy diverges at token {first}/{len(ours)}: ours {ours[first]}, llama.cpp {theirs[first]}, "
          f"our logit gap {gap:.3g}")
    assert_near_tie(first, len(ours), gap)
