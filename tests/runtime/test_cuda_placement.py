"""The quantized-weight modules on CUDA, checked without a GPU: built and run on fake CUDA tensors
(torch's FakeTensorMode computes shapes, dtypes and devices only) or on the meta device, where a lookup
table or a constant left on the CPU fails as it would on a GPU. What they compute there is
benchmarks/runtime_cuda.py's to check."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from torch._subclasses.fake_tensor import FakeTensorMode

from llmopt.model import open_model
from llmopt.quantized_tensor import QuantizedTensor
from llmopt.runtime import weights
from llmopt.runtime.gguf_linear import FieldLinear, QuantizedEmbedding, int4_parts
from llmopt.runtime.group_int import GroupIntLinear
from llmopt.runtime.int4 import PackedInt4Linear, cuda_int4_input, inner_k_tiles, kernel_shape_ok, packable
from llmopt.runtime.linear import quantized_module
from tests.formats.gguf.models import make_wide_hf
from tests.runtime.test_gguf_linear import CODES, LATTICE, _blocks, _write

Q = GGMLQuantizationType
META = torch.device("meta")
CUDA = torch.device("cuda", 0)  # (fake tensors move to an indexed device only)
FIELD_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.F16, Q.IQ4_NL,
               Q.IQ4_XS, *LATTICE, *CODES]


def _on_cuda(module: torch.nn.Module) -> bool:
    return all(t.device.type == "cuda" for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("qtype", FIELD_TYPES, ids=[q.name for q in FIELD_TYPES])
def test_field_linears_compute_everything_on_the_weights_device(qtype):
    """On the meta device (fake CUDA tensors cannot be sliced on a CPU-only torch): arithmetic between a
    CPU constant and the module's tensors fails there as it would on a GPU."""
    layer = quantized_module(qtype, _blocks(qtype, rows=48), torch.randn(48), torch.float32, META)
    assert isinstance(layer, FieldLinear) and all(t.is_meta for t in [*layer.parameters(), *layer.buffers()])
    x = torch.randn(3, 512, device=META)
    y = layer(x)  # several rows: the tiles, rebuilt where the weights are
    assert (y.shape, y.device) == ((3, 48), META)
    one = layer.gemv(x[0], *layer.fields())  # a decode step's product (compiled there; here its ops)
    assert one.device == META and one.shape[0] >= 48
    table = quantized_module(qtype, _blocks(qtype, rows=48), None, device=META, rows=True)
    emb = QuantizedEmbedding(table, torch.bfloat16)
    rows = emb(torch.tensor([[3, 0, 47]], device=META))  # an untied embedding: no numpy, no CPU round trip
    assert (rows.shape, rows.dtype, rows.device) == ((1, 3, 512), torch.bfloat16, META)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_int4_gguf_types_pack_for_the_cuda_kernel_in_bfloat16(qtype):
    mode = FakeTensorMode()
    parts = [mode.from_tensor(t) for t in int4_parts(qtype, _blocks(qtype, rows=48))]
    with mode:
        layer = PackedInt4Linear(*(t.to(CUDA) for t in parts), 32, None)
        assert _on_cuda(layer)
        assert layer.packed.shape == (48 // 8, 512 // (16 * 8), 32, 8 // 2)  # tinygemm's tiles
        for rows in (1, 5):
            y = layer(torch.randn(rows, 512, device=CUDA))
            assert (y.shape, y.dtype, y.device.type) == ((rows, 48), torch.float32, "cuda")


def test_gptq_layers_pack_for_the_device_they_run_on():
    out_f, in_f, gs = 24, 192, 64
    qt = QuantizedTensor(codes=torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8),
                         scales=torch.rand(out_f, in_f // gs), bits=4, group_size=gs,
                         zeros=torch.full((out_f, in_f // gs), 8.0))
    bf16 = torch.bfloat16
    assert packable(qt, CUDA, bf16) and not packable(qt, torch.device("cpu"), bf16)  # CUDA packs 8 rows, the CPU 16
    assert not packable(qt, CUDA, torch.float32)  # a float32 model keeps float32 math: bit planes
    mode = FakeTensorMode()
    bias = mode.from_tensor(torch.randn(out_f))
    qt = QuantizedTensor(**{k: mode.from_tensor(v) if torch.is_tensor(v) else v for k, v in vars(qt).items()})
    with mode:
        layer = PackedInt4Linear.from_quantized(qt, bias, CUDA)  # the codes move to the GPU, then pack
        assert _on_cuda(layer) and layer.packed.shape == (3, 192 // (16 * 4), 32, 2)
        assert layer(torch.randn(1, 2, in_f, device=CUDA)).shape == (1, 2, out_f)


def test_cuda_kernel_shapes():
    assert [inner_k_tiles(k) for k in (4096, 576, 1536, 14336, 96)] == [8, 4, 8, 8, 2]
    assert kernel_shape_ok(8, 96, 32, CUDA) and not kernel_shape_ok(12, 96, 32, CUDA)
    assert not kernel_shape_ok(16, 80, 16, CUDA)  # no group of 16


def test_cuda_keeps_a_gguf_quantized_by_the_gpus_free_memory(monkeypatch, tmp_path):
    path = _write(make_wide_hf(tmp_path / "hf", "llama", layers=1), tmp_path / "m.gguf", "Q4_0", ())
    monkeypatch.setattr(weights, "available_memory", lambda: 1 << 40)  # the CPU's memory is not what counts
    with open_model(str(path)) as source:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 1 << 30))
        assert weights.keep_quantized(source, torch.bfloat16, CUDA)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 41))
        assert not weights.keep_quantized(source, torch.bfloat16, CUDA)


def test_cuda_kernel_input_holds_the_even_input_in_the_high_nibble():
    """As PyTorch's own int4 tests pack tinygemm's input."""
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 7, 8]])
    assert cuda_int4_input(codes).tolist() == [[0x12, 0x34], [0xF0, 0x78]]


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_gptq_bit_planes_compute_on_the_weights_device(bits):
    out_f, in_f, gs = 24, 256, 64
    g = torch.Generator().manual_seed(bits)
    qt = QuantizedTensor(codes=torch.randint(0, 1 << bits, (out_f, in_f), generator=g, dtype=torch.uint8),
                         scales=torch.rand(out_f, in_f // gs, generator=g).half(), bits=bits, group_size=gs,
                         zeros=torch.randint(0, 1 << bits, (out_f, in_f // gs), generator=g).float(),
                         g_idx=torch.randperm(in_f, generator=g) % (in_f // gs))  # act-order: the input permuted too
    layer = GroupIntLinear(qt, torch.randn(out_f)).to(META)
    x = torch.randn(3, in_f, device=META)
    assert layer(x).shape == (3, out_f) and layer(x[:1]).device == META
    assert layer.gemv(x[0], *layer.fields()).device == META
