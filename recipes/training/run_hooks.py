"""The trainer's own hooks: the run folder's recipe after the first step, the loader's close."""

from __future__ import annotations

import json

from kiln.components.protocols import Hook
from kiln.components.tokenizers.chat_templates import TEMPLATE_FILE
from kiln.recipes.config.files import write_text_atomic
from kiln.recipes.runs.lineage import PARENT


class WriteRecipe(Hook):
    """``RUN/recipe.toml`` (a chat run's ``chat_template.jinja``, a run started from another
    run's weights its ``parent.json``) once the first step is done: a run that fails before
    it leaves no folder behind, nor changes an earlier run's."""

    priority = 1000  # the folder exists before any other first-step work

    def on_first_step(self, trainer) -> None:
        if trainer.world.is_main:
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(trainer.run_dir / "recipe.toml", trainer.recipe_toml)
            template = trainer.dataset.template  # chat data: what it used
            if template is not None:
                write_text_atomic(trainer.run_dir / TEMPLATE_FILE, template.source)
            parent = getattr(trainer, "parent", None)  # started from another run's weights
            if parent is not None:
                write_text_atomic(trainer.run_dir / PARENT, json.dumps(parent, indent=1))


class CloseLoader(Hook):
    """Stops the training loader's read-ahead thread, if it has one."""

    priority = -1000

    def close(self, trainer) -> None:
        close = getattr(trainer.train_loader, "close", None)  # loaders without threads have none
        if close is not None:
            close()
