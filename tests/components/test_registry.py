"""The registry: registration, duplicates, lookups with suggestions, entry-point plugins."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
from pydantic import Field

from kiln.components import registry
from kiln.components.base import ComponentConfig
from tests.conftest import REPO


class _Cfg(ComponentConfig):
    size: int = Field(1, description="a size")


def test_register_get_and_build():
    @registry.register("norm", "test_norm_a")
    class A:
        """A test norm."""

        Config = _Cfg

        def __init__(self, cfg, *, dim):
            self.dim, self.size = dim, cfg.size

    try:
        entry = registry.get("norm", "test_norm_a")
        assert entry.doc == "A test norm." and entry.config is _Cfg
        built = _Cfg(type="test_norm_a", size=3).build(dim=8)
        assert (built.dim, built.size) == (8, 3)
        assert "test_norm_a" in registry.names("norm")
    finally:
        registry.unregister("norm", "test_norm_a")


def test_duplicate_name_names_both_definitions():
    @registry.register("norm", "test_dup")
    class First:
        Config = _Cfg

    try:
        with pytest.raises(registry.RegistryError) as info:
            @registry.register("norm", "test_dup")
            class Second:
                Config = _Cfg
        msg = str(info.value)
        assert "First" in msg and "Second" in msg
    finally:
        registry.unregister("norm", "test_dup")


def test_component_without_config_is_rejected():
    with pytest.raises(registry.RegistryError, match="no config"):
        @registry.register("norm", "test_noconf")
        class NoConf:
            pass


def test_unknown_name_suggests_and_lists():
    with pytest.raises(registry.RegistryError) as info:
        registry.get("schedule", "warmup_cosin")
    assert "did you mean 'warmup_cosine'" in str(info.value) and "wsd" in str(info.value)
    with pytest.raises(registry.RegistryError, match="unknown component kind"):
        registry.get("flavour", "x")


def _make_dist(root, name: str, module: str, body: str, value: str | None = None):
    (root / module).mkdir()
    (root / module / "__init__.py").write_text(textwrap.dedent(body))
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    info.joinpath("entry_points.txt").write_text(
        f"[kiln.components]\n{module} = {value or module}\n")


PLUGIN = """
    from pydantic import Field
    from kiln.components.base import ComponentConfig
    from kiln.components.registry import register

    class FlatConfig(ComponentConfig):
        level: float = Field(0.5, description="constant LR multiplier")

    @register("schedule", "plugin_flat")
    class Flat:
        '''A constant schedule from a plugin.'''
        Config = FlatConfig
        def __init__(self, cfg, *, total_steps):
            self.level = cfg.level
        def __call__(self, step):
            return self.level
"""


@pytest.mark.slow
def test_entry_point_plugin_is_listed_and_usable_in_a_recipe(tmp_path, write):
    _make_dist(tmp_path, "kiln-flat-plugin", "kiln_flat_plugin", PLUGIN)
    _make_dist(tmp_path, "kiln-broken-plugin", "kiln_broken_plugin", "raise ImportError('boom')")
    recipe = write("r.toml", """
        [optimizer]
        type = "adamw"
        [optimizer.schedule]
        type = "plugin_flat"
        level = 0.25
    """)
    code = textwrap.dedent(f"""
        import sys, warnings
        sys.path.insert(0, {str(tmp_path)!r})
        from kiln.recipes.cli import main
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            main(["list", "schedule", "--brief"])
            from kiln.recipes.config.files import load_recipe
            r = load_recipe({str(recipe)!r})
            print("LEVEL", r.optimizer.schedule.build(total_steps=10)(3))
        print("WARN", [str(w.message) for w in caught])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "schedule:plugin_flat  - A constant schedule from a plugin." in out.stdout
    assert "LEVEL 0.25" in out.stdout
    # The broken plugin warns with its distribution's name and breaks nothing else.
    assert "kiln-broken-plugin" in out.stdout and "boom" in out.stdout


def test_plugin_callable_value_is_called(tmp_path, monkeypatch):
    body = textwrap.dedent("""
        calls = []
        def setup():
            calls.append(1)
    """)
    _make_dist(tmp_path, "kiln-callable-plugin", "kiln_callable_plugin", body,
               value="kiln_callable_plugin:setup")
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.load_plugins(force=True)
    import kiln_callable_plugin

    assert kiln_callable_plugin.calls == [1]


def test_did_you_mean_offers_a_second_choice_as_close_as_the_first():
    from kiln.components.registry import did_you_mean

    assert did_you_mean("stepz", ["seed", "step", "steps", "seq_len"]) == \
        " (did you mean 'step' or 'steps'?)"
    assert did_you_mean("trainig", ["training", "tokenizer", "data"]) == \
        " (did you mean 'training'?)"
    assert did_you_mean("zzz", ["training"]) == ""


def test_a_second_thread_waits_for_the_built_ins_to_finish_loading(tmp_path, monkeypatch):
    # A thread pool's first lookups (scripts/fuzz_train.py) found the hooks half registered:
    # the flag said "loaded" while the first thread was still importing.
    package = tmp_path / "kiln_slow_builtins"
    package.mkdir()
    (package / "__init__.py").write_text("BUILTINS = ['kiln_slow_builtins.late']\n")
    (package / "late.py").write_text(textwrap.dedent("""
        import time
        from pydantic import Field
        from kiln.components import registry
        from kiln.components.base import ComponentConfig

        time.sleep(0.3)

        class _Cfg(ComponentConfig):
            size: int = Field(1, description="a size")

        @registry.register("hook", "test_late_hook")
        class Late:
            Config = _Cfg
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "BUILTIN_PACKAGES", ("kiln_slow_builtins",))
    monkeypatch.setattr(registry, "_builtins_loaded", False)
    found: list[object] = []

    def look_up() -> None:
        found.append(registry.get("hook", "test_late_hook").name)

    first = threading.Thread(target=registry.ensure_loaded)
    first.start()
    time.sleep(0.05)  # the first thread is inside the slow import now
    try:
        look_up()
    finally:
        first.join()
        registry.unregister("hook", "test_late_hook")
    assert found == ["test_late_hook"]
