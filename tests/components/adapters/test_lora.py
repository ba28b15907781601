"""LoRA: the same forward as peft's on the exported model, merged weights equal to the adapter
model, a peft-loadable adapter folder, frozen base weights."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.checkpointing.manager import CheckpointManager
from kiln.components.adapters.lora import LoRA, LoRAConfig, merge
from kiln.components.distributed import World
from kiln.components.errors import CheckpointError, RecipeError
from kiln.components.models.block import padded_vocab
from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe, render_recipe
from kiln.recipes.inference.saved_model import export_checkpoint
from tests.checkpointing.toy import ToyState
from tests.conftest import CONFIGS

TINY = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.attention.n_kv_heads=2", "--model.ffn.hidden_dim=48",
        "--training.seq_len=16", "--model.tie_embeddings=false"]
ADAPTER = ["--adapter.rank=4", "--adapter.alpha=12",
           '--adapter.targets=["*.attention.wq", "*.attention.wk", "*.attention.wv", '
           '"*.attention.wo", "*.feed_forward.w2"]']


def _save(folder, model, recipe):
    state = ToyState(model=model, optimizers={"main": torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad])}, recipe_toml=render_recipe(recipe))
    state.train_loader = None
    state.progress.step = 1
    CheckpointManager(folder, World(0, 1, 0, torch.device("cpu")), log=lambda s: None).save(state)
    return folder / "step_0000001"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(base checkpoint, LoRA checkpoint, the kiln model with adapters) of one base model; the
    adapters' B is random, so they change the function."""
    root = tmp_path_factory.mktemp("lora")
    base_recipe = load_recipe(CONFIGS / "debug.toml", TINY)
    torch.manual_seed(0)
    model = base_recipe.model.build(vocab_size=padded_vocab(base_recipe.model, 258), seq_len=16)
    base = _save(root / "base", model, base_recipe)
    export_checkpoint(base, root / "hf")
    recipe = load_recipe(CONFIGS / "debug.toml",
                         [*TINY, *ADAPTER, f"--checkpoint.init_from={root / 'hf'}"])
    recipe.adapter.build().apply(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora.B"):
                p.copy_(torch.randn_like(p) * 0.2)
    return base, _save(root / "lora", model, recipe), model


def _ids():
    return torch.randint(0, 258, (2, 12), generator=torch.Generator().manual_seed(1))


def _kiln_logits(model):
    model.eval()
    with torch.no_grad():
        return model(_ids())


def test_only_the_adapters_train_and_b_starts_at_zero():
    recipe = load_recipe(CONFIGS / "debug.toml", TINY)
    model = recipe.model.build(vocab_size=264, seq_len=16)
    before = _kiln_logits(model)
    line = LoRA(LoRAConfig(type="lora", rank=2)).apply(model)
    assert "lora rank 2" in line and "on 8 layers" in line
    assert torch.equal(_kiln_logits(model), before)  # B = 0: the base model exactly
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora." in n for n in trainable)


def test_targets_that_match_nothing_name_the_layers():
    model = load_recipe(CONFIGS / "debug.toml", TINY).model.build(vocab_size=264, seq_len=16)
    with pytest.raises(RecipeError, match=r"matches no linear layer.*layers\.N\.attention\.wq"):
        LoRA(LoRAConfig(type="lora", targets=["*.q_proj"])).targets(model)


def test_a_glob_that_matches_nothing_is_refused_by_name_beside_one_that_matches():
    model = load_recipe(CONFIGS / "debug.toml", TINY).model.build(vocab_size=264, seq_len=16)
    with pytest.raises(RecipeError, match=r"'\*\.q_proj' matches no linear layer") as err:
        LoRA(LoRAConfig(type="lora", targets=["*.attention.wq", "*.q_proj"])).targets(model)
    assert "attention.wq'" not in str(err.value)


def test_an_adapter_on_a_tied_output_is_refused():
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, "--model.tie_embeddings=true"])
    model = recipe.model.build(vocab_size=264, seq_len=16)
    with pytest.raises(RecipeError, match=r"output shares its weight with tok_embeddings"):
        LoRA(LoRAConfig(type="lora", targets=["output"])).targets(model)


def test_a_random_base_is_refused_unless_allowed():
    with pytest.raises(RecipeError, match="allow_random_base = true"):
        LoRA(LoRAConfig(type="lora")).check_base("")
    LoRA(LoRAConfig(type="lora", allow_random_base=True)).check_base("")
    LoRA(LoRAConfig(type="lora")).check_base("runs/base")


