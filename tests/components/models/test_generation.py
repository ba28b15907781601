"""Generation: KV cache == no cache == transformers' greedy generate; sampling options; EOS;
batches of unequal prompts; `kiln generate` on a checkpoint (streamed, batched, looped)."""

from __future__ import annotations

import pytest
import torch

from kiln.components.models.generation import Sampling, generate, sample
from kiln.recipes.cli import main
from kiln.recipes.loading.checkpoint_model import load_model
from tests.checkpointing.huggingface.hf_tiny import LLAMA3, kiln_from_hf, save_tiny
from tests.checkpointing.huggingface.test_export import TINY, checkpoint

GREEDY = Sampling(temperature=0)


def test_greedy_equals_transformers_and_the_uncached_path(tmp_path):
    hf = save_tiny(tmp_path / "hf", "llama", rope_parameters=LLAMA3)
    model = kiln_from_hf(tmp_path / "hf", 64)
    prompt = [256, 5, 17, 33, 2, 9]
    cached = generate(model, [prompt], max_new_tokens=24, sampling=GREEDY)[0]
    plain = generate(model, [prompt], max_new_tokens=24, sampling=GREEDY, use_cache=False)[0]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert cached == plain == want


def test_batch_of_unequal_prompts_equals_each_alone(tmp_path):
    save_tiny(tmp_path / "hf", "qwen3")
    model = kiln_from_hf(tmp_path / "hf", 64)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [4, 4, 4]]
    for sampling in (GREEDY, Sampling(temperature=1.0, seed=5)):
        batched = generate(model, prompts, max_new_tokens=10, sampling=sampling)
        assert len(batched) == 3 and all(len(b) == 10 for b in batched)
    batched = generate(model, prompts, max_new_tokens=10, sampling=GREEDY)
    assert batched == [generate(model, [p], max_new_tokens=10, sampling=GREEDY,
                                use_cache=False)[0] for p in prompts]


def test_eos_ends_a_row_and_the_callback_sees_live_rows(tmp_path):
    save_tiny(tmp_path / "hf", "llama")
    model = kiln_from_hf(tmp_path / "hf", 64)
    free = generate(model, [[3, 4], [5, 6, 7]], max_new_tokens=8, sampling=GREEDY)
    eos = free[0][2]
    seen = []
    out = generate(model, [[3, 4], [5, 6, 7]], max_new_tokens=8, sampling=GREEDY, eos_id=eos,
                   on_tokens=lambda t, live: seen.append((t.tolist(), live.tolist())))
    assert out[0] == free[0][:free[0].index(eos) + 1]  # stops after EOS, which it keeps
    stop = free[1].index(eos) + 1 if eos in free[1] else 8
    assert out[1] == free[1][:stop]
    assert [live for _, live in seen][len(out[0])] == [False, len(out[1]) > len(out[0])]


def test_sampling_options():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(400, 4)
    g = torch.Generator().manual_seed(0)
    assert set(sample(logits, Sampling(1.0, top_k=2), g).tolist()) == {0, 1}
    assert set(sample(logits, Sampling(1.0, top_p=0.7), g).tolist()) == {0, 1}
    assert set(sample(logits, Sampling(1.0, top_p=0.81), g).tolist()) == {0, 1, 2}
    assert set(sample(logits, Sampling(1.0, top_k=1), g).tolist()) == {0}
    assert set(sample(logits, Sampling(1.0), g).tolist()) == {0, 1, 2, 3}
    cold = sample(logits, Sampling(0.05), g)
    assert (cold == 0).float().mean() > 0.99
    a = sample(logits, Sampling(1.0), torch.Generator().manual_seed(3))
    b = sample(logits, Sampling(1.0), torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        Sampling(top_p=0.0)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.7, 0, 0.9), (1.3, 5, 1.0), (1.0, 8, 0.5), (0.5, 3, 0.95), (1.0, 0, 0.3), (2.0, 40, 0.99)])
