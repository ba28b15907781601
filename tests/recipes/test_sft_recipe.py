"""``train_configs/sft_debug.toml`` at tiny sizes: the assistant-token loss falls, the loss is
the same for 1 and 4 micro-batches and for 1 and 2 processes (token weighting), a stopped or
killed run resumes to the same losses, and the run logs its trained tokens."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from kiln.components.errors import CheckpointError, RecipeError
from kiln.components.protocols import Hook
from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests import forked
from tests.checkpointing.test_exact_resume import Record
from tests.conftest import CONFIGS, REPO
from tests.parallelisms.tiny import free_port, rank_env
from tests.recipes.test_mixture_recipe import _KILLED, _metrics

TINY = [
    "--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
    "--model.ffn.hidden_dim=64", "--training.seq_len=96", "--training.global_batch=8",
    "--training.micro_batch=2", "--run.log_interval=1", "--run.progress_bar=false",
    "--run.tensorboard=false", "--eval.interval=4", "--eval.tokens=768",
    "--optimizer.lr=1e-2", "--checkpoint.interval=3", "--optimizer.schedule.warmup_steps=2",
    "--data.builtin_rows=400",
]


def _recipe(folder, steps=8, extra=()):
    return load_recipe(CONFIGS / "sft_debug.toml",
                       [*TINY, f"--training.steps={steps}", f"--run.folder={folder}", *extra])


def _run(folder, steps=8, signal_at=None, extra=()):
    rec = Record(signal_at)
    trainer = Trainer(_recipe(folder, steps, extra), hooks=[rec], out=io.StringIO())
    trainer.fit()
    return rec, trainer


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft") / "full"
    rec, trainer = _run(folder)
    return folder, rec, trainer


def test_the_loss_falls_and_each_step_logs_its_trained_tokens(full):
    folder, rec, trainer = full
    assert rec.losses[8] < 0.75 * rec.losses[1]
    rows = _metrics(folder)
    assert all(0 < rows[s]["trained_tokens"] < 8 * 96 for s in range(1, 9))
    assert "eval/loss" in rows[8]


def test_one_and_four_micro_batches_give_the_same_losses(full, tmp_path):
    _, ref, _ = full
    rec, _ = _run(tmp_path / "m8", extra=["--training.micro_batch=8"])
    assert rec.losses == pytest.approx(ref.losses, rel=1e-5)


def test_a_stopped_sft_run_resumes_to_the_same_losses(full, tmp_path):
    _, ref, _ = full
    first, trainer = _run(tmp_path / "cut", signal_at=3)
    assert trainer.stop_requested
    second, _ = _run(tmp_path / "cut")
    assert {**first.losses, **second.losses} == ref.losses


@pytest.mark.slow
def test_an_sft_run_killed_with_sigkill_resumes_to_the_same_losses(full, tmp_path):
    folder, ref, _ = full
    cut = tmp_path / "cut"
    done = forked.run([sys.executable, "-c", _KILLED, "5", str(CONFIGS / "sft_debug.toml"),
                       *TINY, "--training.steps=8", f"--run.folder={cut}"], REPO, timeout=300)
    assert done.returncode == -9 and max(_metrics(cut)) == 5, done.stderr[-3000:]
    _run(cut)
    assert {s: r["loss"] for s, r in _metrics(cut).items() if "loss" in r} == ref.losses


LORA = ["--adapter.rank=4", "--adapter.alpha=8", "--optimizer.lr=3e-2",
        "--adapter.allow_random_base=true"]


DORA = ["--adapter.type=dora", *LORA]


class Weights(Hook):
    """The model's parameters when training starts and when it ends."""

    def on_train_start(self, trainer):
        self.start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    def on_train_end(self, trainer):
        self.end = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_lora") / "full"
    rec, weights = Record(), Weights()
    Trainer(_recipe(folder, extra=LORA), hooks=[rec, weights], out=io.StringIO()).fit()
    return folder, rec, weights


def test_lora_trains_only_the_adapters(lora):
    _, rec, weights = lora
    changed = {n for n in weights.start if not torch.equal(weights.start[n], weights.end[n])}
    assert changed and all(".lora." in n for n in changed)
    assert {n for n in weights.start if n.endswith("lora.B")} <= changed
    assert rec.losses[8] < rec.losses[1]


