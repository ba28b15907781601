"""Generation tokens/s: kiln's ``generate`` (KV cache) on a checkpoint against ``transformers``'
``generate`` (its default dynamic KV cache) on that checkpoint's ``kiln export``: the same
weights, greedy, fp32, ``new_tokens`` new tokens per row after a prompt of ``prompt`` random
token ids (all rows the same length: no padding on either side), EOS off so every row runs the
full length. Model loading and one short warm-up generation are outside the timing.

``setup(work)`` (kiln's interpreter, once per table) trains ``train_configs/llama_debug.toml`` for
one step with a checkpoint and exports it; both sides then load from ``work``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench_rows.common import LLAMA_DEBUG, REPO, Unavailable, median_seconds, set_threads


def setup(work: Path) -> None:
    """``work/run`` (one training step, a final checkpoint) and ``work/export`` (HF layout)."""
    if (work / "export" / "config.json").exists():
        return
    kiln = [sys.executable, "-m", "kiln.recipes.cli"]
    for cmd in ([*kiln, "data", "prepare", LLAMA_DEBUG],
                [*kiln, "train", LLAMA_DEBUG, "--training.steps=1", f"--run.folder={work / 'run'}",
                 "--run.progress_bar=false", "--run.tensorboard=false", "--eval.at_end=false",
                 "--checkpoint.resume=off"],
                [*kiln, "export", str(work / "run" / "checkpoints" / "final"),
                 str(work / "export"), "--force"]):
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")


def _prompts(p: dict) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)  # ids 3..257: the byte tokenizer's ids
    return torch.randint(3, 258, (p["batch"], p["prompt"]), generator=g).tolist()


def _result(seconds: float, p: dict, first_row: list[int], **more) -> dict:
    return {"tokens_per_second": p["batch"] * p["new_tokens"] / seconds, "seconds": seconds,
            "first_row": first_row, **more}


def kiln(p: dict) -> dict:
    import torch

    from kiln.checkpointing.resume import find_checkpoint
    from kiln.components.models.generation import Sampling, generate
    from kiln.recipes.loading.checkpoint_model import load_model

    set_threads(p["threads"])
    work = Path(p["work"])
    _, _, model = load_model(find_checkpoint(work / "run"),
                             min_seq_len=p["prompt"] + p["new_tokens"])
    model.eval()
    prompts = _prompts(p)
    greedy = Sampling(temperature=0)

    def run(n: int) -> list[list[int]]:
        return generate(model, prompts, max_new_tokens=n, sampling=greedy)

    with torch.inference_mode():
        run(8)
        out: list = []
        seconds = median_seconds(lambda: out.append(run(p["new_tokens"])), p["repeats"])
    return _result(seconds, p, out[-1][0])


def peer(p: dict) -> dict:
    import torch

    try:
        import transformers
    except ImportError as exc:
        raise Unavailable(f"transformers is not importable in {sys.executable} ({exc})") from None
    set_threads(p["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(Path(p["work"]) / "export",
                                                              dtype=torch.float32).eval()
    ids = torch.tensor(_prompts(p))
    mask = torch.ones_like(ids)

    def run(n: int) -> torch.Tensor:
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                              use_cache=True, eos_token_id=None, pad_token_id=0)

    with torch.inference_mode():
        run(8)
        out: list = []
        seconds = median_seconds(lambda: out.append(run(p["new_tokens"])), p["repeats"])
    first = out[-1][0, ids.shape[1]:].tolist()
    return _result(seconds, p, first, version=f"transformers {transformers.__version__}")
