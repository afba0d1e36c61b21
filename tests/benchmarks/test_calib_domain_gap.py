"""The wikitext markup analysis behind issue 4's self-calibration gap (benchmarks/calib_domain_gap.py)."""

from __future__ import annotations

from benchmarks.calib_domain_gap import detokenize, token_classes


def test_detokenize_undoes_wikitext_artefacts():
    raw = (" = = Early life = = \n"
           " He was a guest @-@ starring actor , born in 1 @,@ 200 ( or 3 @.@ 5 ) ; he did n't stay . \n")
    assert detokenize(raw) == ("## Early life\n"
                               " He was a guest-starring actor, born in 1,200 (or 3.5); he didn't stay. \n")


def test_token_classes_name_the_markup_a_token_overlaps():
    text = " = Robert <unk> = \n a guest @-@ starring role , in 2000 ."
    pieces = [" =", " Robert", " <", "unk", ">", " =", " \n", " a", " guest", " @", "-", "@", " starring",
              " role", " ,", " in", " ", "2", "0", "0", "0", " ."]
    offsets, at = [], 0
    for p in pieces:
        start = text.index(p, at)
        offsets.append((start, start + len(p)))
        at = start + len(p)
    assert token_classes(text, offsets) == [
        "heading line", "heading line", "<unk>", "<unk>", "<unk>", "heading line", "whitespace", "word", "word",
        "@-@ marker", "@-@ marker", "@-@ marker", "word", "word", "punctuation", "word", "whitespace",
        "number", "number", "number", "number", "punctuation"]
