"""Finding a model's repeated blocks and swapping one for its wrapped version.

Models declare their blocks with ``blocks()`` (docs/design.md). A wrapper (activation
checkpointing) must take a block's place in the model, so every parallelism step goes through
``replace_block``: the model's own ``replace_block(i, new)`` hook if it has one, else the
attribute of the parent module that holds the block (a ``ModuleList``/``ModuleDict`` entry, or
any submodule), found by identity.
"""

from __future__ import annotations

from torch import nn

from kiln.components.errors import KilnError

# Prefixes that wrappers add to parameter names (checkpoint_wrapper, torch.compile).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks; an error naming the protocol if it declares none."""
    fn = getattr(model, "blocks", None)
    if fn is None:
        raise KilnError(
            f"{type(model).__name__} has no blocks() method; the parallelism code needs the "
            "model protocol of docs/design.md (blocks() returning the repeated blocks)"
        )
    return list(fn())


def replace_block(model: nn.Module, index: int, new: nn.Module) -> None:
    """Put ``new`` where ``model.blocks()[index]`` is now."""
    hook = getattr(model, "replace_block", None)
    if hook is not None:
        hook(index, new)
        return
    old = model_blocks(model)[index]
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)  # ModuleList/ModuleDict entries are named children
                return
    raise KilnError(
        f"block {index} of {type(model).__name__} is not a submodule of the model; keep blocks "
        "in an nn.ModuleList/ModuleDict or define replace_block(i, module)"
    )


def clean_name(name: str) -> str:
    """A parameter or module name without the wrapper prefixes (the unwrapped model's name)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
