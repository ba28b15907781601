from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kiln.components.data.prepare.packed_layout import open_layout
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer
from kiln.recipes.cli import main
from tests.components.data.corpora import DOCS, write_jsonl
from tests.conftest import REPO


@pytest.fixture
def texts(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(12):
        (folder / f"{i:02d}.txt").write_text(f"text number {i}\n" * (i + 3))
    (folder / "more.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n")
    return folder


def test_prepare_from_a_folder_then_reuse(tmp_path, texts, capsys):
    out = tmp_path / "data"
    args = ["data", "prepare", "--input", str(texts), "--out", str(out), "--seed", "5",
            "--workers", "0", "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    meta = json.loads((out / "metadata.json").read_text())
    assert "built in" in printed and str(out) in printed
    assert f"13 documents, {meta['total_tokens']:,} tokens" in printed
    assert meta["seed"] == 5 and meta["source"].startswith("inputs:")
    assert printed.splitlines()[-1] == (f"train on it: ./run_train.sh train_configs/debug.toml "
                                        f"--data.type=packed_documents --data.path={out} "
                                        "--tokenizer.type=byte")
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("reused (up to date)")
    assert main(["data", "info", str(out)]) == 0
    assert "valid packed-document layout" in capsys.readouterr().out


def test_prepare_default_goes_to_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    assert main(["data", "prepare", "--max-bytes", "30000", "--seq-len", "64"]) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "cache" / "packed" / "stdlib-") in printed
    assert "train on it: ./run_train.sh train_configs/debug.toml --data.path=" in printed
    assert "windows of 64" in printed


def test_prepare_from_a_recipe_with_overrides(tmp_path, texts, write, capsys):
    recipe = write("r.toml", f"""
        [training]
        seq_len = 16
        seed = 7

        [data]
        type = "packed_documents"
        source = "folder"
        source_path = "{texts}"
    """)
    out = tmp_path / "from_recipe"
    assert main(["data", "prepare", str(recipe), "--out", str(out),
                 "--data.num_epochs=2"]) == 0
    hint = f"train on it: ./run_train.sh {recipe} --data.num_epochs=2 --data.path={out}"
    assert capsys.readouterr().out.splitlines()[-1] == hint
    meta = json.loads((out / "metadata.json").read_text())
    assert (meta["seed"], meta["seq_len"], meta["num_epochs"]) == (7, 16, 2)
    # the recipe's own data.path given on the command line: the hint names it once
    assert main(["data", "prepare", str(recipe), f"--data.path={out}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == hint.replace("--data.num_epochs=2 ", "")


def test_corrupt_folder_exits_1(tmp_path, texts, capsys):
    out = tmp_path / "data"
    assert main(["data", "prepare", "--input", str(texts), "--out", str(out), "--workers",
                 "0"]) == 0
    (out / "tokens.bin").write_bytes(b"\0\0")
    capsys.readouterr()
    assert main(["data", "info", str(out)]) == 1
    err = capsys.readouterr().err
    assert "tokens.bin" in err and "kiln data prepare" in err and str(out) in err
    assert main(["data", "info", str(tmp_path / "missing")]) == 1


def test_bad_options_exit_2(texts, capsys):
    assert main(["data", "prepare", "--max-bytes", "0"]) == 2
    assert "max_bytes" in capsys.readouterr().err
    assert main(["data", "prepare", "--data.max_bytes=10"]) == 2
    assert "need a RECIPE" in capsys.readouterr().err


def test_train_a_tokenizer_then_prepare_parquet_and_shards(tmp_path, capsys):
    from tests.components.data.corpora import DOCS, write_jsonl, write_parquet

    texts = tmp_path / "texts"
    write_jsonl(texts / "a.jsonl")
    tok = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(texts), "stdlib", "--max-bytes",
                 "300000", "--vocab-size", "300", "--out", str(tok)]) == 0
    printed = capsys.readouterr().out
    assert "byte-level BPE of 300 entries" in printed and (tok / "tokenizer.json").is_file()
    assert printed.splitlines()[-1] == (f"use it with: --tokenizer.type=huggingface "
                                        f"--tokenizer.path={tok}")
    assert main(["tokenizer", "train", "--input", str(texts), "--vocab-size", "300",
                 "--out", str(tok)]) == 1  # never overwrites
    assert "already exists" in capsys.readouterr().err
    src = write_parquet(tmp_path / "c.parquet")
    out = tmp_path / "pq"
    assert main(["data", "prepare", "--input", str(src), "--out", str(out), "--tokenizer",
                 str(tok), "--workers", "0", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"{len(DOCS)} documents" in printed and printed.splitlines()[-1] == (
        f"train on it: ./run_train.sh train_configs/debug.toml --data.type=packed_documents "
        f"--data.path={out} "
        f"--tokenizer.type=huggingface --tokenizer.path={tok}")
    for domain in ("a", "b"):
        assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "sh"),
                     "--domain", domain, "--shard-tokens", "2000", "--workers", "0",
                     "--no-progress"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == ("train on it: ./run_train.sh train_configs/debug.toml "
                    "--data.type=balanced_shards "
                    f"--data.path={tmp_path / 'sh'} '--data.domains=[\"a\", \"b\"]' "
                    "--tokenizer.type=byte")
    assert main(["data", "info", str(tmp_path / "sh")]) == 0
    assert "balanced_shards domain b" in capsys.readouterr().out


def test_prepare_errors_exit_with_one_message(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    assert main(["data", "prepare", "--input", str(bad), "--out", str(tmp_path / "o"),
                 "--workers", "0", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl:1: no 'text' field" in err and "Traceback" not in err
    assert main(["data", "prepare", "--input", str(bad)]) == 2
    assert "--input needs --out" in capsys.readouterr().err
    assert main(["data", "prepare", "--input", str(bad), "--out", str(tmp_path / "o"),
                 "--tokenizer", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_info_reads_every_token_id(tmp_path, texts, capsys):
    """`kiln data info` calls a folder valid only when every id is inside the vocabulary."""
    import numpy as np

    out = tmp_path / "data"
    assert main(["data", "prepare", "--input", str(texts), "--out", str(out), "--workers", "0",
                 "--no-progress"]) == 0
    assert main(["data", "info", str(out)]) == 0
    assert "token ids: largest 257, inside the vocabulary of 258" in capsys.readouterr().out
    tokens = np.memmap(out / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[5] = 40000
    tokens.flush()
    assert main(["data", "info", str(out)]) == 1
    err = capsys.readouterr().err
    assert "token id 40000" in err and "258" in err and str(out) in err
    assert "kiln data prepare" in err


def test_train_on_ids_beyond_the_vocabulary_is_a_data_error(tmp_path, texts, write, capsys):
    import numpy as np

    out = tmp_path / "data"
    assert main(["data", "prepare", "--input", str(texts), "--out", str(out), "--workers", "0",
                 "--no-progress", "--eval-fraction", "0"]) == 0
    tokens = np.memmap(out / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[tokens == ord("t")] = 40000
    tokens.flush()
    recipe = write("r.toml", f"""
        [run]
        folder = "{tmp_path / 'run'}"
        [training]
        steps = 1
        global_batch = 2
        micro_batch = 2
        seq_len = 16
        [model]
        dim = 32
        n_layers = 1
        [model.attention]
        n_heads = 4
        [data]
        path = "{out}"
        [eval]
        at_end = false
    """)
    capsys.readouterr()
    assert main(["train", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "token id 40000" in err and str(out) in err


def test_info_reads_every_token_id_of_shards(tmp_path, texts, capsys):
    import numpy as np

    out = tmp_path / "sh"
    assert main(["data", "prepare", "--input", str(texts), "--out", str(out), "--domain", "a",
                 "--shard-tokens", "200", "--workers", "0", "--no-progress"]) == 0
    assert main(["data", "info", str(out)]) == 0
    assert "token ids: largest 257, inside the vocabulary of 258" in capsys.readouterr().out
    shard = sorted((out / "a").glob("shard_*.npy"))[1]
    tokens = np.load(shard)
    tokens[3] = 40000
    np.save(shard, tokens)
    assert main(["data", "info", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{shard}: token id 40000 (token 3)" in err and "kiln data prepare --domain" in err


def small_corpus(folder, docs: int = 13):
    """13 documents of about 300 characters: the default 2% eval share holds out one."""
    folder.mkdir()
    for i in range(docs):
        (folder / f"{i:02d}.txt").write_text(f"document {i}: " + "alpha beta gamma " * 18)
    return folder


def test_prepare_warns_when_the_eval_split_cannot_fill_a_batch(tmp_path, capsys):
    texts, out = small_corpus(tmp_path / "small"), tmp_path / "data"
    assert main(["data", "prepare", "--input", str(texts), "--out", str(out), "--workers", "0",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["splits"]["eval"]["docs"] == 1
    assert "kiln data: warning: the eval split has" in err and "(1 document)" in err
    assert "4 x 256 + 1 = 1,025 tokens (training.micro_batch x training.seq_len + 1)" in err
    assert "--eval-fraction 0.3" in err and "evaluation stops a run at start-up" in err
    assert main(["data", "prepare", "--input", str(texts), "--out", str(tmp_path / "d2"),
                 "--workers", "0", "--no-progress", "--eval-fraction", "0.4"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_train_stops_before_step_1_when_the_eval_split_cannot_fill_a_batch(tmp_path, capsys):
    texts, out = small_corpus(tmp_path / "small"), tmp_path / "data"
    assert main(["data", "prepare", "--input", str(texts), "--out", str(out), "--workers", "0",
                 "--no-progress"]) == 0
    capsys.readouterr()
    run = tmp_path / "run"
    from tests.conftest import CONFIGS

    argv = ["train", str(CONFIGS / "debug.toml"), f"--data.path={out}", "--training.steps=2",
            f"--run.folder={run}", "--model.dim=32", "--model.n_layers=1",
            "--model.attention.n_heads=4", "--training.global_batch=4"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "the eval split has" in captured.err and "--eval-fraction" in captured.err
    assert "step " not in captured.out and not run.exists()
    assert main([*argv, "--eval.at_end=false"]) == 0  # no evaluation, nothing to check


def test_prepare_knows_the_default_batch_plan_and_stays_light(tmp_path):
    """Without a RECIPE, prepare warns with the [training] defaults, which it keeps as constants
    so that it never imports torch (the recipe schema does)."""
    import subprocess
    import sys

    from kiln.recipes.commands.data import DEFAULT_TRAINING
    from kiln.recipes.config.schema import TrainingConfig
    from tests.conftest import REPO

    defaults = TrainingConfig()
    assert {k: getattr(defaults, k) for k in DEFAULT_TRAINING} == DEFAULT_TRAINING
    texts = small_corpus(tmp_path / "small")
    code = ("import sys\nfrom kiln.recipes.cli import main\n"
            f"assert main(['data', 'prepare', '--input', {str(texts)!r}, '--out', "
            f"{str(tmp_path / 'out')!r}, '--workers', '0', '--no-progress']) == 0\n"
            "assert 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warning: the eval split" in out.stderr


def test_a_damaged_shards_json_is_one_message(tmp_path, texts, capsys):
    out = tmp_path / "sh"
    assert main(["data", "prepare", "--input", str(texts), "--out", str(out), "--domain", "a",
                 "--workers", "0", "--no-progress"]) == 0
    for damage in (b"{not json", b"caf\xe9", b"{}"):
        (out / "a" / "shards.json").write_bytes(damage)
        capsys.readouterr()
        assert main(["data", "info", str(out / "a")]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"{out / 'a' / 'shards.json'}: " in err
        assert "kiln data prepare --domain" in err


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_says_rerun_and_the_rerun_continues(tmp_path, capsys):
    files = [write_jsonl(tmp_path / "in" / f"{i:02d}.jsonl", DOCS) for i in range(40)]
    out = tmp_path / "out"
    args = ["data", "prepare", "--input", *map(str, files), "--out", str(out), "--workers", "2",
            "--no-progress"]
    # `kiln data prepare` with the byte tokenizer slowed down (50 ms a batch), so the build is
    # still running when Ctrl-C comes: SIGINT to the whole process group, workers included.
    code = ("import sys, kiln.components.tokenizers.byte_tokenizer as b;"
            "from tests.components.tokenizers.slow_tokenizer import SlowByteTokenizer;"
            "b.ByteTokenizer = SlowByteTokenizer; from kiln.recipes.cli import main;"
            "sys.exit(main(sys.argv[1:]))")
    # SIGINT handled as in a terminal, even where this suite was started in the background
    # (`pytest &` in a script: SIGINT ignored, and that survives exec)
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, text=True,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_default_sigint)
    progress = tmp_path / ".out.partial" / "progress.json"
    try:
        while proc.poll() is None and not (
                progress.exists() and json.loads(progress.read_text())["docs"] >= 2 * len(DOCS)):
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stdout + stderr and not out.exists()
    assert stderr == "kiln data prepare: interrupted; rerun the same command to continue\n"
    assert main(args) == 0  # the same command (the plain byte tokenizer: the same ids)
    printed = capsys.readouterr().out
    assert "continuing the interrupted build" in printed and "resumed in" in printed
    layout = open_layout(out, ByteTokenizer())
    assert layout.meta["num_docs"] == len(DOCS) * len(files)
    assert len(layout.tokens) == sum(len(d.encode()) + 2 for d in DOCS) * len(files)


def test_ctrl_c_in_a_recipe_build_keeps_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    def interrupted(self, texts):
        raise KeyboardInterrupt

    monkeypatch.setattr(ByteTokenizer, "encode_batch", interrupted)
    out = tmp_path / "built"
    assert main(["data", "prepare", "--out", str(out), "--max-bytes", "3000"]) == 130
    assert capsys.readouterr().err == ("kiln data prepare: interrupted; nothing was kept; rerun "
                                       "the same command to build it\n")
    assert not out.exists() and not list(tmp_path.glob(".built.tmp-*"))


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path, texts, capsys):
    """Redirected into a log file, the output is the printed lines only (no bar frames)."""
    args = ["data", "prepare", "--input", str(texts), "--out", str(tmp_path / "d"),
            "--workers", "0"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err + captured.out  # tqdm's frames (warnings may be there)
    assert "prepare d:" not in captured.err
    assert captured.out.splitlines()[0].startswith("built in")


def test_mix_prints_each_source_per_stage_and_what_runs_out_first(tmp_path, texts, capsys):
    common = ["--training.steps=40", "--training.seq_len=16",
              "--data.sources.code.max_bytes=100000", "--data.sources.tests.max_bytes=100000",
              "--data.sources.docstrings.type=packed_documents",
              "--data.sources.docstrings.source=folder",
              f"--data.sources.docstrings.source_path={texts}",
              "--data.stages=[{step = 30, weights = {docstrings = 1}}]"]
    recipe = str(REPO / "train_configs" / "mixture_debug.toml")
    assert main(["data", "mix", recipe, *common]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "mixture: 3 sources, 2 stage(s); 40 steps x 8 sequences of 16 tokens"
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in out[2:-1]}
    assert rows[("0", "0-30", "code")][0] == "49.6%"  # 119 of the stage's 240 sequences
    assert rows[("1", "30-40", "docstrings")][:3] == ["100.0%", "80", "1,280"]
    assert rows[("run", "0-40", "tests")][1] == rows[("0", "0-30", "tests")][1]
    assert sum(int(v[1].replace(",", "")) for k, v in rows.items() if k[0] == "run") == 320
    assert out[-1].startswith("runs out first: docstrings, read ") and "(max_epochs 8)" in out[-1]
    # past its max_epochs the recipe is refused as training would refuse it
    assert main(["data", "mix", recipe, *common, "--data.max_epochs={docstrings = 1}"]) == 1
    assert "above data.max_epochs.docstrings = 1" in capsys.readouterr().err
    assert main(["data", "mix", str(REPO / "train_configs" / "debug.toml")]) == 2
    assert "reads a recipe with data.type = \"mixture\"" in capsys.readouterr().err
