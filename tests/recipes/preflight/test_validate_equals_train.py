"""`kiln validate` refuses what `kiln train` refuses, with the same exit status and message:
every bad recipe below runs through both (they share ``recipes/preflight/checks.py``)."""

from __future__ import annotations

import pytest

from kiln.recipes.cli import main
from tests.conftest import CONFIGS

SMALL = ["--model.dim=32", "--model.n_layers=1", "--model.attention.n_heads=2",
         "--model.ffn.hidden_dim=32", "--training.seq_len=32", "--training.steps=4",
         "--training.global_batch=2", "--training.micro_batch=1", "--eval.tokens=256",
         "--checkpoint.enable=false", "--run.health_check.enable=off"]
CHAT = ["--data.builtin_rows=200", "--training.seq_len=128"]
MIX = ["--data.sources.code.max_bytes=200000", "--data.sources.tests.max_bytes=100000",
       "--data.sources.docstrings.max_bytes=100000"]
LORA = ["--adapter.rank=2"]

# (id, recipe, overrides, a fragment of the message both must print)
BAD = [
    ("syntax", None, [], "line 3"),
    ("unknown-key", "debug.toml", ["--training.stepss=3"], "did you mean 'steps'"),
    ("micro-batch", "debug.toml", ["--training.micro_batch=3"], "micro_batch"),
    ("no-budget", "debug.toml", ["--training.steps=0"], "no training budget"),
    ("tp-over-world", "debug.toml", ["--parallelism.tp=2"], "parallelism.tp"),
    ("vocab", "debug.toml", ["--model.vocab_size=128"], "smaller than the tokenizer"),
    ("missing-data", "debug.toml", ["--data.path=no/such/folder"], "no/such/folder"),
    ("mixture-unknown-source", "mixture_debug.toml",
     [*MIX, "--data.weights={code = 0.5, nope = 0.5}"], "unknown source(s) nope"),
    ("mixture-stage-past-the-end", "mixture_debug.toml",
     [*MIX, '--data.stages=[{step = 50, weights = {code = 1.0}}]'], "would never run"),
    ("mixture-epochs", "mixture_debug.toml",
     [*MIX, "--training.steps=400", "--data.max_epochs={docstrings = 0.01}",
      "--data.on_exhausted=error"], "above data.max_epochs.docstrings"),
    ("lora-random-base", "sft_debug.toml", [*CHAT, *LORA], "allow_random_base = true"),
    ("lora-idle-glob", "sft_debug.toml",
     [*CHAT, *LORA, "--adapter.allow_random_base=true",
      '--adapter.targets=["*.attention.wq", "*.q_proj"]'], "'*.q_proj' matches no linear"),
    ("lora-tied-output", "sft_debug.toml",
     [*CHAT, *LORA, "--adapter.allow_random_base=true", '--adapter.targets=["output"]'],
     "tied embeddings"),
    ("lora-float8", "sft_debug.toml",
     [*CHAT, *LORA, "--adapter.allow_random_base=true", "--parallelism.float8=rowwise"],
     "not with parallelism.float8"),
    ("lora-export-at-end", "sft_debug.toml",
     [*CHAT, *LORA, "--adapter.allow_random_base=true", "--checkpoint.export_at_end=true"],
     "export_at_end with [adapter]"),
    ("bptt-not-looped", "debug.toml", ["--training.step.type=segmented_bptt"],
     "needs a looped model"),
    ("chat-segmented-step", "sft_debug.toml",
     [*CHAT, "--training.step.type=segmented_bptt", "--model.type=looped"], "token-weighted"),
    ("init-from-missing", "debug.toml", ["--checkpoint.init_from=no/such/model"],
     "checkpoint.init_from = 'no/such/model': no such folder"),
    ("lora-base-missing", "sft_debug.toml",
     [*CHAT, *LORA, "--checkpoint.init_from=no/such/base"], "no such folder"),
    # validate passed both; train died in the first forward (a bare ValueError, and
    # "strides should be multiple of 16 bytes")
    ("rope-table-short", "debug.toml", ["--model.max_seq_len=16"],
     "training.seq_len = 32 exceeds the 16 positions the model knows"),
    ("moe-grouped-odd-width", "debug.toml",
     ["--model.ffn.type=moe", "--model.ffn.hidden_dim=6", "--model.ffn.dispatch=grouped"],
     "torch._grouped_mm needs widths that are a multiple of 4 in float32, and the experts "
     "have 32, 6"),
    # validate passed it; train failed to trace ("Expected inputs of BF16 type")
    ("moe-grouped-compiled", "debug.toml",
     ["--model.ffn.type=moe", "--model.ffn.dispatch=grouped", "--parallelism.compile=true"],
     "traces torch._grouped_mm in bfloat16 only"),
    # validate read no task file; train stopped before step 1
    ("task-file-missing", "debug_evals.toml", ["--evals.python_mc.path=no/such/task.jsonl"],
     "task 'python_mc': file no/such/task.jsonl not found"),
    ("task-field-missing", "debug_evals.toml", ["--evals.python_mc.fields.context=nope"],
     "task 'python_mc'"),
    ("task-pause-without-snapshots", "debug_evals.toml", ["--evals.python_em.mode=pause"],
     "evals.python_em.mode = \"pause\" saves a snapshot"),
]


