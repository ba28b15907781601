"""kiln as an lm-evaluation-harness model: ``--model kiln --model_args path=RUN[,step=N,...]``.

An ``lm_eval.api.model.TemplateLM`` (the harness's tokenisation of context / continuation pairs)
whose three request types run on kiln's ``Scorer``: ``loglikelihood`` shares each context
across its continuations (one forward of the context, KV cache), ``loglikelihood_rolling``
scores windows of the model's context, ``generate_until`` decodes greedily with the KV cache.
Batched, one device; the model is a run folder (newest checkpoint or ``step``), a checkpoint or
a Hugging Face model folder. The harness 0.4.x finds no models through entry points:
importing this module registers it (``kiln harness`` does).

Model arguments: ``MODEL_ARGS`` (``kiln harness --help`` prints them). The harness always hands
its own ``--batch_size`` (default 1) and ``--device`` to the model as well: the ones set in
``--model_args`` win.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string
from tqdm import tqdm

from kiln.components.devices import pick_device
from kiln.components.errors import RecipeError
from kiln.components.tasks.bits_per_byte import windows
from kiln.components.tasks.common import left_truncate
from kiln.components.tasks.scorer import Scorer
from kiln.recipes.inference.task_plans import greedy_generate, model_context
from kiln.recipes.loading.checkpoint_model import open_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODEL_ARGS = {  # name -> help (kiln harness --help)
    "path": "a run folder (its newest checkpoint), a checkpoint or a Hugging Face model folder "
            "(required)",
    "step": "the run's checkpoint of this step (default: the newest)",
    "device": "cpu, cuda, mps, ... (default: the harness's --device, else cpu)",
    "batch_size": "contexts per batch (default: the harness's --batch_size, 1; auto = 16)",
    "dtype": "float32 | bfloat16 (default: float32)",
    "max_length": "tokens of context (default: the model's context)",
    "max_gen_toks": "new tokens of generate_until when a task sets none (default: 256)",
    "add_bos": "true: every context starts with BOS, like the hf model with "
               "add_bos_token=True (default: true)",
}


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("kiln")
class KilnLM(TemplateLM):
    """A kiln run, checkpoint or Hugging Face folder, scored by kiln."""

    def __init__(self, path: str = "", step: int = 0, device: str | None = "cpu",
                 batch_size: int | str | None = 16, max_batch_size: int | None = None,
                 dtype: str = "float32", max_length: int = 0, max_gen_toks: int = 256,
                 add_bos: bool | str = True, **unknown) -> None:
        super().__init__()
        if unknown:
            raise RecipeError(f"--model_args: unknown argument(s) {', '.join(sorted(unknown))} "
                              f"for the kiln model; valid: {', '.join(MODEL_ARGS)}")
        if not path:
            raise RecipeError("--model kiln needs --model_args path=RUN (a run folder, a "
                              "checkpoint or a Hugging Face model folder)")
        if str(dtype) not in DTYPES:
            raise RecipeError(f"--model_args dtype={dtype}: use {' or '.join(DTYPES)}")
        recipe, self.tokenizer_, model, self.label = open_model(str(path), step=int(step))
        self._device = pick_device(device or "auto", key="device")
        model = model.to(device=self._device, dtype=DTYPES[str(dtype)]).eval()
        self.max_length = int(max_length) or model_context(model, recipe.training.seq_len)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos = _flag(add_bos)
        # "auto" (the harness probes memory) is not supported: a fixed size
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self.scorer = Scorer(model, max_len=self.max_length,
                             vocab_size=self.tokenizer_.vocab_size, generate=greedy_generate())

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None
                               ) -> KilnLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None
                            ) -> KilnLM:
        """The harness passes its own batch_size (always) and device beside ``--model_args``:
        a name given in both is the model argument's, not a TypeError."""
        extra = {k: v for k, v in (additional_config or {}).items()
                 if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # --------------------------------------------------------------------------- tokenization
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer_.bos_id
        return bos if bos is not None else self.tokenizer_.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        return self.tokenizer_.encode(string, bos=bos and self.tokenizer_.bos_id is not None,
                                      eos=False)

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer_.decode(ids)

    # --------------------------------------------------------------------------- the requests
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """Requests sharing a context (the choices of one question) form one group: the
        context runs once. Groups go longest first, ``batch_size`` per batch."""
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (_, ctx, cont) in enumerate(requests):
            if len(cont) > self.max_length:
                raise RecipeError(f"a continuation of {len(cont)} tokens exceeds the model's "
                                  f"context ({self.max_length})")
            ctx, _ = left_truncate(ctx, self.max_length + 1 - len(cont))
            groups[tuple(ctx)].append(i)
        keys = sorted(groups, key=lambda k: -(len(k) + max(len(requests[i][2])
                                                            for i in groups[k])))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="kiln loglikelihood")
        for start in range(0, len(keys), self.batch_size):
            batch = keys[start:start + self.batch_size]
            scored = self.scorer.loglikelihoods(
                [(list(k), [requests[i][2] for i in groups[k]]) for k in batch])
            for key, results in zip(batch, scored, strict=True):
                for i, answer in zip(groups[key], results, strict=True):
                    out[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                    bar.update(1)
        bar.close()
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        rows, owner = [], []
        for r, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0], add_special_tokens=False)
            for window in windows(tokens, self.prefix_token_id, self.max_length):
                rows.append(window)
                owner.append(r)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        totals = [0.0] * len(requests)
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm,
                          desc="kiln loglikelihood_rolling"):
            chunk = order[start:start + self.batch_size]
            for i, (ll, _) in zip(chunk, self.scorer.score_rows([rows[i] for i in chunk]),
                                  strict=True):
                totals[owner[i]] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            by_kwargs[repr(sorted(req.args[1].items()))].append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="kiln generate_until")
        for indices in by_kwargs.values():
            kwargs = dict(requests[indices[0]].args[1])
            if _flag(kwargs.get("do_sample", False)) or float(kwargs.get("temperature", 0)):
                raise RecipeError("the kiln model decodes greedily: this task asks for sampling "
                                  f"({kwargs}); set do_sample=false / temperature=0")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            if new >= self.max_length:
                raise RecipeError(f"max_gen_toks = {new} leaves no room for a prompt in the "
                                  f"model's context ({self.max_length})")
            prompts = {i: left_truncate(self.tok_encode(requests[i].args[0]),
                                        self.max_length - new)[0] for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                outs = self.scorer.generate([prompts[i] for i in chunk], max_new_tokens=new,
                                            stop=until, decode=self.tok_decode,
                                            eos_id=self.eot_token_id)
                for i, ids in zip(chunk, outs, strict=True):
                    text = self.tok_decode(ids)
                    for s in until:
                        text = text.split(s)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(1)
        bar.close()
        return out  # type: ignore[return-value]

    def get_model_info(self) -> dict:
        return {"kiln_model": self.label, "max_length": self.max_length}
