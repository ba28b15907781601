"""Where a model's weights come from, read in one room: a kiln checkpoint (with the recipe it
holds), an adapters-only checkpoint on its base, a Hugging Face folder, and
``checkpoint.init_from``, which names the pretrained start of a run. The trainer, ``kiln
export``, ``kiln eval`` and ``kiln generate`` call it; ``kiln import`` writes the recipe of a
Hugging Face model (``hf_recipe.py``)."""
