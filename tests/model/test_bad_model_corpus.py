"""The bad-input corpus: hundreds of malformed models built here from tiny ones, each read whole by
`llmopt convert --to hf` (architecture, every tensor, the tokenizer). Every case must give exit 2,
one `error:` line, no output and no temporary file, within 10 seconds and without raising the
process's peak memory by 1 GiB. A case that exits 3 is a
bug of ours (docs/cli.md: the exit-code contract)."""

from __future__ import annotations

import json
import math
import resource
import shutil
import signal
import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

T = gguf.GGUFValueType
ARCH = "llama"

# ------------------------------------------------------------------------------------ GGUF cases
INT_KEYS = ["embedding_length", "block_count", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
            "context_length", "vocab_size"]  # fmt: skip
BAD_INTS = [("abc", T.STRING), (-1, T.INT32), (0, T.UINT32), (2**40, T.UINT64), (1.5, T.FLOAT32), ([1, 2], T.ARRAY),
            (True, T.BOOL), (3_000_000_000, T.UINT32)]  # fmt: skip
FLOAT_KEYS = ["rope.freq_base", "attention.layer_norm_rms_epsilon"]
BAD_FLOATS = [("x", T.STRING), (-1.0, T.FLOAT32), (math.nan, T.FLOAT32), (math.inf, T.FLOAT32), ([1.0], T.ARRAY),
              (7.0, T.FLOAT32)]  # fmt: skip


def gguf_cases() -> list[tuple[str, Callable[[Path, Path], None]]]:
    cases = []
    for key in INT_KEYS:
        for value, vtype in BAD_INTS:
            cases.append((f"gguf {key}={value!r:.12}", lambda src, dst, k=f"{ARCH}.{key}", v=value, t=vtype: rewrite(src, dst, {k: (v, t)})))
    for key in FLOAT_KEYS:
        for value, vtype in BAD_FLOATS:
            if key == "rope.freq_base" and value == 7.0:
                continue  # a legal base
            cases.append((f"gguf {key}={value!r:.12}", lambda src, dst, k=f"{ARCH}.{key}", v=value, t=vtype: rewrite(src, dst, {k: (v, t)})))
    for key in ["embedding_length", "block_count", "attention.head_count", "feed_forward_length", "attention.layer_norm_rms_epsilon"]:
        cases.append((f"gguf without {key}", lambda src, dst, k=f"{ARCH}.{key}": rewrite(src, dst, {k: None})))
    more = {
        "head_count_kv 3 does not divide 4": {f"{ARCH}.attention.head_count_kv": (3, T.UINT32)},
        "rope.dimension_count 7": {f"{ARCH}.rope.dimension_count": (7, T.UINT32)},
        "architecture gpt9": {"general.architecture": ("gpt9", T.STRING)},
        "architecture as a number": {"general.architecture": (5, T.UINT32)},
        "alignment 0": {"general.alignment": (0, T.UINT32)},
        "alignment 7": {"general.alignment": (7, T.UINT32)},
        "alignment 48": {"general.alignment": (48, T.UINT32)},
        "alignment as a string": {"general.alignment": ("32", T.STRING)},
        "tokens as u32": {"tokenizer.ggml.tokens": ([1, 2, 3], T.ARRAY)},
        "merges without a space": {"tokenizer.ggml.merges": (["ab", "cd"], T.ARRAY)},
        "tokenizer model unknown": {"tokenizer.ggml.model": ("nonsense", T.STRING)},
        "bos id beyond the vocabulary": {"tokenizer.ggml.bos_token_id": (10**6, T.UINT32)},
        "token types as strings": {"tokenizer.ggml.token_type": (["a"] * 320, T.ARRAY)},
        "token list shorter than the vocabulary": {"tokenizer.ggml.tokens": (["a", "b"], T.ARRAY)},
    }
    for name, change in more.items():
        cases.append((f"gguf {name}", lambda src, dst, c=change: rewrite(src, dst, c)))
    tensor_edits = {
        "tensor type Q8_1": ("blk.0.attn_q.weight", "type", 9),
        "tensor type 99": ("blk.0.attn_q.weight", "type", 99),
        "tensor dim 0": ("blk.0.attn_q.weight", "dim0", 0),
        "tensor dim 2**62": ("blk.0.attn_q.weight", "dim0", 2**62),
        "tensor with 5 dims": ("blk.0.attn_q.weight", "n_dims", 5),
        "tensor offset misaligned": ("blk.1.ffn_up.weight", "offset", 4),
        "tensor offset past the end": ("blk.1.ffn_up.weight", "offset", 1 << 40),
        "tensor dims swapped (transposed)": ("blk.0.ffn_down.weight", "swap", 0),
        "tensor renamed to an unknown name": ("blk.0.attn_q.weight", "name", b"blk.0.attn_x.weight"),
        "tensor renamed to a duplicate": ("blk.0.attn_k.weight", "name", b"blk.0.attn_v.weight"),
        "tensor of a layer that is not there": ("blk.1.attn_q.weight", "name", b"blk.7.attn_q.weight"),
    }
    for name, (tensor, field, value) in tensor_edits.items():
        cases.append((f"gguf {name}", lambda src, dst, t=tensor, f=field, v=value: patch_tensor_info(src, dst, t, f, v)))
    for fraction in (0.001, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.999):
        cases.append((f"gguf truncated to {fraction:.1%}", lambda src, dst, f=fraction: truncate(src, dst, f)))
    cases.append(("gguf empty file", lambda src, dst: dst.write_bytes(b"")))
    cases.append(("gguf magic only", lambda src, dst: dst.write_bytes(b"GGUF")))
    cases.append(("gguf version 9", lambda src, dst: dst.write_bytes(src.read_bytes()[:4] + struct.pack("<I", 9) + src.read_bytes()[8:])))
    cases.append(("gguf kv count 2**60", lambda src, dst: dst.write_bytes(src.read_bytes()[:16] + struct.pack("<Q", 2**60) + src.read_bytes()[24:])))
    cases.append(("gguf tensor count 2**60", lambda src, dst: dst.write_bytes(src.read_bytes()[:8] + struct.pack("<Q", 2**60) + src.read_bytes()[16:])))
    return cases


