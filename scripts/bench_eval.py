"""Multiple-choice scoring speed, side by side: kiln's in-loop path (task plan + ``Scorer``: each
context once, its choices after it through the KV cache) against lm-evaluation-harness's ``hf``
model, on the same Llama weights (a random model saved by ``transformers``, imported by kiln)
and the same HellaSwag-shaped task (a context of ~60 words, 4 endings of ~15).

    python scripts/bench_eval.py [--examples 200] [--hidden 256] [--layers 4] [--rounds 3]
                                 [--batch 16] [--threads 2] [--json]

Prints examples/s of both and their ratio with the CPU model; both score every (context, ending)
pair, tokenisation included, model loading excluded. The harness is timed twice: its scoring
call alone (``hf.loglikelihood`` on the task's requests) and ``simple_evaluate`` end to end. Its
batch is ``--batch`` x 4 requests so one forward holds as many continuations as kiln's.
Needs transformers, lm-eval and accelerate (the ``dev`` extra). The tests reuse the helpers
below (a tiny model, task files, the harness's YAML) for the parity checks.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_rows, also when imported by path

from bench_rows.common import cpu_model  # noqa: E402

WORDS = ["the", "cat", "dog", "ran", "sat", "on", "a", "mat", "hat", "big", "small", "red",
         "blue", "house", "tree", "kiln", "fire", "clay", "pot", "water", "then", "he", "she",
         "takes", "puts", "into", "slowly", "and", "with", "hands", "oven", "glaze"]


def sentence(r: random.Random, lo: int, hi: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))


def save_model(folder: Path, *, hidden: int = 64, layers: int = 2, vocab: int = 300,
               seed: int = 0) -> Path:
    """A random Llama with a byte-level BPE tokenizer (BOS = 0, EOS = 1) trained on WORDS."""
    import torch
    import transformers

    from kiln.components.tokenizers.bpe_train import BOS, EOS, build_bpe, save_bpe

    r = random.Random(seed)
    tok = build_bpe([sentence(r, 20, 60) for _ in range(400)], vocab)
    save_bpe(tok, folder)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # not a uniform init: the choices' scores differ
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return folder


def write_mc(folder: Path, n: int, *, seed: int = 0, context=(40, 70), ending=(8, 20)) -> Path:
    """``mc.jsonl`` (kiln's schema) and ``mc.yaml`` (the harness's task on the same file)."""
    r = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"context": sentence(r, *context), "choices": [sentence(r, *ending) for _ in range(4)],
             "answer": r.randrange(4)} for _ in range(n)]
    (folder / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (folder / "mc.yaml").write_text(
        f"task: kiln_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return folder


def write_em(folder: Path, n: int, *, seed: int = 1, max_gen_toks: int = 12) -> Path:
    """``em.jsonl`` and ``em.yaml``: greedy generation until '.' or 'fire', exact match."""
    r = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": sentence(r, 3, 30), "answer": r.choice(WORDS)} for _ in range(n)]
    (folder / "em.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (folder / "em.yaml").write_text(
        f"task: kiln_em\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'em.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
        f"generation_kwargs:\n  until: [\".\", \"fire\"]\n  max_gen_toks: {max_gen_toks}\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return folder


def harness(lm, tasks: list[str], folder: Path) -> dict:
    """``simple_evaluate`` on the local task YAMLs in ``folder`` (samples logged)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Only the folder's tasks: the default TaskManager also indexes the ~14,700 task YAMLs lm-eval
    # ships (tens of seconds here), which no side of the comparison needs.
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, log_samples=True, task_manager=manager)


def hf_model(folder: Path, batch: int):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(folder), device="cpu", batch_size=batch, add_bos_token=True,
                dtype="float32")


def kiln_task(kind: str, path: Path, **values):
    from kiln.components.base import default_config

    return default_config("task", kind, path=str(path), **values).build(name=kind)


def kiln_scorer(folder: Path):
    """kiln's in-loop scorer on the Hugging Face folder's weights (imported); its tokenizer."""
    from kiln.components.tasks.scorer import Scorer
    from kiln.recipes.inference.task_plans import greedy_generate, model_context
    from kiln.recipes.loading.checkpoint_model import open_model

    recipe, tokenizer, model, _ = open_model(folder)
    model.eval()
    return Scorer(model, max_len=model_context(model, recipe.training.seq_len),
                  vocab_size=tokenizer.vocab_size, generate=greedy_generate()), tokenizer


def requests_of(rows: list[dict]):
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood", {}, (r["context"], " " + c), j)
            for r in rows for j, c in enumerate(r["choices"])]


def bench(args) -> dict:
    import tempfile

    import torch

    from kiln.components.tasks import runner

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-eval-"))
    folder = save_model(tmp / "model", hidden=args.hidden, layers=args.layers, vocab=512)
    write_mc(tmp / "tasks", args.examples)
    rows = [json.loads(x) for x in (tmp / "tasks" / "mc.jsonl").read_text().splitlines()]
    scorer, tokenizer = kiln_scorer(folder)
    lm = hf_model(folder, args.batch * 4)
    times: dict[str, list[float]] = {"kiln": [], "hf_loglikelihood": [], "hf_simple_evaluate": []}
    metrics = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            task = kiln_task("multiple_choice", tmp / "tasks" / "mc.jsonl", batch_size=args.batch)
            metrics["kiln"] = runner.run(task, task.plan(tokenizer, scorer.max_len), scorer)
            times["kiln"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            lm.loglikelihood(requests_of(rows), disable_tqdm=True)
            times["hf_loglikelihood"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = harness(lm, ["kiln_mc"], tmp / "tasks")["results"]["kiln_mc"]
            times["hf_simple_evaluate"].append(time.perf_counter() - t0)
            metrics["harness"] = {"acc": out["acc,none"], "acc_norm": out["acc_norm,none"]}
    best = {k: min(v) for k, v in times.items()}
    eps = {k: args.examples / v for k, v in best.items()}
    params = sum(p.numel() for p in scorer.model.parameters())
    return {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__,
            "examples": args.examples, "batch": args.batch, "rounds": args.rounds,
            "params": params, "seconds": best, "examples_per_second": eps,
            "ratio_vs_hf_loglikelihood": eps["kiln"] / eps["hf_loglikelihood"],
            "ratio_vs_hf_simple_evaluate": eps["kiln"] / eps["hf_simple_evaluate"],
            "metrics": metrics}


def render(r: dict) -> str:
    eps = r["examples_per_second"]
    return "\n".join([
        f"CPU: {r['cpu']} ({r['threads']} threads), torch {r['torch']}; a {r['params']:,}-"
        f"parameter Llama, {r['examples']} four-way examples, best of {r['rounds']}",
        f"kiln in-loop multiple choice    {eps['kiln']:8.1f} examples/s  (batch {r['batch']} "
        "examples)",
        f"harness hf loglikelihood        {eps['hf_loglikelihood']:8.1f} examples/s  (batch "
        f"{r['batch'] * 4} requests)",
        f"harness hf simple_evaluate      {eps['hf_simple_evaluate']:8.1f} examples/s",
        f"ratio kiln / harness hf: {r['ratio_vs_hf_loglikelihood']:.2f}x (scoring call), "
        f"{r['ratio_vs_hf_simple_evaluate']:.2f}x (simple_evaluate)",
        f"scores: kiln {r['metrics']['kiln']}, harness {r['metrics']['harness']}",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="kiln: examples per batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = bench(args)
    print(json.dumps(result) if args.json else render(result))


if __name__ == "__main__":
    main()
