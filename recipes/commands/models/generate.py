"""`kiln generate RUN_OR_CHECKPOINT --prompt TEXT [--prompt TEXT ...]`: sample continuations
from a run's newest checkpoint (or a given one) with a KV cache, streaming a single prompt's
tokens to the terminal as they come; several prompts run as one batch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kiln.components.errors import RecipeError

# kiln.components.devices.DEVICES, spelt out so that --help does not import torch (a test
# keeps the two equal)
DEVICES = ("auto", "cpu", "cuda", "npu", "xpu", "mps")


def add_arguments(parser) -> None:
    parser.add_argument("run", help="run folder, its checkpoints folder, or a step_XXXXXXX folder")
    parser.add_argument("--prompt", action="append", default=[],
                        help="text to continue (repeat for a batch)")
    parser.add_argument("--prompts-file", default="",
                        help="one prompt per line (added to --prompt)")
    parser.add_argument("--chat", action="store_true",
                        help="each prompt is a user message, rendered with the run's chat "
                        "template (its chat_template.jinja, data.template, or the tokenizer's "
                        "folder); the answer stops at the template's end of turn")
    parser.add_argument("--system", default="", help="with --chat: a system message first")
    parser.add_argument("--template", default="",
                        help='with --chat: another template ("chatml", a .jinja file, a folder)')
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample from the k likeliest (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set holding this probability (1 = all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    parser.add_argument("--loops", type=int, default=0,
                        help="loop count of a looped model (default: the trained H)")
    parser.add_argument("--no-cache", action="store_true",
                        help="rerun the whole sequence every step (slow; for checking)")
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="auto: the accelerator present, else the CPU")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 on CUDA, NPU and XPU devices, float32 elsewhere")


def _prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise RecipeError(f"--prompts-file {args.prompts_file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise RecipeError(f"--prompts-file {args.prompts_file}: byte {exc.start} is not "
                              "UTF-8 text; save the file as UTF-8") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise RecipeError("give at least one --prompt TEXT (or --prompts-file FILE)")
    return prompts


def continuation(tokenizer, prompt_ids: list[int], new_ids: list[int],
                 prompt_text: str | None = None) -> str:
    """The text ``new_ids`` add after the prompt: decode(prompt + new) past decode(prompt)
    (``prompt_text``, when already known). Decoding the new ids alone would lose what a decoder
    does at the start of a text: a SentencePiece-style (Metaspace) decoder, as in Llama 2 or
    Mistral, drops the first token's leading space ('a1 1 1' for 'a 1 1 1')."""
    base = tokenizer.decode(prompt_ids) if prompt_text is None else prompt_text
    full = tokenizer.decode([*prompt_ids, *new_ids])
    if not full.startswith(base):  # a decoder that rewrote the prompt's end: what differs
        base = os.path.commonprefix([base, full])
    return full[len(base):]


class Stream:
    """Prints one row's text as tokens arrive (holding back an incomplete UTF-8 character)."""

    def __init__(self, tokenizer, prompt_ids: list[int], out) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.prompt, self.prompt_text = list(prompt_ids), tokenizer.decode(prompt_ids)
        self.ids: list[int] = []
        self.shown = 0

    def text(self) -> str:
        return continuation(self.tokenizer, self.prompt, self.ids, self.prompt_text)

    def __call__(self, tokens, live) -> None:
        if bool(live[0]):
            self.ids.append(int(tokens[0]))
        text = self.text().rstrip("\ufffd")
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = max(self.shown, len(text))


