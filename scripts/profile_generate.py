"""Where generation spends its time: ``torch.profiler`` around one greedy generation (batch 8,
or ``--batch``; 32-token prompts, fp32, KV cache) of kiln's ``generate`` or of ``transformers``'
``generate``, on the checkpoint and export ``scripts/bench_peers.py --only generate`` leaves under
its work folder (``runs/bench_peers/generate``). Prints the operators by self CPU time
(docs/benchmarks.md).

    python scripts/profile_generate.py runs/bench_peers/generate kiln
    PEER_ENV/bin/python scripts/profile_generate.py runs/bench_peers/generate peer
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="bench_peers' generate folder (run/, export/)")
    parser.add_argument("side", choices=("kiln", "peer"))
    parser.add_argument("--batch", type=int, default=8, help="prompts (rows) per generation")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=14, help="operators to print")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = torch.randint(3, 258, (args.batch, 32), generator=torch.Generator().manual_seed(0))
    if args.side == "kiln":
        from kiln.checkpointing.resume import find_checkpoint
        from kiln.components.models.generation import Sampling, generate
        from kiln.recipes.loading.checkpoint_model import load_model

        _, _, model = load_model(find_checkpoint(args.work / "run"),
                                 min_seq_len=32 + args.new_tokens)

        def run(n: int):
            return generate(model.eval(), prompts.tolist(), max_new_tokens=n,
                            sampling=Sampling(temperature=0))
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.work / "export", dtype=torch.float32).eval()

        def run(n: int):
            return model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=n, do_sample=False, use_cache=True,
                                  eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        run(8)  # warm-up, outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(args.new_tokens)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                    max_name_column_width=40))


if __name__ == "__main__":
    main()