def test_a_stopped_lora_run_resumes_to_the_same_losses(lora, tmp_path):
    _, ref, _ = lora
    first, _ = _run(tmp_path / "cut", signal_at=4, extra=LORA)
    second, _ = _run(tmp_path / "cut", extra=LORA)
    assert {**first.losses, **second.losses} == ref.losses


def test_lora_with_activation_checkpointing_gives_the_same_losses(lora, tmp_path):
    _, ref, _ = lora
    rec, _ = _run(tmp_path / "ac", extra=[*LORA, "--parallelism.activation_checkpoint=full"])
    assert rec.losses == ref.losses


@pytest.mark.slow
def test_lora_under_torch_compile_gives_the_same_losses(lora, tmp_path):
    _, ref, _ = lora
    # no evaluation or task scoring: they would compile the blocks again for no_grad and for
    # every decoding length (the losses compared are the training steps'). aot_eager: the
    # adapters must trace, forward and backward; inductor's kernels are test_compile's subject
    rec, _ = _run(tmp_path / "compiled", steps=3, extra=[*LORA, "--parallelism.compile=true",
                                                         "--parallelism.compile_backend=aot_eager",
                                                         "--eval.at_end=false",
                                                         "--evals.arith.at_end=false"])
    assert [rec.losses[s] for s in (1, 2, 3)] == pytest.approx(
        [ref.losses[s] for s in (1, 2, 3)], rel=1e-4)


@pytest.fixture(scope="module")
def base(full, tmp_path_factory):
    """The full fine-tune's last checkpoint as a Hugging Face folder: a base for LoRA."""
    from kiln.recipes.inference.saved_model import export_checkpoint

    folder = tmp_path_factory.mktemp("sft_base") / "hf"
    export_checkpoint(full[0] / "checkpoints" / "step_0000008", folder)
    return folder