def run(args) -> int:
    import torch

    from kiln.checkpointing.resume import find_checkpoint
    from kiln.components.devices import pick_device
    from kiln.components.models.generation import Sampling, generate
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.loading.checkpoint_model import load_model

    prompts = _prompts(args)
    if args.max_new_tokens < 1:
        raise RecipeError("--max-new-tokens must be at least 1")
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as exc:
        raise RecipeError(f"--temperature/--top-k/--top-p: {exc}") from None
    ckpt = find_checkpoint(Path(args.run))
    saved = load_recipe(ckpt)
    tokenizer = saved.tokenizer.build()
    until, chat = None, None
    if args.chat:
        chat = _Chat(args, saved, tokenizer, ckpt)
        encoded, until = [chat.ids(p) for p in prompts], chat.until
    else:
        encoded = [tokenizer.encode(p, bos=True, eos=False) for p in prompts]
    needed = max(map(len, encoded)) + args.max_new_tokens
    recipe, tokenizer, model = load_model(ckpt, min_seq_len=needed)
    if model.max_seq_len < needed:
        raise RecipeError(f"prompt + --max-new-tokens = {needed} tokens exceed the model's "
                          f"context (model.max_seq_len = {model.max_seq_len}); ask for fewer")
    if needed > recipe.training.seq_len:
        print(f"kiln: note: generating past the trained context ({recipe.training.seq_len} "
              "tokens)", file=sys.stderr)
    loops = args.loops or None
    if loops is not None and not 1 <= loops <= getattr(model, "loops", 0):
        raise RecipeError(f"--loops {loops}: " + (
            f"this looped model was trained with H = {model.loops}; use 1..{model.loops}"
            if hasattr(model, "loops") else "only looped models take --loops"))
    device = pick_device(args.device, key="--device")
    dtype = {"auto": torch.bfloat16 if device.type in ("cuda", "npu", "xpu") else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = model.to(device=device, dtype=dtype)
    # --chat prints whole answers, cut at the end of turn (streamed, its marker would show)
    stream = Stream(tokenizer, encoded[0], sys.stdout) if len(prompts) == 1 and not args.chat \
        else None
    if stream is not None:
        sys.stdout.write(prompts[0])
    # Inference mode, not only no_grad: no version counters or view tracking on any tensor.
    # Batch 1 decoding spent 1.18x the CPU time without it (docs/benchmarks.md, "Generation").
    # generate() itself keeps no_grad: a trainer's downstream evaluation calls it on the model
    # it trains (a compiled model would compile once more for inference mode).
    with torch.inference_mode():
        outs = generate(model, encoded, max_new_tokens=args.max_new_tokens, sampling=sampling,
                        eos_id=tokenizer.eos_id, use_cache=not args.no_cache, loops=loops,
                        vocab_size=tokenizer.vocab_size, on_tokens=stream, until=until)
    if stream is not None:
        rest = stream.text()[stream.shown:]  # whatever the stream held back
        sys.stdout.write(rest + "\n")
        return 0
    for i, (prompt, ids, new) in enumerate(zip(prompts, encoded, outs, strict=True)):
        text = continuation(tokenizer, ids, new)
        if args.chat:
            text = chat.answer(new)
        print(f"--- [{i}] ---\n" + (f"user: {prompt}\nassistant: {text}" if args.chat
                                     else f"{prompt}{text}"))
    return 0


class _Chat:
    """``--chat``: prompts rendered with the run's chat template, answers cut at its end of
    turn."""

    def __init__(self, args, recipe, tokenizer, ckpt: Path) -> None:
        import inspect

        from kiln.components.tokenizers import chat_templates as templates
        from kiln.components.tokenizers.chat_templates import TEMPLATE_FILE

        saved = ckpt.parent.parent / TEMPLATE_FILE  # RUN/checkpoints/step_N -> RUN
        if args.template:
            self.template = templates.resolve(args.template, tokenizer)
        elif saved.is_file():
            self.template = templates.from_text(saved.read_text(encoding="utf-8"), str(saved),
                                                tokenizer)
        else:
            spec = recipe.data.template if recipe.data.type == "chat" else ""
            self.template = templates.resolve(spec, tokenizer)
        self.tokenizer, self.templates = tokenizer, templates
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.stop = templates.end_of_turn(self.template)
        # the end of turn is often a special token, which decode drops by default
        self.keep = {"skip_special": False} if "skip_special" in inspect.signature(
            tokenizer.decode).parameters else {}

    def ids(self, prompt: str) -> list[int]:
        return self.templates.prompt_ids(self.template, self.tokenizer,
                                         [*self.system, {"role": "user", "content": prompt}])

    def until(self, new: list[int]) -> bool:
        return bool(self.stop) and self.stop in self.tokenizer.decode(new, **self.keep)

    def answer(self, new: list[int]) -> str:
        text = self.tokenizer.decode(new, **self.keep)
        return (text.split(self.stop)[0] if self.stop else text).strip()