def rewrite(src: Path, dst: Path, changes: dict[str, tuple | None]) -> None:
    """A copy of a GGUF with metadata values replaced (value, type), added, or removed (None)."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), arch=None)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in changes:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == T.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, change in changes.items():
        if change is None:
            continue
        value, vtype = change
        if vtype == T.ARRAY:
            sub = T.STRING if isinstance(value[0], str) else T.FLOAT32 if isinstance(value[0], float) else T.UINT32
            w.add_key_value(key, value, vtype, sub_type=sub)
        else:
            w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed([int(d) for d in t.shape])), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def patch_tensor_info(src: Path, dst: Path, tensor: str, field: str, value) -> None:  # noqa: ANN001
    """A copy of a GGUF with one tensor info's bytes changed (its name, dims, type or offset)."""
    data = bytearray(src.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name)
    pos = at + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    dims_at, type_at = pos + 4, pos + 4 + 8 * n_dims
    offset_at = type_at + 4
    if field == "type":
        struct.pack_into("<I", data, type_at, value)
    elif field == "dim0":
        struct.pack_into("<Q", data, dims_at, value)
    elif field == "n_dims":
        struct.pack_into("<I", data, pos, value)
    elif field == "offset":
        struct.pack_into("<Q", data, offset_at, struct.unpack_from("<Q", data, offset_at)[0] + value)
    elif field == "swap":
        a, b = struct.unpack_from("<QQ", data, dims_at)
        struct.pack_into("<QQ", data, dims_at, b, a)
    elif field == "name":
        assert len(value) == len(name)
        data[at + 8: at + 8 + len(name)] = value
    dst.write_bytes(bytes(data))


