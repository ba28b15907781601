"""Start from a Hugging Face model, train, export, load back with transformers -- end to end:

    python scripts/hf_round_trip.py [WORK_DIR] [--steps 20] [--family llama]

1. save a random tiny model with transformers (scripts/tiny_hf_model.py),
2. ``kiln import`` it, 3. train ``--steps`` steps from it with ./run_train.sh,
4. ``kiln export`` the final checkpoint, 5. load the export (model and tokenizer) with
transformers and compare its logits, token ids and greedy generation with kiln's. Exits 1 if
they disagree.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def sh(*cmd: str) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work_dir", nargs="?", default="runs/hf_round_trip")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--family", default="llama")
    args = parser.parse_args()
    work = (REPO / args.work_dir).resolve()
    for scratch in ("hf", "run", "export"):  # a rerun starts afresh: model, run and export
        shutil.rmtree(work / scratch, ignore_errors=True)
    sh(sys.executable, "scripts/tiny_hf_model.py", str(work / "hf"), "--family", args.family)
    sh("kiln", "import", str(work / "hf"), "--out", str(work / "recipe.toml"), "--seq-len", "256")
    sh("./run_train.sh", str(work / "recipe.toml"), f"--training.steps={args.steps}",
       f"--run.folder={work / 'run'}", "--run.progress_bar=false", "--run.log_interval=5",
       "--eval.interval=0", "--eval.at_end=false", "--checkpoint.resume=off")
    sh("kiln", "export", str(work / "run" / "checkpoints" / "final"), str(work / "export"),
       "--max-shard-size", "1MB")

    import transformers

    from kiln.checkpointing.resume import find_checkpoint
    from kiln.components.models.generation import Sampling, generate
    from kiln.recipes.loading.checkpoint_model import load_model

    _, tokenizer, model = load_model(find_checkpoint(work / "run"))
    model.eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(work / "export", dtype=torch.float32)
    start = transformers.AutoModelForCausalLM.from_pretrained(work / "hf", dtype=torch.float32)
    ids = torch.randint(0, 258, (4, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf.eval()(ids).logits - model(ids)).abs().max().item()
        moved = (start.eval()(ids).logits - model(ids)).abs().max().item()
    hf_tok = transformers.AutoTokenizer.from_pretrained(work / "export")
    prompt = tokenizer.encode("def ", bos=True)
    same_ids = [hf_tok.bos_token_id, *hf_tok("def ", add_special_tokens=False)["input_ids"]]
    ours = generate(model, [prompt], max_new_tokens=32, sampling=Sampling(temperature=0))[0]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                         # the mask explicitly: BOS is id 0, which it would take for padding
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    print(f"max |logits(transformers, export) - logits(kiln)| = {diff:.3g}")
    print(f"max |logits after training - logits of the imported model| = {moved:.3g}")
    print(f"greedy generation, 32 tokens: {'identical' if ours == theirs else 'DIFFERENT'}")
    print(f"tokenizer ({type(tokenizer).__name__}, {tokenizer.vocab_size} ids) in the export: "
          f"{'same ids' if same_ids == prompt else 'DIFFERENT ids'} for 'def '")
    return 0 if diff < 1e-4 and ours == theirs and moved > 0 and same_ids == prompt else 1


if __name__ == "__main__":
    sys.exit(main())
