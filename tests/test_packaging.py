"""kiln installs under one top-level name, ``kiln``; the repository folders map onto it."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import tomllib
import venv
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, REPO

TOP = ("recipes", "components", "parallelisms", "checkpointing", "train_configs")


def _declared() -> tuple[list[str], dict[str, str]]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    tool = data["tool"]["setuptools"]
    return tool["packages"], tool["package-dir"]


def test_every_source_folder_is_a_declared_kiln_package():
    packages, package_dir = _declared()
    assert package_dir == {f"kiln.{top}": top for top in TOP}
    found = sorted(
        "kiln." + ".".join(init.parent.relative_to(REPO).parts)
        for top in TOP for init in (REPO / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    )
    assert sorted(packages) == found  # a new sub-package must be added to pyproject.toml
    assert all(p.split(".")[0] == "kiln" for p in packages)


@pytest.mark.slow
def test_installs_into_a_fresh_environment_beside_a_package_named_components(tmp_path):
    """A non-editable install next to an unrelated ``components`` package (first on sys.path)
    imports kiln's own modules and trains a step."""
    source = tmp_path / "source"  # pip builds in the source tree: keep the checkout clean
    skip = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__")
    # Run folders only at the top: recipes/runs/ is a package.
    shutil.copytree(REPO, source, ignore=lambda d, names: set(skip(d, names)) | (
        {"runs"} if Path(d) == REPO else set()))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    build = subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", "--no-deps", str(source)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]

    site_dir = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    names = sorted(p.name for p in Path(site_dir).iterdir() if not p.name.startswith(("_", "pip")))
    assert [n for n in names if n in TOP] == []  # no generic top-level modules installed
    assert "kiln" in names
    _see_dependencies_of_this_interpreter(Path(site_dir))

    # Someone else's `components` package, first on the path (the working directory).
    work = tmp_path / "work"
    (work / "components").mkdir(parents=True)
    (work / "components" / "__init__.py").write_text("raise ImportError('not kiln')\n")
    probe = subprocess.run(
        [str(py), "-c", "import kiln.components.registry as r, kiln.recipes.cli as c; "
         "print(r.__file__); print(c.__file__)"],
        capture_output=True, text=True, cwd=work, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert all(line.startswith(site_dir) for line in probe.stdout.split())

    run = subprocess.run(
        [str(env_dir / "bin" / "kiln"), "train", str(CONFIGS / "debug.toml"),
         "--training.steps=1", "--model.dim=32", "--model.n_layers=1",
         "--model.attention.n_heads=2", "--model.ffn.hidden_dim=64", "--training.seq_len=32",
         "--data.max_bytes=300000", "--data.eval_fraction=0.2", "--eval.tokens=256",
         "--checkpoint.enable=false",
         "--run.progress_bar=false", f"--run.folder={work / 'run'}"],
        capture_output=True, text=True, cwd=work, timeout=300,
        env={**os.environ, "PYTHONPATH": str(work)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (work / "run" / "metrics.jsonl").is_file()


def _see_dependencies_of_this_interpreter(site_dir: Path) -> None:
    """torch, tomli-w & co. come from the interpreter running the tests, wherever they are
    installed: a virtual environment (a venv's ``system_site_packages`` would show the base
    interpreter's, not the venv's), the system, or the user site. A ``.pth`` file appends those
    folders after the new environment's own, so its ``kiln`` comes first. Written after the
    install, so pip never sees the kiln installed there."""
    outer = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        outer.append(site.getusersitepackages())
    (site_dir / "_outer_site_packages.pth").write_text(
        "".join(f"{p}\n" for p in outer if Path(p).is_dir() and Path(p) != site_dir))
