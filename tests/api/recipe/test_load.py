"""Bad recipes: one line naming file:line:column and what was expected, exit 2, nothing written."""

from __future__ import annotations

import re

import pytest

from tests.cli.test_bad_input import assert_clean_failure

GOOD = """\
model: MODEL
calibration: {data: calib.txt, nsamples: 2, seqlen: 32}
eval: {data: calib.txt, windows: 2, ctx: 32}
outputs:
  q8: {format: gguf, type: Q8_0, gates: {min_top1: 0.5}}
  rtn: {format: gptq, method: rtn, bits: 4, group_size: 32}
"""

# (what changes in GOOD, the text the error must hold, where it must point: the first place in the
# new text where this string starts)
BAD = [
    ("type: Q8_0", "type: Q9_9", "unknown GGUF type 'Q9_9'", "Q9_9"),
    ("bits: 4", 'bits: "four"', "`outputs.rtn.bits`: Input should be a valid integer", '"four"'),
    ("bits: 4", "bits: 9", "less than or equal to 8", "9,"),
    ("group_size: 32", "group_sise: 32", "unknown key `group_sise`", "group_sise"),
    ("seqlen: 32", "seqlen: 32, colour: red", "unknown key `colour`", "colour"),
    ("min_top1: 0.5", "min_top1: 50", "`outputs.q8.gates.min_top1`: Input should be less than or equal to 1", "50"),
    ("min_top1: 0.5", "max_kld: -0.1", "`outputs.q8.gates.max_kld`: Input should be greater than or equal to 0", "-0.1"),
    ("min_top1: 0.5", "max_ppl_increase: lots%", "expected a percentage like '5%'", "lots%"),
    ("model: MODEL", "model: ./missing-model", "`model` ./missing-model: no such file", "./missing-model"),
    ("model: MODEL", "modell: MODEL", "unknown key `modell`", "modell"),
    ("  rtn:", "  q8:", "duplicate key `q8` (first at line 5)", "q8: {format: gptq"),
    ("format: gguf", "format: ggml", "`format` 'ggml': expected one of gguf, gptq, awq, compressed-tensors, dense, hf", "ggml"),
    ("q8: {format", "q8: [format", "not valid YAML", None),
    ("calib.txt, nsamples", "nowhere.txt, nsamples", "`calibration.data` nowhere.txt: no such file", "nowhere.txt"),
    ("eval: {data: calib.txt", "eval: {data: none.txt", "`eval.data` none.txt: no such file", "none.txt"),
    ("method: rtn, bits: 4", "method: rtn, act_order: true, bits: 4", "`act_order`", "true"),
    ("group_size: 32", "group_size: 32, format: gptq", "duplicate key `format`", "format: gptq}"),
    ("format: gguf, type: Q8_0", "format: gguf, type: Q8_0, tensor_type: [attn_v]", "expected REGEX=TYPE", "[attn_v]"),
    ("nsamples: 2", "nsamples: 0", "`calibration.nsamples`: Input should be greater than or equal to 1", "0,"),
    ("outputs:\n", "outputs:\n  bad/name: {format: hf}\n", "output name 'bad/name'", "bad/name") ,
    ("  rtn: {format: gptq", "  rtn: {path: ../escape, format: gptq", "`path` ../escape: a plain file or folder name", "../escape"),
    ("eval: {data: calib.txt, windows: 2, ctx: 32}\n", "", "gates score the output on the recipe's `eval` text", "{min_top1"),
    ("model: MODEL", "model: [1, 2]", "`model`: Input should be a valid string", "[1, 2]"),
    ("method: rtn", "method: gptq, group_size: 0", "duplicate key `group_size`", "group_size: 32"),
    ("method: rtn, bits: 4, group_size: 32", "method: gptq, bits: 4, group_size: 0", "`group_size` 0 (per tensor) is for rtn", None),
    ("type: Q8_0", "type: Q8_0, target_size: 10XB", "bad `target_size` '10XB'", None),
    ("type: Q8_0", "type: Q8_0, target_size: 1MB, target_bpw: 4", "are two ways to say one thing", None),
    ("rtn: {format: gptq", "rtn: {format: awq, target_bpw: 3", "it needs `format` gptq or compressed-tensors, not awq", "3, method"),
]


@pytest.fixture
def recipe_dir(tmp_path, tiny_models):
    (tmp_path / "calib.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return tmp_path, tiny_models("llama")


@pytest.mark.parametrize("old,new,expect,where", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_recipe(llmopt_here, recipe_dir, old, new, expect, where):
    folder, model = recipe_dir
    assert old in GOOD, old
    text = GOOD.replace(old, new, 1).replace("MODEL", str(model))
    recipe = folder / "release.yaml"
    recipe.write_text(text)
    before = sorted(p.name for p in folder.iterdir())
    result = llmopt_here("run", recipe)
    assert_clean_failure(result, expect)
    m = re.search(r"release\.yaml:(\d+):(\d+): ", result.stderr)
    assert m, result.stderr
    if where is not None:
        at = text.index(where)
        line = text.count("\n", 0, at) + 1
        column = at - (text.rfind("\n", 0, at) + 1) + 1
        assert (int(m.group(1)), int(m.group(2))) == (line, column), result.stderr
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written, not even the output folder


def test_good_recipe_plans(llmopt_here, recipe_dir):
    folder, model = recipe_dir
    (folder / "release.yaml").write_text(GOOD.replace("MODEL", str(model)))
    result = llmopt_here("run", folder / "release.yaml", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    assert '"name": "q8"' in result.stdout and '"state": "to build"' in result.stdout
    assert not (folder / "out").exists()


def test_unknown_only(llmopt_here, recipe_dir):
    folder, model = recipe_dir
    (folder / "release.yaml").write_text(GOOD.replace("MODEL", str(model)))
    assert_clean_failure(llmopt_here("run", folder / "release.yaml", "--only", "q5"), "--only q5: no such output")


def test_unreadable_recipe(llmopt_here, tmp_path):
    assert_clean_failure(llmopt_here("run", tmp_path / "none.yaml"), "cannot read the recipe")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert_clean_failure(llmopt_here("run", tmp_path / "list.yaml"), "list.yaml:1:1: a recipe is a mapping")
    (tmp_path / "none.yaml").write_text("model: m\noutputs: {}\n")
    assert_clean_failure(llmopt_here("run", tmp_path / "none.yaml"), "none.yaml:2:10: `outputs`: a recipe needs at least one output")
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    assert_clean_failure(llmopt_here("run", tmp_path / "empty.yaml"), "empty.yaml:1:1: the recipe is empty")