def test_lora_from_init_from_checkpoints_the_adapters_and_resumes_exactly(base, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from kiln.recipes.inference.saved_model import export_checkpoint

    extra = [*LORA, f"--checkpoint.init_from={base}"]
    ref, _ = _run(tmp_path / "full", extra=extra)
    first, _ = _run(tmp_path / "cut", signal_at=4, extra=extra)
    second, resumed = _run(tmp_path / "cut", extra=extra)
    assert {**first.losses, **second.losses} == ref.losses
    assert f"the adapters' frozen base from {base} (" in resumed.out.getvalue()
    _run(tmp_path / "cut", steps=9, extra=[*LORA, f"--checkpoint.init_from={base}/"])  # same
    import shutil

    # the same base moved: the same weights, accepted; a base whose weights changed: refused
    # (it was the other way round: checked by place, a changed base resumed without a word)
    moved = shutil.copytree(base, tmp_path / "moved")
    _run(tmp_path / "cut", steps=10, extra=[*LORA, f"--checkpoint.init_from={moved}"])
    changed = shutil.copytree(base, tmp_path / "changed")
    _perturb(changed)
    with pytest.raises(CheckpointError, match="trained on other base weights than "
                       "checkpoint.init_from"):
        _run(tmp_path / "cut", steps=11, extra=[*LORA, f"--checkpoint.init_from={changed}"])
    _perturb(moved)  # the base step 10's adapters name, changed in place: export refuses too
    with pytest.raises(CheckpointError, match="trained on other base weights"):
        export_checkpoint(tmp_path / "cut" / "checkpoints" / "step_0000010", tmp_path / "x")
    ck = tmp_path / "full" / "checkpoints" / "step_0000008"
    saved = FileSystemReader(str(ck)).read_metadata().state_dict_metadata
    names = [k for k in saved if k.startswith("model.")]
    assert names and all(".lora." in n for n in names)  # the base is init_from's
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    export_checkpoint(ck, tmp_path / "merged")
    export_checkpoint(ck, tmp_path / "adapter", fmt="peft")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    ids = torch.randint(0, 258, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(base)
        adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(ids)
    torch.testing.assert_close(adapted.logits, merged.logits, rtol=1e-5, atol=1e-5)


def _perturb(folder) -> None:
    """Change one weight of a Hugging Face folder (its size stays)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + 0.01
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.slow
def test_a_lora_run_from_init_from_killed_with_sigkill_resumes_exactly(base, tmp_path):
    args = [*TINY, *LORA, f"--checkpoint.init_from={base}", "--training.steps=8"]
    ref, _ = _run(tmp_path / "full", extra=[*LORA, f"--checkpoint.init_from={base}"])
    cut = tmp_path / "cut"
    done = forked.run([sys.executable, "-c", _KILLED, "5", str(CONFIGS / "sft_debug.toml"),
                       *args, f"--run.folder={cut}"], REPO, timeout=300)
    assert done.returncode == -9 and max(_metrics(cut)) == 5, done.stderr[-3000:]
    _run(cut, extra=[*LORA, f"--checkpoint.init_from={base}"])
    assert {s: r["loss"] for s, r in _metrics(cut).items() if "loss" in r} == ref.losses


def _worker(rank: int, port: int, folder: str) -> None:
    from kiln.components import distributed

    rank_env(rank, 2, port)
    losses: dict = {}
    try:
        rec, _ = _run(f"{folder}/two", extra=["--parallelism.fsdp=on"])
        losses = {"full": rec.losses}
        rec, _ = _run(f"{folder}/lora", extra=[*LORA, "--parallelism.fsdp=on"])
        losses["lora"] = rec.losses
        rec, _ = _run(f"{folder}/dora", extra=[*DORA, "--parallelism.fsdp=on"])
        losses["dora"] = rec.losses
    finally:
        with open(f"{folder}/rank{rank}.json", "w") as f:
            json.dump(losses, f)
        distributed.shutdown(together=sys.exc_info()[0] is None)


@pytest.mark.slow
def test_two_processes_give_the_one_process_losses(full, lora, tmp_path):
    """Full fine-tuning, LoRA and DoRA under FSDP2 on 2 processes: the 1-process losses (DoRA's
    row norms run on sharded weights)."""
    dora, _ = _run(tmp_path / "dora1", extra=DORA)
    forked.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    for key, ref in (("full", full[1]), ("lora", lora[1]), ("dora", dora)):
        assert [ranks[0][key][str(s)] for s in range(1, 9)] == pytest.approx(
            [ref.losses[s] for s in range(1, 9)], rel=1e-5), key


def test_masked_data_with_a_step_that_cannot_weight_tokens_is_refused(tmp_path):
    recipe = load_recipe(CONFIGS / "looped_moe_debug.toml", [
        "--data.type=chat", "--data.template=chatml", "--data.builtin_rows=400",
        "--training.seq_len=96", f"--run.folder={tmp_path / 'x'}"])
    with pytest.raises(RecipeError, match="token-weighted.*segmented_bptt"):
        Trainer(recipe, out=io.StringIO())


@pytest.mark.parametrize("extra, noted", [
    (("--model.attention.document_mask=false", "--model.attention.positions=sequence"), True),
    (("--model.attention.document_mask=false", "--model.attention.positions=sequence",
      "--data.pack=false"), False),  # one conversation a row: nothing to see across
    ((), False),  # sft_debug's document mask
])
def test_packed_conversations_without_a_document_mask_are_noted(tmp_path, capsys, extra, noted):
    """Train and validate alike: each conversation of a packed row would see those before it."""
    args = [*TINY, f"--run.folder={tmp_path / 'x'}", *extra]
    out = io.StringIO()
    Trainer(load_recipe(CONFIGS / "sft_debug.toml", args), out=out)
    assert main(["validate", str(CONFIGS / "sft_debug.toml"), *args]) == 0
    for log in (out.getvalue(), capsys.readouterr().out):
        assert ("chat data: note: data.pack = true puts several conversations in a row and, "
                "without model.attention.document_mask, each attends to those before it"
                in log) is noted


def test_the_run_and_its_export_keep_the_chat_template(full, base):
    transformers = pytest.importorskip("transformers")
    from kiln.components.tokenizers.chat_templates import CHATML, TEMPLATE_FILE

    folder = full[0]
    assert (folder / TEMPLATE_FILE).read_text() == CHATML
    assert (base / TEMPLATE_FILE).read_text() == CHATML
    tok = transformers.AutoTokenizer.from_pretrained(base)
    conv = [{"role": "user", "content": "What is 2 plus 3?"}]
    assert tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"


def test_generate_chat_answers_with_the_template_and_stops_at_the_end_of_turn(full, capsys):
    from kiln.recipes.cli import main

    assert main(["generate", str(full[0]), "--chat", "--prompt", "What is 2 plus 3?",
                 "--prompt", "What is 4 times 5?", "--temperature", "0",
                 "--max-new-tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant: ") == 2 and "<|im_end|>" not in out and "<|im_start|>" not in out