def truncate(src: Path, dst: Path, fraction: float) -> None:
    data = src.read_bytes()
    dst.write_bytes(data[: max(1, int(len(data) * fraction))])


# -------------------------------------------------------------------------------- HF folder cases
HF_INT_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "vocab_size", "max_position_embeddings", "head_dim"]  # fmt: skip
HF_BAD_INTS: list = ["abc", -1, 0, 2**40, 1.5, [1], True, None, 3]
HF_FLOAT_KEYS = ["rope_theta", "rms_norm_eps"]
HF_BAD_FLOATS: list = ["x", -1.0, [1.0], True, "Infinity", "NaN", 0.0]


def _legal(key: str, value) -> bool:  # noqa: ANN001
    """Values that are legal for a key (falsy counts fall back to a default; 3 fits some keys)."""
    if key in ("num_key_value_heads", "head_dim") and value in (0, None):
        return True
    if key == "max_position_embeddings" and value in (3,):
        return True
    if key == "rope_theta" and value == 0.0:
        return False
    return key == "rms_norm_eps" and value == 0.0


def hf_cases() -> list[tuple[str, Callable[[Path, Path], None]]]:
    cases = []
    for key in HF_INT_KEYS:
        for value in HF_BAD_INTS:
            if _legal(key, value) or (value is None and key == "max_position_embeddings"):
                continue
            cases.append((f"config {key}={value!r:.10}", lambda src, dst, k=key, v=value: edit_config(src, dst, {k: v})))
    for key in HF_FLOAT_KEYS:
        for value in HF_BAD_FLOATS:
            if _legal(key, value):
                continue
            raw = value in ("Infinity", "NaN")
            cases.append((f"config {key}={value!r:.10}", lambda src, dst, k=key, v=value, r=raw: edit_config(src, dst, {k: v}, raw=r)))
    for key in ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]:
        cases.append((f"config without {key}", lambda src, dst, k=key: edit_config(src, dst, {k: ...})))
    whole = {"config is a list": "[]", "config is null": "null", "config is a number": "5", "config is a string": '"x"',
             "config is empty": "{}", "config truncated": '{"hidden_size": 6', "config not UTF-8": b"\xff\xfe{}"}  # fmt: skip
    for name, text in whole.items():
        cases.append((name, lambda src, dst, t=text: replace_file(src, dst, "config.json", t)))
    for name, change in {"architectures 5": {"architectures": 5}, "architectures Foo": {"architectures": ["FooForCausalLM"]},
                         "architectures [5]": {"architectures": [5]}, "rope_parameters a string": {"rope_parameters": "x"},
                         "rope_scaling 3": {"rope_scaling": 3}, "heads 3 for kv 2": {"num_attention_heads": 3},
                         "layers 4e9": {"num_hidden_layers": 4_000_000_000}, "layers 1 (tensors hold 2)": {"num_hidden_layers": 1},
                         "layers 3 (tensors hold 2)": {"num_hidden_layers": 3}, "vocab 300 (tensors hold 320)": {"vocab_size": 300},
                         "intermediate 96 (tensors hold 128)": {"intermediate_size": 96},
                         "quantization_config a list": {"quantization_config": [1]},
                         "model_type a number, no architectures": {"architectures": None, "model_type": 5}}.items():  # fmt: skip
        cases.append((f"config {name}", lambda src, dst, c=change: edit_config(src, dst, c)))
    tensor_edits = {
        "without model.norm.weight": ("model.norm.weight", None),
        "without a q_proj": ("model.layers.1.self_attn.q_proj.weight", None),
        "with a transposed down_proj": ("model.layers.0.mlp.down_proj.weight", "T"),
        "with a reshaped embedding": ("model.embed_tokens.weight", "reshape"),
        "with an int8 q_proj": ("model.layers.0.self_attn.q_proj.weight", "int8"),
        "with a 1-D o_proj": ("model.layers.0.self_attn.o_proj.weight", "flat"),
        "with a layer 5 tensor": ("model.layers.5.input_layernorm.weight", "add"),
    }
    for name, (tensor, how) in tensor_edits.items():
        cases.append((f"weights {name}", lambda src, dst, t=tensor, h=how: edit_weights(src, dst, t, h)))
    cases += [
        ("index names a file outside the folder", lambda src, dst: with_index(src, dst, "../../other/model.safetensors")),
        ("index names an absolute path", lambda src, dst: with_index(src, dst, "/etc/hostname")),
        ("index names a missing shard", lambda src, dst: with_index(src, dst, "model-2-of-2.safetensors")),
        ("index weight_map is a list", lambda src, dst: replace_index(src, dst, '{"weight_map": []}')),
        ("index is not JSON", lambda src, dst: replace_index(src, dst, "{")),
        ("index names a number", lambda src, dst: replace_index(src, dst, '{"weight_map": {"a": 5}}')),
        ("safetensors truncated", lambda src, dst: corrupt_weights(src, dst, lambda b: b[: len(b) // 2])),
        ("safetensors header garbage", lambda src, dst: corrupt_weights(src, dst, lambda b: b[:8] + b"\xff" * 64 + b[72:])),
        ("safetensors header length huge", lambda src, dst: corrupt_weights(src, dst, lambda b: struct.pack("<Q", 2**60) + b[8:])),
        ("tokenizer.json not JSON", lambda src, dst: replace_file(src, dst, "tokenizer.json", "{")),
        ("tokenizer.json model a number", lambda src, dst: replace_file(src, dst, "tokenizer.json", '{"model": 5}')),
        ("tokenizer.json a list", lambda src, dst: replace_file(src, dst, "tokenizer.json", "[]")),
        ("tokenizer_config.json not JSON", lambda src, dst: replace_file(src, dst, "tokenizer_config.json", "{")),
        ("tokenizer_config bos_token an int", lambda src, dst: edit_json(src, dst, "tokenizer_config.json", {"bos_token": 5})),
        ("tokenizer_config chat_template a list", lambda src, dst: edit_json(src, dst, "tokenizer_config.json", {"chat_template": [1]})),
    ]
    return cases


def edit_config(src: Path, dst: Path, changes: dict, raw: bool = False) -> None:
    edit_json(src, dst, "config.json", changes, raw)


def edit_json(src: Path, dst: Path, file: str, changes: dict, raw: bool = False) -> None:
    shutil.copytree(src, dst)
    data = json.loads((dst / file).read_text())
    for k, v in changes.items():
        if v is ...:
            data.pop(k, None)
        else:
            data[k] = v
    text = json.dumps(data)
    if raw:  # JSON's non-standard constants, as Python's json module writes them
        text = text.replace('"Infinity"', "Infinity").replace('"NaN"', "NaN")
    (dst / file).write_text(text)


def replace_file(src: Path, dst: Path, file: str, text: str | bytes) -> None:
    shutil.copytree(src, dst)
    (dst / file).write_bytes(text if isinstance(text, bytes) else text.encode())


def edit_weights(src: Path, dst: Path, tensor: str, how: str | None) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if how is None:
        tensors.pop(tensor)
    elif how == "T":
        tensors[tensor] = np.ascontiguousarray(tensors[tensor].T)
    elif how == "reshape":
        tensors[tensor] = tensors[tensor].reshape(-1, 32)
    elif how == "int8":
        tensors[tensor] = tensors[tensor].astype(np.int8)
    elif how == "flat":
        tensors[tensor] = tensors[tensor].reshape(-1)
    elif how == "add":
        tensors[tensor] = np.ones(64, dtype=np.float32)
    save_file(tensors, str(dst / "model.safetensors"))


def with_index(src: Path, dst: Path, shard: str) -> None:
    shutil.copytree(src, dst)
    names = list(load_file(str(dst / "model.safetensors")))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[names[-1]] = shard
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def replace_index(src: Path, dst: Path, text: str) -> None:
    replace_file(src, dst, "model.safetensors.index.json", text)


def corrupt_weights(src: Path, dst: Path, change: Callable[[bytes], bytes]) -> None:
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    path.write_bytes(change(path.read_bytes()))


# ------------------------------------------------------------------------------ checkpoint cases
def gptq_cases() -> list[tuple[str, Callable[[Path, Path], None]]]:
    def qc(changes: dict) -> Callable[[Path, Path], None]:
        def make(src: Path, dst: Path) -> None:
            shutil.copytree(src, dst)
            cfg = json.loads((dst / "config.json").read_text())
            cfg["quantization_config"].update(changes)
            (dst / "config.json").write_text(json.dumps(cfg))
        return make

    def tensor(name: str, how: str) -> Callable[[Path, Path], None]:
        def make(src: Path, dst: Path) -> None:
            shutil.copytree(src, dst)
            file = next(dst.glob("*.safetensors"))
            tensors = load_file(str(file))
            key = next(k for k in tensors if k.endswith(name))
            if how == "drop":
                tensors.pop(key)
            elif how == "flat":
                tensors[key] = tensors[key].reshape(-1)
            elif how == "negative":
                tensors[key] = -np.ones_like(tensors[key])
            elif how == "huge":
                tensors[key] = np.full_like(tensors[key], 10**6)
            save_file(tensors, str(file))
        return make

    return [("gptq bits 'four'", qc({"bits": "four"})), ("gptq bits 3 (the data is 4-bit)", qc({"bits": 3})),
            ("gptq bits 8 (the data is 4-bit)", qc({"bits": 8})), ("gptq bits 5", qc({"bits": 5})),
            ("gptq group_size a list", qc({"group_size": [1]})), ("gptq dynamic a number", qc({"dynamic": 5})),
            ("gptq without a qzeros", tensor("q_proj.qzeros", "drop")), ("gptq without a scales", tensor("v_proj.scales", "drop")),
            ("gptq 1-D qweight", tensor("k_proj.qweight", "flat")), ("gptq negative g_idx", tensor("o_proj.g_idx", "negative")),
            ("gptq g_idx past the groups", tensor("o_proj.g_idx", "huge")), ("gptq 1-D scales", tensor("up_proj.scales", "flat"))]  # fmt: skip


CASES = [("gguf", *c) for c in gguf_cases()] + [("hf", *c) for c in hf_cases()] + [("gptq", *c) for c in gptq_cases()]


def test_the_corpus_is_large():
    assert len(CASES) >= 250, len(CASES)


@pytest.fixture(scope="module")
def sources(tiny_models, tiny_ggufs, tmp_path_factory):
    from llmopt.api import quantize

    gptq = tmp_path_factory.mktemp("gptq") / "model"
    quantize(tiny_models("llama"), gptq, method="rtn", bits=4, group_size=32)
    return {"gguf": tiny_ggufs("llama", "F32"), "hf": tiny_models("llama"), "gptq": gptq}


class _Hang(Exception):
    pass


@pytest.mark.parametrize("kind,name,make", CASES, ids=[c[1] for c in CASES])
def test_bad_model(llmopt_here, sources, tmp_path, kind, name, make):
    bad = tmp_path / ("bad.gguf" if kind == "gguf" else "bad")
    make(sources[kind], bad)
    out = tmp_path / "out"

    def hang(signum, frame):  # noqa: ANN001
        raise _Hang(name)

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        result = llmopt_here("convert", bad, "--to", "hf", "-o", out)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) * 1024  # a new high of the process: this case's
    assert grew < 1 << 30, f"{name}: peak memory rose by {grew / 2**20:.0f} MiB"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert not out.exists() and not any(p.name.startswith(".out.") for p in tmp_path.iterdir())
