"""Picks, fits and the nearest options when nothing fits."""

from dataclasses import replace

from llmopt.plan.gpus import GIB, get_gpu
from llmopt.plan.models import from_params, from_preset, parse_params
from llmopt.plan.presets import get_preset
from llmopt.plan.quality import GOOD, class_index, quality
from llmopt.plan.recommend import (Budget, Workload, pick, plan_rows, recommend_for_model, recommend_over_presets,
                                   tp_allowed)

LLAMA3_70B = from_preset(get_preset("llama-3-70b"))


def test_llama3_70b_in_48_gib_at_8k_fits_q4_k_m_with_headroom():
    budget = Budget(48 * GIB, get_gpu("l40s"))
    result = recommend_for_model(LLAMA3_70B, Workload(context=8192), budget)
    assert result["models"][0]["kv_cache_bytes"] == 2 * 80 * 8 * 128 * 8192 * 2
    rows = {r.format: r for r in result["candidates"]}
    for use_case, rec in result["recommendations"].items():
        row = rows[rec["format"]]
        assert row.weights_bytes < budget.memory_bytes and row.fits == "yes", use_case
        assert row.headroom_bytes >= 0.05 * budget.memory_bytes
        assert row.total_bytes == row.weights_bytes + row.kv_bytes + row.overhead.total
    assert result["recommendations"]["quality"]["format"] == "Q4_K_M"  # Q5_K_S (45.3 GiB of weights) does not fit
    assert rows["Q5_K_S"].fits == "no" and result["nearest"] == []


def test_each_use_case_follows_its_rule():
    rows = plan_rows(from_preset(get_preset("llama-3-8b")), Workload(), Budget(24 * GIB, get_gpu("rtx-4090")))
    fitting = [r for r in rows if r.fits == "yes"]
    assert pick(rows, "quality").format in ("F16", "BF16")
    balanced = pick(rows, "balanced")
    assert balanced.format == "Q5_K_M" and balanced.quality.rank >= quality("Q5_K_M").rank
    speed = pick(rows, "speed")
    good = [r for r in fitting if class_index(r.quality.label) <= GOOD]
    assert speed.decode_tps == max(r.decode_tps for r in good)


def test_nothing_fits_offers_shorter_context_smaller_model_and_more_devices():
    workload, budget = Workload(context=32768, batch=2), Budget(40 * GIB, get_gpu("a100-40g"))
    result = recommend_for_model(LLAMA3_70B, workload, budget)
    assert result["recommendations"] == {}
    kinds = {o["kind"]: o for o in result["nearest"]}
    assert set(kinds) == {"shorter context", "smaller model", "more devices"}
    shorter = kinds["shorter context"]
    assert shorter["context"] < 32768
    # each suggestion really fits when applied
    rows = plan_rows(LLAMA3_70B, replace(workload, context=shorter["context"]), budget)
    assert next(r for r in rows if r.format == shorter["format"]).fits == "yes"
    more = kinds["more devices"]
    rows = plan_rows(LLAMA3_70B, replace(workload, tp=more["devices"]), budget)
    assert next(r for r in rows if r.format == more["format"]).fits == "yes"
    assert get_preset(kinds["smaller model"]["model"]).arch != LLAMA3_70B.arch


def test_tensor_parallel_splits_weights_and_kv_heads():
    one = plan_rows(LLAMA3_70B, Workload(context=8192), Budget(80 * GIB))
    four = plan_rows(LLAMA3_70B, Workload(context=8192, tp=4), Budget(80 * GIB))
    a, b = (next(r for r in rows if r.format == "F16") for rows in (one, four))
    assert b.total_bytes - b.overhead.total == (a.weights_bytes + 3) // 4 + a.kv_bytes // 4
    assert tp_allowed(LLAMA3_70B, 8) and not tp_allowed(LLAMA3_70B, 3)


def test_over_presets_picks_the_largest_model_each_use_case_allows():
    result = recommend_over_presets(Workload(context=8192), Budget(48 * GIB, get_gpu("rtx-4090")))
    recs = result["recommendations"]
    assert set(recs) == {"quality", "balanced", "speed"}
    rows = {(r.model, r.format): r for r in result["candidates"]}
    for rec in recs.values():
        assert rows[rec["model"], rec["format"]].fits == "yes"
    sizes = {m["name"]: m["parameters"] for m in result["models"]}
    assert recs["quality"]["model"] in ("llama-3-70b", "llama-3.1-70b", "llama-2-70b", "qwen2.5-72b")
    assert sizes[recs["balanced"]["model"]] <= sizes[recs["quality"]["model"]]
    speed = rows[recs["speed"]["model"], recs["speed"]["format"]]
    assert speed.decode_tps >= 30  # the interactive target the speed pick aims for


def test_params_plans_a_scaled_architecture():
    model = from_params(parse_params("13B"))
    assert abs(model.parameters - 13e9) / 13e9 < 0.02
    model = from_params(parse_params("20B"))
    assert abs(model.parameters - 20e9) / 20e9 < 0.02


def test_automatic_mix_fills_the_budget_between_the_smallest_file_and_f16():
    """With a model, recommend names the GGUF size that fills the memory with the headroom kept:
    the weights plus KV cache and overheads land on the budget's comfortable edge."""
    from llmopt.api.recommend import recommend
    from llmopt.plan.recommend import HEADROOM_FRACTION

    out = recommend(mem="40", model="llama-3-70b", context=8192)
    auto = out["automatic"]
    assert auto is not None and auto["smallest_file_bytes"] < auto["target_size_bytes"]
    q4 = next(r for r in out["rows"] if r.format == "Q4_K_M")
    f16 = next(r for r in out["rows"] if r.format == "F16")
    weights = auto["target_size_bytes"] - (q4.file_bytes - q4.weights_bytes)  # the same header as any mix
    assert weights < f16.weights_bytes
    used = weights + q4.kv_bytes + q4.overhead.total
    assert (1 - HEADROOM_FRACTION) * 40 * GIB - 1 <= used <= (1 - HEADROOM_FRACTION) * 40 * GIB + 1
    assert "--target-size" in auto["command"] and "meta-llama/" in auto["command"]
    assert recommend(mem="400", model="llama-3-70b")["automatic"] is None  # F16 fits: nothing to choose
    assert recommend(mem="8", model="llama-3-70b")["automatic"] is None  # not even the smallest types fit


def test_the_python_api_takes_the_memory_budget_as_a_number_or_text():
    import pytest

    from llmopt.api.recommend import parse_mem
    from llmopt.errors import OptionError

    assert parse_mem(48) == parse_mem("48") == parse_mem("48GB") == 48 * GIB
    assert parse_mem(0.5) == GIB // 2
    for bad in (0, -1, True, float("nan"), "lots", [48]):
        with pytest.raises(OptionError, match="mem"):
            parse_mem(bad)
