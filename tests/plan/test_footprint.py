"""The footprint model: what it counts for a known shape, the refusal's one line, the memory budget."""

from __future__ import annotations

import pytest

from llmopt import memory
from llmopt.errors import OptionError
from llmopt.plan.footprint import F32, HESSIAN_COPIES, BlockShape, gb, Workload, block_seconds, block_tensor_shapes, check_fits, footprint
from llmopt.plan.presets import PRESETS


def test_llama_8b_gptq_counts_the_down_projections_hessians_and_the_calibration() -> None:
    arch = PRESETS["llama-3.1-8b"].arch
    shape = BlockShape.of(arch)
    assert [s.width for s in shape.stages] == [4096, 4096, 4096, 14336]
    assert shape.linear_params == 4096 * (4096 + 1024 + 1024 + 4096 + 2 * 14336) + 14336 * 4096
    fp = footprint(shape, Workload("quantize", "gptq", 128, 512, act_bytes=2))
    parts = dict(fp.parts)
    assert parts["Hessians"] == HESSIAN_COPIES * 14336**2 * F32
    assert parts["calibration"] == 128 * 512 * 4096 * F32
    assert parts["block"] == shape.params * (F32 + 2)  # float32, and the bfloat16 copy the forward runs
    assert fp.peak_step == "one block" and fp.peak == fp.block_bytes
    more = footprint(shape, Workload("quantize", "gptq", 256, 512, act_bytes=2))
    assert more.block_bytes > fp.block_bytes  # the calibration and the paused forward grow with the tokens
    gptaq = footprint(shape, Workload("quantize", "gptq", 128, 512, act_bytes=2, gptaq=True))
    assert dict(gptaq.parts)["calibration"] > 2 * parts["calibration"]  # the full-precision stream and stage inputs


def test_rtn_needs_no_calibration_and_70b_needs_more_than_8b() -> None:
    rtn = footprint(PRESETS["llama-3.1-8b"].arch, Workload("quantize", "rtn"))
    assert "calibration" not in dict(rtn.parts) and "tokens" not in rtn.summary()
    for command in ("imatrix", "sensitivity", "eval"):
        small = footprint(PRESETS["llama-3.1-8b"].arch, Workload(command))
        big = footprint(PRESETS["llama-3.1-70b"].arch, Workload(command))
        assert big.peak > small.peak > 0


def test_fused_linears_are_their_parts() -> None:
    arch = PRESETS["phi-3-mini"].arch
    shapes = block_tensor_shapes(arch, 0)
    assert shapes["self_attn.q_proj.weight"] == (3072, 3072) and "self_attn.qkv_proj.weight" not in shapes
    assert BlockShape.of(arch).stages[2].rows == 2 * arch.intermediate_size


def test_refusal_is_one_line_naming_the_need_the_room_and_the_levers() -> None:
    fp = footprint(PRESETS["llama-3.1-8b"].arch, Workload("quantize", "gptq", 128, 512, act_bytes=2))
    check_fits(fp, fp.peak, "available", "lower <nsamples>/<seqlen>")  # exactly enough: no error
    with pytest.raises(OptionError) as e:
        check_fits(fp, 6 * 10**9, "cgroup limit", "lower <nsamples>/<seqlen>")
    msg = str(e.value)
    hessians = gb(HESSIAN_COPIES * 14336**2 * F32)  # the down projection's, the widest input
    assert "\n" not in msg and msg.startswith(f"one block of this model needs {gb(fp.peak)} (")
    assert f"Hessians {hessians}" in msg and gb(fp.peak) != gb(6 * 10**9)
    assert "for 128 x 512 tokens); 6.0 GB is available (cgroup limit): lower `nsamples`/`seqlen`" in msg


def test_time_grows_with_tokens_and_width() -> None:
    from llmopt.plan.footprint import Efficiency

    eff = Efficiency(0.5, 1e-4)
    small, big = BlockShape.of(PRESETS["llama-3.1-8b"].arch), BlockShape.of(PRESETS["llama-3.1-70b"].arch)
    work = Workload("quantize", "gptq", 128, 512)
    t8 = block_seconds(small, work, 1e12, eff)
    assert block_seconds(big, work, 1e12, eff) > 2 * t8
    assert block_seconds(small, Workload("quantize", "gptq", 256, 512), 1e12, eff) > t8


def test_cgroup_room_v2_and_v1(tmp_path) -> None:
    v2 = tmp_path / "v2" / "job"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("8000000000\n")
    (v2 / "memory.current").write_text("3000000000\n")
    (v2 / "memory.stat").write_text("anon 1\ninactive_file 1000000000\n")
    cg = tmp_path / "cgroup"
    cg.write_text("0::/job\n")
    assert memory.cgroup_memory_room(str(cg), str(tmp_path / "v2")) == 6_000_000_000
    (v2 / "memory.max").write_text("max\n")
    assert memory.cgroup_memory_room(str(cg), str(tmp_path / "v2")) is None
    v1 = tmp_path / "v1" / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("4000000000\n")
    (v1 / "memory.usage_in_bytes").write_text("1000000000\n")
    cg.write_text("4:memory:/job\n0::/\n")
    assert memory.cgroup_memory_room(str(cg), str(tmp_path / "v1")) == 3_000_000_000


def test_budget_is_the_lower_of_the_system_and_the_cgroup(monkeypatch) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda: 10 * 10**9)
    monkeypatch.setattr(memory, "cgroup_memory_room", lambda: 6 * 10**9)
    assert memory.memory_budget() == (6 * 10**9, "cgroup limit")
    monkeypatch.setattr(memory, "cgroup_memory_room", lambda: None)
    assert memory.memory_budget() == (10 * 10**9, "available")


def test_learned_rounding_keeps_inputs_and_targets_and_costs_its_steps() -> None:
    from llmopt.plan.footprint import EFFICIENCY, TUNE_COPIES, tune_flops

    shape = BlockShape.of(PRESETS["llama-3.1-8b"].arch)
    plain = Workload("quantize", "gptq", 128, 512, batch=8)
    tuned = Workload("quantize", "gptq", 128, 512, batch=8, tune_iters=200)
    calib = dict(footprint(shape, tuned).parts)["calibration"] - dict(footprint(shape, plain).parts)["calibration"]
    assert calib == 3 * 128 * 512 * 4096 * F32  # the block's inputs, the float model's stream and the block's targets
    few = Workload("quantize", "gptq", 8, 256, batch=8, tune_iters=200)  # the offsets outweigh GPTQ's paused forward
    assert dict(footprint(shape, few).parts)["weights"] == TUNE_COPIES * shape.linear_params * F32
    # an RTN start still runs the calibration forward when tuned
    assert footprint(shape, Workload("quantize", "rtn", 128, 512, tune_iters=10)).block_bytes > \
        footprint(shape, Workload("quantize", "rtn", 128, 512)).block_bytes
    peak = 1e12
    extra = block_seconds(shape, tuned, peak) - block_seconds(shape, plain, peak)
    assert extra == pytest.approx(tune_flops(shape, tuned) / (EFFICIENCY["tune"].fraction * peak))
    assert tune_flops(shape, Workload("quantize", "gptq", 128, 512, batch=8, tune_iters=400)) > tune_flops(shape, tuned)
    assert block_seconds(shape, Workload("quantize", "rtn", 128, 512, tune_iters=10), peak) > 0
