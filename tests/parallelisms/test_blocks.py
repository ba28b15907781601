from __future__ import annotations

import pytest
from torch import nn

from kiln.components.errors import KilnError
from kiln.parallelisms.blocks import clean_name, model_blocks, replace_block
from tests.parallelisms.tiny import tiny_model


class ListModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def blocks(self):
        return list(self.layers)


class HookModel(ListModel):
    def __init__(self):
        super().__init__()
        self.calls = []

    def replace_block(self, i, module):
        self.calls.append(i)
        self.layers[i] = module


def test_replace_in_module_dict():
    model = tiny_model(meta=True)
    new = nn.Identity()
    replace_block(model, 1, new)
    assert model.layers["1"] is new and model_blocks(model)[1] is new


def test_replace_in_module_list_and_hook():
    model = ListModel()
    new = nn.Identity()
    replace_block(model, 0, new)
    assert model.layers[0] is new
    hooked = HookModel()
    replace_block(hooked, 1, new)
    assert hooked.calls == [1] and hooked.layers[1] is new


def test_errors_name_the_protocol():
    with pytest.raises(KilnError, match="blocks()"):
        model_blocks(nn.Linear(2, 2))
    model = ListModel()
    model.blocks = lambda: [nn.Linear(4, 4)]  # a block the model does not hold
    with pytest.raises(KilnError, match="replace_block"):
        replace_block(model, 0, nn.Identity())


def test_clean_name():
    assert clean_name("layers.1._checkpoint_wrapped_module._orig_mod.attention.wq.weight") == (
        "layers.1.attention.wq.weight"
    )