def _output_adapter_model(targets, dropout=0.0, family="dense"):
    from tests.recipes.test_combinations import FAMILIES

    file, overrides = FAMILIES[family]
    recipe = load_recipe(CONFIGS / file, [*overrides, "--training.seq_len=16",
                                          "--model.tie_embeddings=false"])
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=264, seq_len=16)
    LoRA(LoRAConfig(type="lora", rank=4, alpha=8, dropout=dropout, targets=targets)).apply(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora.B"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def _grads(model, loss_of):
    model.zero_grad()
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.requires_grad}


def assert_chunked_head_equals_plain(model, chunk: int = 5) -> dict[str, torch.Tensor]:
    """The chunked loss (``LossHead``) and every trainable gradient equal the unchunked head's,
    from the same seed (a looped model draws its loop count, dropout its masks); the chunked
    gradients."""
    from kiln.components.models.lm_head import LossHead

    ids = _ids()
    x, y = ids[:, :-1], ids[:, 1:]
    torch.manual_seed(5)
    plain = _grads(model, lambda m: torch.nn.functional.cross_entropy(
        m(x).flatten(0, 1).float(), y.flatten()))
    torch.manual_seed(5)
    chunked = _grads(model, lambda m: m(x, head=LossHead(y, chunk)))
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=1e-6)
    for name, g in plain[1].items():
        torch.testing.assert_close(chunked[1][name], g, rtol=1e-5, atol=1e-6)
    return chunked[1]


@pytest.mark.parametrize("family, targets", [
    ("dense", ["output"]), ("dense", ["output", "*.attention.wq", "*.feed_forward.w2"]),
    ("moe", ["output", "*.attention.wo"]), ("diff_layerscale", ["output"]),
    ("looped_moe", ["output", "*.attention.wk"]),
    ("qwen3_next", ["output", "*.attention.wz", "*.feed_forward.shared_gate"])])
def test_the_chunked_loss_trains_an_adapter_on_the_output(family, targets):
    """The adapter on ``output`` gets the gradient of the unchunked loss (it got none)."""
    grads = assert_chunked_head_equals_plain(_output_adapter_model(targets, family=family))
    assert {"output.lora.A", "output.lora.B"} <= set(grads)
    assert grads["output.lora.A"].abs().sum() > 0


def test_with_dropout_the_chunked_output_adapter_equals_the_unchunked_one():
    """Dropout's mask is drawn once per forward on either path: the same seed, the same grads."""
    model = _output_adapter_model(["output"], dropout=0.3)
    model.train()
    assert_chunked_head_equals_plain(model, chunk=4)


def test_output_adapter_gradients_equal_peft(tmp_path):
    """LoRA on the output and on wq: kiln's chunked loss and its gradients equal peft's on the
    exported base with the exported adapter."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from kiln.components.models.lm_head import LossHead

    base_recipe = load_recipe(CONFIGS / "debug.toml", TINY)
    torch.manual_seed(0)
    model = base_recipe.model.build(vocab_size=padded_vocab(base_recipe.model, 258), seq_len=16)
    export_checkpoint(_save(tmp_path / "base", model, base_recipe), tmp_path / "hf")
    recipe = load_recipe(CONFIGS / "debug.toml", [
        *TINY, "--adapter.rank=4", "--adapter.alpha=8", f"--checkpoint.init_from={tmp_path / 'hf'}",
        '--adapter.targets=["output", "*.attention.wv"]'])
    recipe.adapter.build().apply(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora.B"):
                p.copy_(torch.randn_like(p) * 0.1)
    lora = _save(tmp_path / "lora", model, recipe)
    assert main(["export", str(lora), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    theirs_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    ids = _ids()
    theirs_loss = theirs_model(input_ids=ids, labels=ids).loss
    theirs_loss.backward()
    theirs = {n: p.grad for n, p in theirs_model.named_parameters() if p.requires_grad}
    ours_loss, ours = _grads(model, lambda m: m(ids[:, :-1], head=LossHead(ids[:, 1:], 5)))
    torch.testing.assert_close(ours_loss, theirs_loss.detach(), rtol=1e-5, atol=1e-6)
    for kiln_name, peft_name in [("output.lora.A", "lm_head.lora_A.default.weight"),
                                 ("output.lora.B", "lm_head.lora_B.default.weight"),
                                 ("layers.1.attention.wv.lora.A",
                                  "model.layers.1.self_attn.v_proj.lora_A.default.weight")]:
        got = next(g for n, g in theirs.items() if n.endswith(peft_name))
        assert got.abs().sum() > 0
        torch.testing.assert_close(ours[kiln_name], got, rtol=1e-4, atol=1e-6)


def test_peft_on_the_exported_base_equals_the_kiln_adapter_model(saved, tmp_path):
    base, lora, model = saved
    export_checkpoint(base, tmp_path / "base")
    assert main(["export", str(lora), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 12
    assert_peft_equals_kiln(tmp_path / "base", tmp_path / "adapter", model)


def assert_peft_equals_kiln(hf_base, adapter, model) -> None:
    """peft's logits on the Hugging Face base with the exported adapter equal the kiln model's,
    and differ from the base's (so the check can fail)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    with torch.no_grad():
        plain = hf(_ids()).logits
    with_adapter = peft.PeftModel.from_pretrained(hf, adapter).eval()
    with torch.no_grad():
        theirs = with_adapter(_ids()).logits
    ours = _kiln_logits(model)
    assert (ours - plain).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_the_merged_export_equals_the_adapter_model(saved, tmp_path):
    transformers = pytest.importorskip("transformers")
    _, lora, model = saved
    summary = export_checkpoint(lora, tmp_path / "merged")
    assert summary["layout"] == "hf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(_ids()).logits
    torch.testing.assert_close(theirs, _kiln_logits(model), rtol=1e-5, atol=1e-5)


