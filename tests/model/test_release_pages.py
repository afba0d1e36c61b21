"""Layer-at-a-time readers let go of the mapped source pages they read (Linux RSS accounting)."""

import sys

import pytest
import torch
from safetensors.torch import save_file

from llmopt.memory import release_mapped_files

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def resident_kib(path: str) -> int:
    """Resident KiB of this process's mappings of `path`, from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) >= 6 and head[5] == path
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


def test_release_drops_pages_read_through_safetensors(tmp_path):
    from safetensors import safe_open

    file = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(1024, 1024)}, str(file))
    with safe_open(str(file), framework="pt") as f:
        w = f.get_tensor("w").clone()  # read through the map: its pages stay resident
        before = resident_kib(str(file.resolve()))
        release_mapped_files(tmp_path)
        after = resident_kib(str(file.resolve()))
        again = f.get_tensor("w").clone()  # pages come back from the file on the next read
    assert before >= 3000 and after < before // 10
    assert torch.equal(w, again)


def test_load_block_leaves_no_source_pages_resident(tmp_path):
    from llmopt.model import open_model
    from llmopt.model.decoder import load_block
    from tests.factories import make_tiny_hf

    directory = make_tiny_hf(tmp_path / "m", layers=2)
    file = str((directory / "model.safetensors").resolve())
    with open_model(str(directory)) as source:
        for name in source.tensors:  # read everything once: the whole file is resident now
            source.load(name)
        assert resident_kib(file) > 0
        block = load_block(source, 1)
        assert resident_kib(file) == 0
        first = source.load("model.layers.1.self_attn.q_proj.weight")
    assert torch.equal(block.self_attn.q_proj.weight, first)
