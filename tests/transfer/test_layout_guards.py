"""Layouts built from client specs refuse shapes with nothing to copy."""

from __future__ import annotations

import pytest
import torch

from kvtier.transfer.layout import KVLayout


@pytest.mark.parametrize("shape, dim", [((0, 2, 4), 0), ((2, 0, 4), 1)])
def test_zero_blocks_is_a_value_error(shape, dim):
    # A REGISTER with num_blocks == 0 used to raise IndexError inside the
    # daemon (an INTERNAL reply); ValueError makes it a BAD_ARGUMENT.
    with pytest.raises(ValueError, match="no blocks"):
        KVLayout([torch.zeros(shape)], [dim])