def _both(capsys, path, overrides) -> tuple[tuple[int, str], tuple[int, str]]:
    status = main(["validate", str(path), *overrides])
    validate = capsys.readouterr().out
    train = main(["train", str(path), *overrides])
    trained = capsys.readouterr().err
    return (status, validate), (train, trained)


@pytest.mark.slow
@pytest.mark.parametrize("case, file, overrides, fragment", BAD, ids=[c[0] for c in BAD])
def test_validate_refuses_what_train_refuses(capsys, tmp_path, case, file, overrides,
                                             fragment):
    if file is None:
        path = tmp_path / "bad.toml"
        path.write_text('extends = "debug.toml"\n[training]\nsteps = = 3\n')
        (tmp_path / "debug.toml").write_text((CONFIGS / "debug.toml").read_text())
    else:
        path = CONFIGS / file
    looped = "--model.type=looped" in overrides  # (its stack is sized by n_recurrent)
    small = [a for a in SMALL if not (looped and a.startswith("--model.n_layers"))]
    args = [*small, f"--run.folder={tmp_path / 'run'}", *overrides]
    (v_status, v_out), (t_status, t_err) = _both(capsys, path, args)
    assert t_status != 0 and fragment in t_err, t_err
    message = t_err.split("kiln train: error: ", 1)[1].strip()
    assert v_status == t_status, v_out
    assert f"{path}: INVALID" in v_out and message in v_out.replace("\n  ", "\n"), v_out
    assert not (tmp_path / "run").exists()  # neither left a run folder behind


@pytest.mark.slow
def test_a_good_recipe_is_ok_in_validate_and_trains(capsys, tmp_path):
    """The counterpart: the same small recipe passes both (so the cases above fail for their
    own fault)."""
    args = [*SMALL, "--training.steps=1", f"--run.folder={tmp_path / 'run'}"]
    (v_status, v_out), (t_status, t_err) = _both(capsys, CONFIGS / "debug.toml", args)
    assert v_status == 0 and t_status == 0, (v_out, t_err)
    assert ": ok" in v_out and "trainable parameters: " in v_out


@pytest.mark.slow
def test_multi_token_prediction_under_adapters_on_a_hugging_face_base_is_refused(capsys,
                                                                                 tmp_path):
    """The base holds no MTP weights: the frozen modules would stay random and train the
    adapters toward them. Both commands refuse it with the same line."""
    pytest.importorskip("transformers")
    from kiln.recipes.loading.hf_recipe import import_recipe
    from tests.checkpointing.huggingface.hf_tiny import save_tiny

    save_tiny(tmp_path / "hf")
    import_recipe(str(tmp_path / "hf"), tmp_path / "hf.toml", seq_len=128)
    args = ["--data.type=chat", "--data.template=chatml", *CHAT, *LORA, "--model.mtp_depth=1",
            "--training.steps=1", f"--run.folder={tmp_path / 'run'}"]
    (v_status, v_out), (t_status, t_err) = _both(capsys, tmp_path / "hf.toml", args)
    assert t_status != 0 and "model.mtp_depth = 1 with [adapter] on a Hugging Face base" in t_err
    assert v_status == t_status and t_err.split("error: ", 1)[1].strip()[:60] in v_out, v_out
