"""When the file system says no (no room, no such place, a name that is not UTF-8): exit 2, one line
naming the output, and nothing left behind."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

from tests.cli.test_bad_input import assert_clean_failure


def _small_files() -> None:
    """A file-size limit of 64 KiB: writes beyond it fail as on a full disk (EFBIG, SIGXFSZ ignored)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_no_room_to_write(tiny_models, tmp_path):
    for to, out in (("hf", tmp_path / "out"), ("gguf", tmp_path / "out.gguf")):
        proc = subprocess.run([sys.executable, "-m", "llmopt.cli.app", "convert", str(tiny_models("llama")), "--to", to,
                               *(["--type", "F16"] if to == "gguf" else []), "-o", str(out)],
                              capture_output=True, text=True, preexec_fn=_small_files, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
        assert_clean_failure(proc, f"{out}: ")  # "File too large", or numpy's "N requested and M written"
        assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary file


def test_output_name_not_utf8(llmopt_here, tiny_models, tmp_path):
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff\xfe-model")
    assert_clean_failure(llmopt_here("convert", tiny_models("llama"), "--to", "hf", "-o", out), "the output name is not valid UTF-8")
    assert list(tmp_path.iterdir()) == []


def test_output_where_nothing_can_be_created(llmopt_here, tiny_models):
    assert_clean_failure(llmopt_here("convert", tiny_models("llama"), "--to", "gguf", "--type", "Q8_0", "-o", "/proc/model.gguf"),
                         "/proc/model.gguf: cannot write here")
