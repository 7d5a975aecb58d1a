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


def test_a_dropped_layout_lets_go_of_the_engine_memory_at_once():
    """No reference cycle between the layout and its copy routine: the daemon
    unmaps a closed registration's segment right after dropping the layout
    (a cycle left it mapped until a GC pass, and made a refused REGISTER
    answer INTERNAL instead of BAD_ARGUMENT)."""
    import weakref
    tensors = [torch.zeros(8, 64) for _ in range(2)]
    layout = KVLayout(tensors, [0, 0])
    alive = weakref.ref(layout)
    del layout
    assert alive() is None
