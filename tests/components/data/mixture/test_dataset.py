"""The ``mixture`` dataset and its loader: sources told apart by their bytes (source ``a``'s
text is all ``a``), so a row's ``source_ids`` can be checked against what it holds."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch

from kiln.components.data.mixture.loader import MixtureLoader
from kiln.components.errors import DataError, KilnError, RecipeError
from kiln.recipes.config.files import load_recipe

L = 16  # seq_len
LETTERS = {"a": "a", "b": "b", "c": "c"}


def _folder(root, name, docs=30, words=40):
    folder = root / "text" / name
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        (folder / f"{i:03d}.txt").write_text(" ".join([LETTERS.get(name, "z") * 3] * words))
    return folder


def _recipe(tmp_path, data: str, sources=("a", "b", "c"), overrides=()):
    tables = "".join(
        f'\n[data.sources.{n}]\ntype = "packed_documents"\nsource = "folder"\n'
        f'source_path = "{_folder(tmp_path, n)}"\neval_fraction = 0.2\n' for n in sources)
    path = tmp_path / "mix.toml"
    path.write_text(f'[training]\nseq_len = {L}\nsteps = 50\n[data]\ntype = "mixture"\n'
                    f"{textwrap.dedent(data)}{tables}")
    return load_recipe(path, list(overrides))


def _mixture(tmp_path, data="weights = {a = 0.5, b = 0.3, c = 0.2}\n", **kw):
    recipe = _recipe(tmp_path, data, **kw)
    ds = recipe.data.build(tokenizer=recipe.tokenizer.build(), seq_len=L, seed=0)
    ds.prepare()
    return ds, recipe


def _letter(row: torch.Tensor) -> str:
    """The source letter a row of byte tokens holds (ids 0-255 are bytes, then BOS and EOS)."""
    text = bytes(int(t) for t in row if int(t) < 256).decode("latin-1")
    letters = {ch for ch in text if ch.isalpha()}
    assert len(letters) == 1, letters
    return letters.pop()


def _steps(loader: MixtureLoader, steps: int) -> list[dict[str, torch.Tensor]]:
    """Each global step's micro-batches of this loader, concatenated."""
    out = []
    for _ in range(steps):
        parts = [next(loader) for _ in range(loader.micro_per_step)]
        out.append({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    return out


def test_rows_come_from_the_source_named_and_shares_hold_in_every_window(tmp_path):
    ds, _ = _mixture(tmp_path)
    loader = ds.loader("train", micro_batch=8, global_batch=8)
    batches = _steps(loader, 250)  # 2,000 sequences
    src = torch.cat([b["source_ids"] for b in batches]).numpy()
    for b in batches[:20]:
        for row, s in zip(b["input_ids"], b["source_ids"], strict=True):
            assert _letter(row) == ds.names[s]
    for start in range(0, 1001, 50):
        share = np.bincount(src[start:start + 1000], minlength=3) / 1000
        assert np.abs(share - [0.5, 0.3, 0.2]).max() <= 0.01, (start, share)
    assert loader.source_counts() == dict(zip("abc", np.bincount(src).tolist(), strict=True))


def test_each_source_gives_its_windows_in_order_across_epochs(tmp_path):
    ds, _ = _mixture(tmp_path)
    loader = ds.loader("train", micro_batch=4, global_batch=8)
    got = {n: [] for n in ds.names}
    for b in _steps(loader, 200):
        for row, s in zip(b["input_ids"], b["source_ids"], strict=True):
            got[ds.names[s]].append(row)
    for name, rows in got.items():
        reader, per_epoch = ds.reader(name, "train"), ds.windows(name, "train")
        assert len(rows) > per_epoch  # the test crosses an epoch boundary
        want = [torch.from_numpy(reader.read(k // per_epoch, k % per_epoch, 1)[0, :-1])
                for k in range(len(rows))]
        assert all(torch.equal(a, b) for a, b in zip(rows, want, strict=True)), name


@pytest.mark.parametrize(("world", "micro"), [(2, 2), (2, 4), (4, 1)])
def test_every_world_size_and_micro_batch_sees_the_same_global_batches(tmp_path, world, micro):
    ds, _ = _mixture(tmp_path)
    one = _steps(ds.loader("train", micro_batch=8, global_batch=8), 12)
    ranks = [_steps(ds.loader("train", micro_batch=micro, global_batch=8, rank=r,
                              world_size=world), 12) for r in range(world)]
    for g in range(12):
        for key in ("input_ids", "labels", "doc_ids", "source_ids"):
            assert torch.equal(one[g][key], torch.cat([r[g][key] for r in ranks])), (g, key)


def test_stages_switch_weights_at_their_step_and_rows_continue(tmp_path):
    ds, _ = _mixture(tmp_path, "weights = {a = 0.5, b = 0.5}\n[[stages]]\nstep = 5\n"
                     "weights = {c = 3, a = 1}\n".replace("[[stages]]", "[[data.stages]]"))
    loader = ds.loader("train", micro_batch=8, global_batch=8)
    steps = _steps(loader, 30)
    before = torch.cat([b["source_ids"] for b in steps[:5]])
    after = torch.cat([b["source_ids"] for b in steps[5:]])
    assert set(before.tolist()) == {0, 1} and set(after.tolist()) == {0, 2}
    assert abs((after == 2).float().mean().item() - 0.75) < 0.02
    counts = loader.source_counts()
    assert counts == {"a": int((before == 0).sum() + (after == 0).sum()),
                      "b": int((before == 1).sum()), "c": int((after == 2).sum())}
    assert counts == dict(zip(ds.names, ds.counts_before(30, 8).tolist(), strict=True))
    # source a's rows continue across the switch: its windows in order, none repeated
    a_rows = [r for b in steps for r, s in zip(b["input_ids"], b["source_ids"], strict=True)
              if s == 0]
    reader = ds.reader("a", "train")
    assert torch.equal(a_rows[-1], torch.from_numpy(reader.read(0, len(a_rows) - 1, 1)[0, :-1]))


def test_a_cursor_resumes_exactly_also_on_another_world_size(tmp_path):
    ds, _ = _mixture(tmp_path, "weights = {a = 2, b = 1, c = 1}\n[[data.stages]]\nstep = 6\n"
                     "weights = {b = 1}\n")
    full = _steps(ds.loader("train", micro_batch=8, global_batch=8), 10)
    cut = ds.loader("train", micro_batch=2, global_batch=8, rank=0, world_size=2)
    _steps(cut, 4)
    state = json.loads(json.dumps(cut.state_dict()))  # saved as JSON in the rank file
    assert state["step"] == 4 and state["micro"] == 0
    resumed = ds.loader("train", micro_batch=4, global_batch=8)
    resumed._cached = (0, np.zeros(3, dtype=np.int64))
    resumed.load_state_dict(state)
    for g, batch in enumerate(_steps(resumed, 6), start=4):
        assert torch.equal(batch["input_ids"], full[g]["input_ids"]), g
        assert torch.equal(batch["source_ids"], full[g]["source_ids"]), g


def test_a_malformed_or_foreign_cursor_is_one_data_error(tmp_path):
    ds, _ = _mixture(tmp_path)
    loader = ds.loader("train", micro_batch=8, global_batch=8)
    state = loader.state_dict()
    with pytest.raises(DataError, match="malformed data loader cursor"):
        loader.load_state_dict({**state, "rows_before_step": {"a": -1, "b": 0, "c": 0}})
    with pytest.raises(DataError, match="holds sources"):
        loader.load_state_dict({**state, "sources": ["a", "b"]})
    with pytest.raises(DataError, match="global_batch = 16"):
        loader.load_state_dict({**state, "global_batch": 16})


def test_the_eval_split_is_per_source_and_never_trained_on(tmp_path):
    ds, _ = _mixture(tmp_path)
    for name in ds.names:
        batches = list(ds.loader("eval", micro_batch=2, global_batch=2, source=name))
        assert batches and all(_letter(r) == name for b in batches for r in b["input_ids"])
        assert "source_ids" not in batches[0]
    every = ds.loader("eval", micro_batch=2, global_batch=2)
    assert len(list(every)) == len(every) == sum(
        len(ds.loader("eval", micro_batch=2, global_batch=2, source=n)) for n in ds.names)


def test_the_run_plan_counts_every_sequence_and_the_epochs(tmp_path):
    ds, _ = _mixture(tmp_path, "weights = {a = 1, b = 1, c = 2}\n[[data.stages]]\nstep = 40\n"
                     "weights = {a = 1}\n")
    plan = ds.plan(50, 8)
    whole = [p for p in plan if p["stage"] is None]
    assert sum(p["sequences"] for p in whole) == 50 * 8
    first = {p["source"]: p for p in plan if p["stage"] == 0}
    assert sum(p["sequences"] for p in first.values()) == 40 * 8
    assert first["c"]["share"] == pytest.approx(0.5, abs=0.01)
    second = {p["source"]: p for p in plan if p["stage"] == 1}
    assert second["a"]["sequences"] == 80 and second["b"]["sequences"] == 0
    a = next(p for p in whole if p["source"] == "a")
    assert a["epochs"] == pytest.approx(a["sequences"] / ds.windows("a", "train"))
    assert a["tokens"] == a["sequences"] * L


def test_max_epochs_stops_the_run_before_step_one_or_warns_with_repeat(tmp_path):
    data = "weights = {a = 0.5, b = 0.5}\nmax_epochs = {a = 1.5}\n"
    ds, _ = _mixture(tmp_path, data, sources=("a", "b"))
    with pytest.raises(DataError, match=r"data.sources.a: the run reads it .* above "
                       r"data.max_epochs.a = 1.5.*on_exhausted"):
        ds.check_run(200, 8)
    assert ds.check_run(5, 8) == []
    loader = ds.loader("train", micro_batch=8, global_batch=8)
    with pytest.raises(DataError, match="past data.max_epochs.a"):
        _steps(loader, 200)
    ds2, _ = _mixture(tmp_path, data + 'on_exhausted = "repeat"\n', sources=("a", "b"))
    (line,) = ds2.check_run(200, 8)
    assert line.startswith("warning: data.sources.a") and "repeating" in line
    _steps(ds2.loader("train", micro_batch=8, global_batch=8), 200)


@pytest.mark.parametrize(("data", "message"), [
    ("weights = {a = 0, b = 1, c = 1}", "data.weights.a = 0.0: a weight must be .* > 0"),
    ("weights = {a = -1, b = 1, c = 1}", "data.weights.a = -1.0"),
    ("weights = {a = 1, b = 1, c = 1, d = 1}", "data.weights names unknown source.* d"),
    ("[[data.stages]]\nstep = 5\nweights = {}", r"data.stages\[0\].weights is empty"),
    ("[[data.stages]]\nstep = 5\nweights = {x = 1}", r"data.stages\[0\].weights names unknown "
     "source.* x; sources: a, b, c"),
    ("[[data.stages]]\nstep = 5\nweights = {a = 1}\n[[data.stages]]\nstep = 5\n"
     "weights = {b = 1}", r"data.stages\[1\] begins at step 5, not after the stage before it"),
    ("[[data.stages]]\nstep = 5\nfraction = 0.5\nweights = {a = 1}",
     r"data.stages\[0\]: give step \(>= 1\) or fraction \(0 < f < 1\), one of them"),
    ("[[data.stages]]\nweights = {a = 1}", r"data.stages\[0\]: give step"),
    ("max_epochs = {q = 2}", "data.max_epochs names unknown source 'q'"),
])
def test_bad_mixture_settings_are_one_line_naming_the_key(tmp_path, data, message):
    with pytest.raises(RecipeError, match=message):
        _mixture(tmp_path, data + "\n")


def test_a_stage_placed_by_fraction_moves_with_the_runs_length(tmp_path):
    ds, _ = _mixture(tmp_path, "[[data.stages]]\nfraction = 0.75\nweights = {a = 1}\n")
    with pytest.raises(RecipeError, match="call check_run"):
        _steps(ds.loader("train", micro_batch=8, global_batch=8), 1)
    assert ds.check_run(40, 8) == []
    assert [s.step for s in ds.stages] == [0, 30]
    assert ds.check_run(2, 8) == [] and [s.step for s in ds.stages] == [0, 1]
    (line,) = ds.check_run(1, 8)  # a one-step smoke run: the stage cannot run, and says so
    assert line == ("warning: data.stages[0] (fraction 0.75) falls at step 1 of a 1-step run: "
                    "it does not run") and len(ds.stages) == 1


def test_a_source_without_weight_is_evaluated_only(tmp_path):
    ds, _ = _mixture(tmp_path, "weights = {a = 1, b = 1}\n")
    assert ds.check_run(10, 8) == [
        "data: data.weights sum to 2, not 1: used as shares a 0.5, b 0.5",
        "data: c is evaluated only (no weight in any stage)"]
    loader = ds.loader("train", micro_batch=8, global_batch=8)
    assert 2 not in torch.cat([b["source_ids"] for b in _steps(loader, 10)]).tolist()
    assert len(ds.loader("eval", micro_batch=2, global_batch=2, source="c")) > 0


def test_weights_that_do_not_sum_to_one_are_rescaled_with_a_line(tmp_path):
    ds, _ = _mixture(tmp_path, "weights = {a = 0.5, b = 0.3, c = 0.2}\n"
                     "[[data.stages]]\nstep = 5\nweights = {a = 3, c = 1}\n")
    assert ds.check_run(10, 8) == [
        "data: data.stages[0].weights sum to 4, not 1: used as shares a 0.75, c 0.25"]


def test_a_stage_past_the_run_is_refused(tmp_path):
    ds, _ = _mixture(tmp_path, "[[data.stages]]\nstep = 60\nweights = {a = 1}\n")
    with pytest.raises(RecipeError, match=r"data.stages\[0\].step = 60 is not below "
                       "training.steps = 50"):
        ds.check_run(50, 8)


def test_missing_empty_or_too_small_sources_name_the_source(tmp_path):
    recipe = _recipe(tmp_path, "", sources=("a", "b"))
    recipe.data.sources["b"].source_path = str(tmp_path / "nowhere")
    ds = recipe.data.build(tokenizer=recipe.tokenizer.build(), seq_len=L, seed=0)
    with pytest.raises(DataError, match="data.sources.b: source folder .*nowhere.* does not exist"):
        ds.prepare()
    (tmp_path / "empty").mkdir()
    recipe.data.sources["b"].source_path = str(tmp_path / "empty")
    ds = recipe.data.build(tokenizer=recipe.tokenizer.build(), seq_len=L, seed=0)
    with pytest.raises(DataError, match="data.sources.b: source folder .* holds no"):
        ds.prepare()
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "x.txt").write_text("bb")
    recipe.data.sources["b"].source_path = str(tiny)
    recipe.data.sources["b"].eval_fraction = 0.0
    ds = recipe.data.build(tokenizer=recipe.tokenizer.build(), seq_len=L, seed=0)
    with pytest.raises(DataError, match=r"data.sources.b: its train split holds fewer than "
                       r"seq_len \+ 1 = 17 tokens"):
        ds.prepare()


def test_a_source_whose_eval_split_is_too_small_is_refused_when_evaluated(tmp_path):
    ds, _ = _mixture(tmp_path)
    with pytest.raises(DataError, match=r"data.sources.a: its eval split holds \d+ sequences "
                       "of 16 tokens, fewer than one eval batch"):
        ds.loader("eval", micro_batch=512, global_batch=512, source="a")


def test_a_source_without_row_access_or_another_tokenizer_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="data.sources.s: a 'streaming_text' dataset cannot be "
                       "a mixture source yet"):
        _mixture(tmp_path, '[data.sources.s]\ntype = "streaming_text"\n')
    ds, recipe = _mixture(tmp_path)
    folder = ds.children["a"].folder  # a built folder, given as a prepared path

    class Other:
        vocab_size, source, bos_id, eos_id = 300, "other", 298, 299

        def fingerprint(self):
            return "other-tokenizer"

    recipe.data.sources["a"].path = str(folder)
    other = recipe.data.build(tokenizer=Other(), seq_len=L, seed=0)
    with pytest.raises(DataError, match=r"data.sources.a: dataset folder .* was tokenized by "
                       r".*but the recipe's tokenizer is"):
        other.prepare()


def test_mixture_errors_reach_the_user_as_kiln_errors(tmp_path):
    with pytest.raises(KilnError, match=r"needs sources"):
        _mixture(tmp_path, "", sources=())
