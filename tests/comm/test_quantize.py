"""int8 blockwise quantization with error feedback (``hpcnet.comm.quantize``): pure functions."""

import math

import pytest
import torch

from hpcnet.comm.quantize import (
    BLOCK,
    LEVELS,
    ErrorFeedback,
    compress_with_feedback,
    dequantize,
    pack,
    packed_bytes,
    padded_length,
    quantize,
    unpack,
)


def test_each_value_is_within_half_a_step_of_its_block():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4 * BLOCK, generator=gen) * torch.tensor([1e-6, 1.0, 1e3, 3.0]).repeat_interleave(BLOCK)
    q, scales = quantize(x)
    assert q.dtype == torch.int8 and scales.shape == (4,)
    assert int(q.abs().max()) == LEVELS  # each block's largest value is at the end of the range
    step = scales.repeat_interleave(BLOCK)
    assert torch.all((dequantize(q, scales) - x).abs() <= step / 2 * (1 + 1e-6))


def test_a_block_of_zeros_stays_zero_and_an_overflowed_block_reads_as_nan():
    x = torch.zeros(3 * BLOCK)
    x[BLOCK + 5] = math.inf
    x[2 * BLOCK:] = 1.5
    values = dequantize(*quantize(x))
    assert torch.equal(values[:BLOCK], torch.zeros(BLOCK))
    assert torch.isnan(values[BLOCK:2 * BLOCK]).all()  # the guard after the sum sees the overflow
    assert torch.equal(values[2 * BLOCK:], torch.full((BLOCK,), 1.5))


def test_error_feedback_carries_what_rounding_lost_into_the_next_step():
    """The residual telescopes: what went out over the steps plus what is still held is what came in."""
    gen = torch.Generator().manual_seed(1)
    residual = torch.zeros(2 * BLOCK)
    sent = torch.zeros(2 * BLOCK, dtype=torch.float64)
    given = torch.zeros(2 * BLOCK, dtype=torch.float64)
    for _ in range(50):
        x = torch.randn(2 * BLOCK, generator=gen)
        given += x.double()
        sent += dequantize(*compress_with_feedback(x, residual)).double()
    torch.testing.assert_close(sent + residual.double(), given, rtol=0, atol=1e-4)
    one_shot = dequantize(*quantize(given.float())) - given.float()
    assert residual.abs().max() < 0.1 and one_shot.abs().max() > 0  # bounded: each step's error is carried once


def test_an_overflowed_step_leaves_no_nan_in_the_residual():
    residual = torch.zeros(BLOCK)
    x = torch.ones(BLOCK)
    x[3] = math.nan
    q, scales = compress_with_feedback(x, residual)
    assert torch.isnan(dequantize(q, scales)).all()
    assert torch.equal(residual, torch.zeros(BLOCK))  # reset, not carried into every later step


def test_pack_and_unpack_are_inverse():
    q = torch.randint(-LEVELS, LEVELS + 1, (2 * BLOCK,), dtype=torch.int8)
    scales = torch.tensor([0.5, 3.25])
    data = torch.empty(packed_bytes(2 * BLOCK), dtype=torch.uint8)
    pack(q, scales, data)
    back_q, back_scales = unpack(data, 2 * BLOCK)
    assert torch.equal(back_q, q) and torch.equal(back_scales, scales)
    assert packed_bytes(BLOCK) / (4 * BLOCK) == pytest.approx(0.254, abs=1e-3)


@pytest.mark.parametrize("numel, parts, expected", [(1, 2, 2 * BLOCK), (2 * BLOCK, 2, 2 * BLOCK),
                                                    (2 * BLOCK + 1, 2, 4 * BLOCK), (5 * BLOCK, 3, 6 * BLOCK)])
def test_padded_length_is_whole_blocks_in_equal_parts(numel, parts, expected):
    assert padded_length(numel, parts) == expected


def test_a_residual_of_another_length_starts_from_zero():
    store = ErrorFeedback()
    like = torch.empty(0)
    store.get("0/0/worker", BLOCK, like).fill_(2.0)
    assert torch.equal(store.get("0/0/worker", BLOCK, like), torch.full((BLOCK,), 2.0))
    assert torch.equal(store.get("0/0/worker", 2 * BLOCK, like), torch.zeros(2 * BLOCK))
    saved = store.state()
    store.clear()
    store.load(saved)
    assert torch.equal(store.residuals["0/0/worker"], torch.zeros(2 * BLOCK))


def test_a_resume_takes_this_ranks_residuals_at_the_same_world_size_only():
    """``ErrorFeedback.load_entries``: rank 1 of 2 keeps its own residuals from a checkpoint of 2 ranks; from one of
    another world size (other shards) or in a run without int8 they start from zero."""
    from types import SimpleNamespace

    from hpcnet.ckpt.schema import FEEDBACK_PREFIX
    from hpcnet.stateful import Saved

    def rank1(compression):
        return ErrorFeedback(SimpleNamespace(Get_rank=lambda: 1, Get_size=lambda: 2),
                             in_checkpoints=compression == "int8")

    saved = {f"{FEEDBACK_PREFIX}0/3/0/worker": torch.ones(BLOCK),
             f"{FEEDBACK_PREFIX}1/3/0/worker": torch.full((BLOCK,), 2.0), "model/w": torch.zeros(3)}
    same = rank1("int8")
    same.load_entries(Saved(saved, {}, saved_world_size=2))
    assert list(same.residuals) == ["3/0/worker"]
    assert torch.equal(same.residuals["3/0/worker"], torch.full((BLOCK,), 2.0))
    for compression, size in [("int8", 3), ("none", 2)]:
        other = rank1(compression)
        other.get("stale", BLOCK, torch.empty(0))
        other.load_entries(Saved(saved, {}, saved_world_size=size))
        assert other.residuals == {}
    assert [same.wants(name) for name in saved] == [False, True, None]  # its own only; the model's are not its
