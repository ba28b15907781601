"""The combination matrix's families (``test_combinations``) off the training path: each
generates the same with and without the KV cache, samples the same from an RL group's prompt
kept once in the cache, and, where it has a Hugging Face layout, round-trips through it."""

from __future__ import annotations

import pytest
import torch

from tests.recipes.test_combinations import discovered, recipe_for


def _family_model(family: str, seed: int = 0):
    """The family's tiny model for the byte tokenizer (random weights, eval mode)."""
    from kiln.components.models.block import padded_vocab

    recipe = recipe_for(family, "unused")
    torch.manual_seed(seed)
    return recipe.model.build(vocab_size=padded_vocab(recipe.model, 258), seq_len=32).eval()


@pytest.mark.parametrize("family", list(discovered()))
def test_every_family_generates_the_same_with_and_without_the_kv_cache(family):
    """`kiln generate`'s two paths agree token for token (greedy, a batch of two prompts):
    every attention has a cache (or falls back to recomputing), looped cores get one slot per
    loop, MoE routes one new token as it routes it inside the whole sequence."""
    from kiln.components.attention import kv_cache
    from kiln.components.models.generation import Sampling, generate

    model = _family_model(family)
    assert kv_cache.supports_cache(model), f"{family}: no KV cache, generation recomputes"
    prompts = [[256, 5, 17, 33], [256, 2, 9, 9]]
    greedy = Sampling(temperature=0)
    cached = generate(model, prompts, max_new_tokens=6, sampling=greedy, vocab_size=258)
    plain = generate(model, prompts, max_new_tokens=6, sampling=greedy, vocab_size=258,
                     use_cache=False)
    assert cached == plain


@pytest.mark.parametrize("family", list(discovered()))
def test_every_family_samples_the_same_from_a_shared_prompt(family, monkeypatch):
    """An RL group's prompt kept once in the cache (``CacheSession.share``, forced here at any
    length) samples the tokens copied cache rows sample, with the same log-probabilities:
    windows, sinks, latent and differential attention, Gated DeltaNet states, looped cores."""
    from kiln.components.attention import kv_cache
    from kiln.components.models.generation import Sampling, generate

    model = _family_model(family)
    shared = []
    share = kv_cache.CacheSession.share
    monkeypatch.setattr(kv_cache.CacheSession, "share",
                        lambda self, rows: shared.append(share(self, rows)) or shared[-1])
    prompts = [[256, 5, 17, 33, 4, 8]] * 3 + [[256, 2, 9]] * 3  # left-padded groups of 3
    runs = []
    for threshold in (1, 1 << 30):
        monkeypatch.setattr(kv_cache, "SHARE_MIN_PREFIX", threshold)
        stats: list = []
        runs.append((generate(model, prompts, max_new_tokens=6, sampling=Sampling(1.0),
                              vocab_size=258, row_seeds=list(range(6)), stats=stats), stats))
    assert shared == [True, False]
    (ids, stats), (ids_copied, stats_copied) = runs
    assert ids == ids_copied
    torch.testing.assert_close(torch.tensor(stats), torch.tensor(stats_copied), rtol=0,
                               atol=1e-5)


@pytest.mark.parametrize("family", list(discovered()))
def test_every_family_with_a_hugging_face_layout_round_trips(tmp_path, family):
    """export -> import (``checkpoint.init_from``'s loader) gives the same tensors, bit for bit,
    for every family that has a Hugging Face layout (multi-token prediction modules excepted: the
    layout drops them); the others say why they have none."""
    from kiln.checkpointing.huggingface import export
    from kiln.checkpointing.huggingface import importer as hf_import
    from kiln.checkpointing.huggingface.layout import hf_incompatibility

    model = _family_model(family)
    if hf_incompatibility(model):
        pytest.skip(f"{family}: no Hugging Face layout ({hf_incompatibility(model)})")
    export.export(model, None, tmp_path / "hf", model_table={}, recipe_file=None,
                  max_shard_size="40KB")
    fresh = _family_model(family, seed=1)
    hf_import.load_weights(fresh, tmp_path / "hf", hf_import.read_config(tmp_path / "hf"))
    want, got = model.state_dict(), fresh.state_dict()
    assert want.keys() == got.keys()
    # multi-token prediction modules have no Hugging Face tensors: they keep their init
    assert all(torch.equal(want[k], got[k]) for k in want if not k.startswith("mtp."))