def test_the_filtered_distribution_equals_transformers_warpers(temperature, top_k, top_p):
    """The tokens kiln samples from, and their probabilities, are those of transformers'
    temperature, top-k and top-p warpers in transformers' order (repeated logits included:
    ties at the k-th value are kept on both sides)."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    from kiln.components.models.generation import filtered

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    logits[0, :10] = logits[0, 0]  # ties
    warpers = [lp.TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(lp.TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(lp.TopPLogitsWarper(top_p))
    theirs = logits.clone()
    for w in warpers:
        theirs = w(None, theirs)
    ours = filtered(logits, Sampling(temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))


def test_kiln_generate_streams_one_prompt_and_batches_several(tmp_path, capsys):
    folder, _ = checkpoint(tmp_path)
    _, tokenizer, model = load_model(folder, min_seq_len=40)
    ids = tokenizer.encode("def ", bos=True, eos=False)
    want = generate(model, [ids], max_new_tokens=6, sampling=Sampling(0.8, seed=1),
                    eos_id=tokenizer.eos_id, vocab_size=tokenizer.vocab_size)[0]
    assert main(["generate", str(folder.parent), "--prompt", "def ", "--max-new-tokens", "6",
                 "--seed", "1"]) == 0
    assert capsys.readouterr().out == "def " + tokenizer.decode(want) + "\n"
    assert main(["generate", str(folder), "--prompt", "a", "--prompt", "import os",
                 "--max-new-tokens", "3", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "--- [0] ---\na" in out and "--- [1] ---\nimport os" in out
    # past the trained context (16 tokens): a note, and the RoPE table grows to fit
    assert main(["generate", str(folder), "--prompt", "x", "--max-new-tokens", "30"]) == 0
    assert "past the trained context" in capsys.readouterr().err
    assert main(["generate", str(folder), "--prompt", "x", "--loops", "2"]) == 2
    assert "only looped models take --loops" in capsys.readouterr().err


def test_sampling_stays_inside_the_tokenizers_vocabulary(tmp_path):
    folder, _ = checkpoint(tmp_path)
    _, tokenizer, model = load_model(folder)
    assert model.vocab_size == 320 > tokenizer.vocab_size == 258  # padded to vocab_multiple
    with torch.no_grad():
        model.output.weight[258:] += 100.0  # the padding rows would win every draw
    hot = Sampling(temperature=5.0, seed=0)
    assert max(generate(model, [[256, 1]], max_new_tokens=10, sampling=hot)[0]) >= 258
    for use_cache in (True, False):
        out = generate(model, [[256, 1], [3]], max_new_tokens=10, sampling=hot,
                       vocab_size=tokenizer.vocab_size, use_cache=use_cache)
        assert max(max(row) for row in out) < 258


def test_the_head_runs_on_the_last_position_and_the_samplers_rows_only(tmp_path):
    """``last_logits``: the whole logits' last position, cut to the vocabulary, with the head
    hook multiplying one position by those rows (a model without the hook: the whole logits);
    a soft cap and an output adapter as the whole head has them."""
    from kiln.components.models import generation
    from tests.components.adapters.test_lora import _output_adapter_model

    model = _output_adapter_model(["output"]).eval()
    model.logit_softcap = 5.0
    ids = torch.randint(0, 264, (3, 9), generator=torch.Generator().manual_seed(0))
    shapes = []
    model.output.register_forward_hook(lambda m, args, out: shapes.append(args[0].shape))
    with torch.no_grad():
        whole = model(ids)[:, -1, :200]
        assert shapes.pop() == (3, 9, 32)
        got = generation.last_logits(model, ids, 200)
    assert shapes == []  # the hook multiplies (3, D) by 200 rows, not the output module
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)

    class NoHook(torch.nn.Module):
        def forward(self, ids):
            return torch.arange(2 * 4 * 6.0).view(2, 4, 6)

    assert torch.equal(generation.last_logits(NoHook(), ids, 5),
                       torch.arange(48.0).view(2, 4, 6)[:, -1, :5])


def test_looped_cache_equals_no_cache_at_each_loop_count(tmp_path):
    """--loops h: the cached path (one cache slot per loop) gives the uncached tokens for an
    early exit and the full loop count (every family's default: test_combinations)."""
    tiny = [a for a in TINY if "n_layers" not in a]
    folder, _ = checkpoint(tmp_path, "--model.type=looped", "--model.loops=3",
                           "--model.attention.type=differential", tiny=tiny)
    _, _, model = load_model(folder, min_seq_len=32)
    prompts = [[256, 5, 9, 100, 7], [256, 40]]
    for loops in (1, 3):
        cached = generate(model, prompts, max_new_tokens=8, sampling=GREEDY, loops=loops)
        plain = generate(model, prompts, max_new_tokens=8, sampling=GREEDY, loops=loops,
                         use_cache=False)
        assert cached == plain, loops


def test_kiln_generate_on_a_looped_model(tmp_path, capsys):
    tiny = [a for a in TINY if "n_layers" not in a]
    folder, _ = checkpoint(tmp_path, "--model.type=looped", "--model.loops=3",
                           "--model.attention.type=differential", tiny=tiny)
    for loops in ("1", "3"):
        assert main(["generate", str(folder), "--prompt", "def ", "--max-new-tokens", "4",
                     "--loops", loops, "--temperature", "0"]) == 0
        assert capsys.readouterr().out.startswith("def ")
    assert main(["generate", str(folder), "--prompt", "x", "--loops", "4"]) == 2
    assert "use 1..3" in capsys.readouterr().err


def metaspace_tokenizer(folder) -> str:
    """A SentencePiece-style (Metaspace) tokenizer.json of 258 ids, as Llama 2 / Mistral decode:
    a word's token carries its leading space as '▁', and the decoder drops it on the first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["▁a", "▁1", *(f"▁w{i}" for i in range(253))]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_kiln_generate_keeps_the_space_a_metaspace_decoder_strips(tmp_path, capsys, monkeypatch):
    """Decoding only the new ids drops the first one's leading space ('a1 1 1'): the text shown
    is decode(prompt + new) minus decode(prompt), streamed or batched."""
    import kiln.components.models.generation as gen

    path = metaspace_tokenizer(tmp_path / "tok")
    folder, _ = checkpoint(tmp_path, "--tokenizer.type=huggingface", f"--tokenizer.path={path}")
    one = load_model(folder)[1].token_to_id("▁1")

    def three_ones(model, prompts, *, on_tokens=None, **kwargs):
        for _ in range(3):
            if on_tokens is not None:
                on_tokens(torch.full((len(prompts),), one), torch.ones(len(prompts), dtype=bool))
        return [[one] * 3 for _ in prompts]

    monkeypatch.setattr(gen, "generate", three_ones)
    assert main(["generate", str(folder), "--prompt", "a"]) == 0
    assert capsys.readouterr().out == "a 1 1 1\n"
    assert main(["generate", str(folder), "--prompt", "a", "--prompt", "a a"]) == 0
    out = capsys.readouterr().out
    assert "--- [0] ---\na 1 1 1\n" in out and "--- [1] ---\na a 1 1 1\n" in out


def test_a_prompts_file_that_is_not_utf8_is_one_message(tmp_path, capsys):
    (tmp_path / "p.txt").write_bytes(b"caf\xe9\n")
    assert main(["generate", str(tmp_path), "--prompts-file", str(tmp_path / "p.txt")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "p.txt: byte 3 is not UTF-8" in err


def test_row_seeds_make_each_row_independent_of_its_batch(tmp_path):
    """RL rollouts: a row's sampled tokens depend on its own seed only, not on the rows that
    share its batch (1 or 2 processes, a resume); temperature 0 is greedy."""
    save_tiny(tmp_path / "hf", "qwen3")
    model = kiln_from_hf(tmp_path / "hf", 64)
    prompts, seeds = [[1, 2, 3, 4, 5], [9], [4, 4, 4]], [11, 12, 13]
    warm = Sampling(temperature=1.0, top_p=0.9)
    together = generate(model, prompts, max_new_tokens=12, sampling=warm, row_seeds=seeds)
    alone = [generate(model, [p], max_new_tokens=12, sampling=warm, row_seeds=[s])[0]
             for p, s in zip(prompts, seeds, strict=True)]
    assert together == alone
    other = generate(model, prompts, max_new_tokens=12, sampling=warm, row_seeds=[1, 2, 3])
    assert other != together
    greedy = generate(model, prompts, max_new_tokens=12, sampling=GREEDY)
    assert generate(model, prompts, max_new_tokens=12, sampling=GREEDY, row_seeds=seeds) == greedy


def test_a_repeated_prompt_is_run_once_and_gives_each_row_what_it_gives_alone(tmp_path):
    """An RL group repeats its prompt: the prompt's forward runs once for all its rows (fewer
    rows in the first forward, counted) and every row continues as it would alone."""
    save_tiny(tmp_path / "hf", "qwen3")
    model = kiln_from_hf(tmp_path / "hf", 64)
    prompts = [[1, 2, 3, 4, 5], [9], [1, 2, 3, 4, 5], [9], [1, 2, 3, 4, 5]]
    seeds = [3, 4, 5, 6, 7]
    rows = []
    hook = model.blocks()[0].register_forward_hook(lambda m, a, out: rows.append(a[0].shape[0]))
    warm = Sampling(temperature=1.0)
    together = generate(model, prompts, max_new_tokens=6, sampling=warm, row_seeds=seeds)
    hook.remove()
    assert rows[0] == 2 and set(rows[1:]) == {5}  # two distinct prompts, then five rows
    alone = [generate(model, [p], max_new_tokens=6, sampling=warm, row_seeds=[s])[0]
             for p, s in zip(prompts, seeds, strict=True)]
    assert together == alone
    greedy = generate(model, prompts, max_new_tokens=6, sampling=GREEDY)
    assert greedy[0] == greedy[2] == greedy[4] and greedy[1] == greedy[3]


def test_the_reported_log_probabilities_are_the_forwards(tmp_path):
    """``stats``: each sampled token's log-probability under the tempered distribution and its
    entropy; the same as a forward over the whole sequence (<= 1e-5, fp32)."""
    from kiln.components.models.token_logprobs import label_logprobs

    save_tiny(tmp_path / "hf", "llama")
    model = kiln_from_hf(tmp_path / "hf", 64)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [4, 4, 4]]
    stats: list = []
    out = generate(model, prompts, max_new_tokens=10, sampling=Sampling(temperature=0.7),
                   row_seeds=[1, 2, 3], stats=stats)
    for p, new, row in zip(prompts, out, stats, strict=True):
        seq = torch.tensor([p + new])
        with torch.no_grad():
            z = model(seq[:, :-1]).float() / 0.7
        want = label_logprobs(z, seq[:, 1:])[0, len(p) - 1:]
        torch.testing.assert_close(torch.tensor([lp for lp, _ in row]), want, atol=1e-5,
                                   rtol=0)
        logp = z[0, len(p) - 1:].log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        torch.testing.assert_close(torch.tensor([h for _, h in row]), entropy, atol=1e-5,
                                   rtol=0)