def test_merge_keeps_the_function_and_removes_the_adapters(saved):
    _, _, model = saved
    import copy

    twin = copy.deepcopy(model)
    want = _kiln_logits(twin)
    assert merge(twin) == 10
    assert not any(".lora." in n for n, _ in twin.named_parameters())
    torch.testing.assert_close(_kiln_logits(twin), want, rtol=1e-5, atol=1e-6)


def test_a_peft_export_on_a_kiln_base_says_how_to_load_it(saved, tmp_path, capsys):
    """The adapter's base_model_name_or_path is init_from; a kiln checkpoint there is not a
    folder transformers loads, and the export says what to do (which then works)."""
    base, lora, model = saved
    recipe = load_recipe(lora, [f"--checkpoint.init_from={base}"])
    folder = _save(tmp_path / "on_kiln", model, recipe)
    assert main(["export", str(folder), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    assert f"note: the base, {base}, is a kiln checkpoint, which transformers cannot load: " \
        f"export it (kiln export {base} BASE_DIR)" in capsys.readouterr().out
    assert main(["export", str(base), str(tmp_path / "base_dir")]) == 0
    assert_peft_equals_kiln(tmp_path / "base_dir", tmp_path / "adapter", model)
    assert "base_note" not in export_checkpoint(lora, tmp_path / "on_hf", fmt="peft")


def test_peft_export_of_adapters_on_a_random_base_is_refused(saved, tmp_path):
    _, lora, model = saved
    recipe = load_recipe(lora, ['--checkpoint.init_from=""', "--adapter.allow_random_base=true"])
    folder = _save(tmp_path / "random", model, recipe)
    with pytest.raises(RecipeError, match="would name no base"):
        export_checkpoint(folder, tmp_path / "x", fmt="peft")
    assert export_checkpoint(folder, tmp_path / "merged")["layout"] == "hf"


def test_peft_export_of_a_full_fine_tune_is_refused(saved, tmp_path):
    base, _, _ = saved
    with pytest.raises(RecipeError, match="--format peft needs a run with an \\[adapter\\]"):
        export_checkpoint(base, tmp_path / "x", fmt="peft")
    with pytest.raises(CheckpointError, match="has adapters"):
        from kiln.checkpointing.huggingface.export import export

        export(saved[2], None, tmp_path / "y", model_table={}, recipe_file=None)


@pytest.mark.parametrize("fmt", [[], ["--format", "peft"]], ids=["merged", "peft"])
def test_a_full_disk_during_export_is_one_line(saved, tmp_path, capsys, monkeypatch, fmt):
    """safetensors reports a failed write as SafetensorError, not OSError: it was a traceback."""
    from safetensors import SafetensorError

    import kiln.checkpointing.storage as storage

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(storage, "save_file", full)
    _, lora, _ = saved
    assert main(["export", str(lora), str(tmp_path / "out"), *fmt]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kiln export: error: ") and "No space left on device" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))  # the temporary folder is gone too
