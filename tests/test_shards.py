"""The state as boxes of global tensors (checkpoint/shards.py) and the metadata merge that checks them."""

from __future__ import annotations

import math

import pytest
import torch

from megascale.checkpoint.dcp_io import merge_metadata, write_rank_files
from megascale.checkpoint.shards import Chunk, flat_range_boxes
from megascale.checkpoint.storage import Storage


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (4, 1), (1, 7), (2, 1, 3)])
def test_flat_ranges_become_boxes_that_cover_them_exactly(shape):
    n = math.prod(shape)
    for start in range(n + 1):
        for end in range(start, n + 1):
            seen = torch.zeros(shape)
            boxes = flat_range_boxes(shape, start, end)
            for offsets, sizes in boxes:
                seen[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] += 1
            want = torch.zeros(n)
            want[start:end] = 1
            assert torch.equal(seen.view(-1), want), (shape, start, end, boxes)
            assert len(boxes) <= 2 * len(shape) - 1  # a partial row per level on each side, whole rows


def _parts(tmp_path, boxes_per_rank):
    """Each 'rank' writes its boxes of one 4x6 tensor; their DCP metadata parts."""
    full = torch.arange(24.0).view(4, 6)
    storage = Storage(tmp_path)
    storage.fs.makedirs(str(tmp_path / "step"), exist_ok=True)
    parts = []
    for rank, boxes in enumerate(boxes_per_rank):
        chunks = [Chunk("model/w", (4, 6), (r, c), full[r:r + h, c:c + w].clone(), True)
                  for r, c, h, w in boxes]
        _, part = write_rank_files(storage, str(tmp_path / "step"), rank, chunks)
        parts.append(part)
    return parts


def test_merged_metadata_must_tile_every_tensor(tmp_path):
    merged = merge_metadata(_parts(tmp_path / "a", [[(0, 0, 2, 6)], [(2, 0, 2, 3), (2, 3, 2, 3)]]))
    assert len(merged.state_dict_metadata["model/w"].chunks) == 3
    with pytest.raises(ValueError, match="do not tile"):  # a box lost: rows 2-3, columns 3-5
        merge_metadata(_parts(tmp_path / "b", [[(0, 0, 2, 6)], [(2, 0, 2, 3)]]))
    with pytest.raises(ValueError, match="do not tile"):  # two ranks writing the same rows
        merge_metadata(_parts(tmp_path / "c", [[(0, 0, 3, 6)], [(2, 0, 2, 6)]]))
