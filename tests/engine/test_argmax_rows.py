"""``sampler.argmax_rows``: the same ids as ``torch.argmax`` on every path (blocked or not)."""

from __future__ import annotations

import pytest
import torch

from workbench.sampler import ARGMAX_BLOCK, ARGMAX_BLOCK_ROWS, argmax_max_rows, argmax_rows
from workbench.speculative.verify import finite_rows


@pytest.mark.parametrize("shape", [(1, 8192), (3, 8192), (4, 8192), (16, 8192), (2, 16, 8192),
                                   (64, 256), (5, 1000), (8, ARGMAX_BLOCK)])
def test_equals_argmax(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_ties_take_the_lowest_id_across_and_within_blocks() -> None:
    x = torch.zeros(ARGMAX_BLOCK_ROWS, 4 * ARGMAX_BLOCK)
    x[0, [5, 3 * ARGMAX_BLOCK + 1]] = 7.0  # tie across blocks
    x[1, [ARGMAX_BLOCK + 9, ARGMAX_BLOCK + 2]] = 7.0  # tie inside one block
    x[2] = 1.0  # every column ties
    x[3, -1] = 2.0  # the very last column
    assert argmax_rows(x).tolist() == [5, ARGMAX_BLOCK + 2, 0, 4 * ARGMAX_BLOCK - 1]
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_nan_and_inf_as_argmax() -> None:
    x = torch.randn(6, 2 * ARGMAX_BLOCK, generator=torch.Generator().manual_seed(1))
    x[0, [ARGMAX_BLOCK + 4, 7]] = float("nan")  # the first NaN wins
    x[1, 3] = float("inf")
    x[2] = float("-inf")
    x[3, [ARGMAX_BLOCK, 1]] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert argmax_rows(x)[:4].tolist() == [7, 3, 0, 1]


def test_non_contiguous_and_bf16() -> None:
    x = torch.randn(8, 2 * ARGMAX_BLOCK, generator=torch.Generator().manual_seed(2))
    assert torch.equal(argmax_rows(x[:, ::2]), x[:, ::2].argmax(-1))
    xb = x.to(torch.bfloat16)
    assert torch.equal(argmax_rows(xb), xb.argmax(-1))


@pytest.mark.parametrize("shape", [(1, 8192), (16, 8192), (2, 16, 8192), (5, 1000)])
def test_argmax_max_rows_is_argmax_and_amax(shape: tuple[int, ...]) -> None:
    """Blocked or not, with NaN, ±inf and all--inf rows: the ids are argmax's and the maxima
    amax's (NaN where the row holds one)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).view(-1, shape[-1])
    x[0, 17] = float("nan")
    if x.shape[0] > 3:
        x[1, 2] = float("inf")
        x[2] = float("-inf")
        x[3, :9] = float("-inf")
    x = x.view(shape)
    ids, top = argmax_max_rows(x)
    assert torch.equal(ids, x.argmax(-1))
    assert torch.equal(top.isnan(), x.amax(-1).isnan())
    assert torch.equal(top.nan_to_num(), x.amax(-1).nan_to_num())


def test_finite_rows_per_request() -> None:
    top = torch.tensor([[1.0, 2.0], [1.0, float("nan")], [float("-inf"), 0.0],
                        [3e38, 3e38], [float("inf"), 1.0]])
    assert finite_rows(top) == [True, False, False, True, False]
