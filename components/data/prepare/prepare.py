"""``kiln data prepare`` for real corpora: parallel, bounded-memory, resumable, idempotent.

The inputs (see ``text_sources``) are read in order, in batches of about ``batch_bytes`` of
text, tokenised by ``workers`` processes (``encode_pool``) and written by a sink: the packed
document layout (``out`` holds it) or per-domain shards for ``balanced_shards``
(``out/<domain>/shard_NNNNN.npy``).

Everything is written into a hidden partial folder beside the result (``.<name>.partial``) and
renamed into place at the end, so a half-written dataset is never used. ``progress.json`` in the
partial folder records the input position (file, document index, byte offset) and the counts
that were fsynced with it; a killed build rerun with the same inputs and settings continues
from there. The finished folder's ``manifest.json`` records the inputs (name, size, mtime,
sha256), the tokenizer (fingerprint and source) and the settings: rerunning with the same ones
is a no-op, different ones are refused unless ``overwrite``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.components.data.prepare import splits
from kiln.components.data.prepare.encode_pool import encode_batches
from kiln.components.data.prepare.packed_layout import file_lock, token_dtype, tokenizer_meta
from kiln.components.data.prepare.prepare_sinks import PackedSink, ShardSink
from kiln.components.errors import DataError
from kiln.components.sources.text_sources import (
    ReadStats,
    SourceFile,
    expand_inputs,
    read_documents,
)

MANIFEST, PROGRESS = "manifest.json", "progress.json"
COMMIT_SECONDS = 5.0  # packed layout: fsync + progress.json at most this often


@dataclass
class PrepareOptions:
    """What to read, how to tokenise it and what to write (see ``kiln data prepare --help``)."""

    inputs: list[str]
    out: str
    text_field: str = "text"
    split: str = "train"
    config: str = ""
    cache_dir: str = ""
    on_invalid_utf8: str = "skip"
    max_bytes: int = 0  # 0 = all of it; else whole documents while they fit
    workers: int = 0
    batch_bytes: int = 1 << 20
    seq_len: int = 256
    seed: int = 0
    num_epochs: int = 4
    eval_fraction: float = 0.02
    domain: str = ""  # set: write balanced_shards shards into out/<domain>
    shard_tokens: int = 1 << 24
    separator: str = "bos_eos"  # how documents are framed (``splits.SEPARATORS``)
    eval_split: str = "random"  # random | tail | files (``splits``)
    eval_inputs: list[str] = field(default_factory=list)  # files held out whole (eval_split files)

    @property
    def target(self) -> Path:
        out = Path(self.out).expanduser()
        return out / self.domain if self.domain else out

    def settings(self) -> dict[str, Any]:
        """The settings that change the bytes written (workers and batch size do not)."""
        skip = {"inputs", "out", "workers", "batch_bytes", "cache_dir"}
        skip |= {"shard_tokens"} if not self.domain else {"seq_len", "seed", "num_epochs",
                                                           "eval_fraction", "separator",
                                                           "eval_split", "eval_inputs"}
        return {k: v for k, v in asdict(self).items() if k not in skip}

    def check(self) -> None:
        """The framing and eval-split options fit together (one message naming the flag)."""
        splits.framing(self.separator)
        if self.eval_split not in splits.EVAL_SPLITS:
            raise DataError(f"--eval-split {self.eval_split!r}: choose one of "
                            f"{', '.join(splits.EVAL_SPLITS)}")
        if (self.eval_split == "files") != bool(self.eval_inputs):
            raise DataError("--eval-input FILE... holds files out as the eval split "
                            "(eval_split = files), and that split needs them")
        if self.domain and (self.eval_inputs or self.eval_split != "random"
                            or self.separator != "bos_eos"):
            raise DataError("--domain writes balanced_shards shards, which hold no eval split "
                            "and keep [BOS] ... [EOS]: leave out --eval-split, --eval-input and "
                            "--separator")


@dataclass
class PrepareResult:
    folder: Path
    status: str  # "built" | "resumed" | "up to date"
    manifest: dict[str, Any]
    stats: ReadStats


def _identity(src: SourceFile) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": src.name, "size": src.size}
    if src.local:
        entry["mtime_ns"] = Path(src.local).stat().st_mtime_ns
    return entry


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _key(inputs: list[dict[str, Any]], tok_meta: dict[str, Any], settings: dict[str, Any]) -> str:
    parts = [[(i["name"], i["size"]) for i in inputs], tok_meta["tokenizer"], settings]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _unchanged(manifest: dict[str, Any], files: list[SourceFile]) -> bool:
    """Same inputs as the manifest's: same mtimes, or (touched files) the same sha256."""
    for old, src in zip(manifest["inputs"], files, strict=True):
        if old.get("mtime_ns") not in (None, _identity(src).get("mtime_ns")) and \
                old.get("sha256") != sha256_file(src.path()):
            return False
    return True


def _write_json(path: Path, data: dict[str, Any]) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise DataError(f"{folder / MANIFEST}: unreadable ({exc}); delete {folder} and rerun "
                        "kiln data prepare") from None


def prepare(opts: PrepareOptions, tokenizer: Any, *, overwrite: bool = False,
            progress: bool = True, log: Any = print) -> PrepareResult:
    """Build (or continue, or confirm) the dataset ``opts`` describes; see the module doc."""
    if opts.domain and (not opts.domain.replace("-", "").replace("_", "").isalnum()):
        raise DataError(f"--domain {opts.domain!r}: use letters, digits, '-' and '_' only")
    opts.check()
    files = expand_inputs(opts.inputs, split=opts.split, config=opts.config,
                          cache_dir=opts.cache_dir)
    first_eval = len(files)
    if opts.eval_inputs:  # read last: the files eval split is the last documents
        files += expand_inputs(opts.eval_inputs, split=opts.split, config=opts.config,
                               cache_dir=opts.cache_dir)
    inputs = [_identity(f) for f in files]
    tok_meta = tokenizer_meta(tokenizer)
    key = _key(inputs, tok_meta, opts.settings())
    final = opts.target
    with file_lock(final.parent / f".{final.name}.lock"):
        if final.exists():
            old = read_manifest(final)
            if old is not None and old.get("key") == key and _unchanged(old, files):
                return PrepareResult(final, "up to date", old, ReadStats())
            if not overwrite:
                why = "was not built by kiln data prepare (no manifest.json)" if old is None \
                    else "was built from other inputs, tokenizer or settings"
                raise DataError(f"{final} exists and {why}; pass --overwrite to replace it, "
                                "or choose another --out")
        partial = final.parent / f".{final.name}.partial"
        state = _load_progress(partial, key, log)
        status = "resumed" if state["docs"] or state["file"] else "built"
        stats = ReadStats(**state.get("stats", {}))
        totals = _run(opts, tokenizer, files, partial, state, stats, progress, first_eval)
        manifest = {"kiln_prepare": 1, "key": key, "layout": "shards" if opts.domain
                    else "packed", "inputs": [{**i, "sha256": sha256_file(f.path())}
                                              for i, f in zip(inputs, files, strict=True)],
                    "tokenizer": {"fingerprint": tok_meta["tokenizer"],
                                  "source": tok_meta["tokenizer_source"],
                                  "vocab_size": tok_meta["vocab_size"]},
                    "settings": opts.settings(), "totals": totals,
                    "skipped": {"invalid_utf8": stats.invalid_utf8, "empty": stats.empty}}
        _write_json(partial / MANIFEST, manifest)
        (partial / PROGRESS).unlink()
        _swap_in(partial, final)
    return PrepareResult(final, status, manifest, stats)


def _load_progress(partial: Path, key: str, log: Any) -> dict[str, Any]:
    fresh = {"key": key, "file": 0, "start": 0, "offset": 0, "docs": 0, "tokens": 0,
             "taken_bytes": 0}
    if partial.exists():
        try:
            state = json.loads((partial / PROGRESS).read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("key") == key:
            log(f"continuing the interrupted build in {partial} (from document "
                f"{state['docs']:,})")
            return state
        log(f"discarding {partial}: an interrupted build of other inputs or settings")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    _write_json(partial / PROGRESS, fresh)
    return fresh


def _swap_in(partial: Path, final: Path) -> None:
    old = final.parent / f".{final.name}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    shutil.rmtree(old, ignore_errors=True)


def _batches(opts: PrepareOptions, files: list[SourceFile], state: dict[str, Any],
             stats: ReadStats):
    """``(positions, texts)`` batches from the saved position; a position is where reading
    resumes after that document: ``[file, index, offset, taken_bytes]``."""
    taken = state["taken_bytes"]
    for fi in range(state["file"], len(files)):
        start, offset = (state["start"], state["offset"]) if fi == state["file"] else (0, 0)
        texts: list[str] = []
        positions: list[list[int]] = []
        size = 0
        for index, off, text in read_documents(files[fi], text_field=opts.text_field,
                                               start=start, offset=offset,
                                               on_invalid_utf8=opts.on_invalid_utf8, stats=stats):
            n = len(text.encode("utf-8")) if opts.max_bytes else len(text)
            if opts.max_bytes and taken + n > opts.max_bytes:
                continue
            taken += n if opts.max_bytes else 0
            texts.append(text)
            positions.append([fi, index, off, taken])
            size += n
            if size >= opts.batch_bytes:
                yield positions, texts
                texts, positions, size = [], [], 0
        if texts:
            yield positions, texts
        positions = [[fi + 1, 0, 0, taken]]
        yield positions, []  # the file is done: a commit point that skips it on resume


def _run(opts: PrepareOptions, tokenizer: Any, files: list[SourceFile], partial: Path,
         state: dict[str, Any], stats: ReadStats, progress: bool,
         first_eval: int) -> dict[str, Any]:
    from tqdm import tqdm

    dtype = token_dtype(tokenizer.vocab_size)
    args = (partial, dtype, tokenizer.bos_id, tokenizer.eos_id, state)
    sink = ShardSink(*args, opts.shard_tokens) if opts.domain else PackedSink(
        *args, opts.separator, first_eval if opts.eval_inputs else None)
    bar = tqdm(desc=f"prepare {opts.target.name}", unit="B", unit_scale=True,
               disable=not progress, dynamic_ncols=True, mininterval=1.0)
    last = time.monotonic()

    def commit(position: list[int], counts: dict[str, int]) -> None:
        state.update(counts, file=position[0], start=position[1], offset=position[2],
                     taken_bytes=position[3], stats={"invalid_utf8": stats.invalid_utf8,
                                                     "empty": stats.empty})
        _write_json(partial / PROGRESS, state)

    try:
        for positions, enc in encode_batches(tokenizer, _batches(opts, files, state, stats),
                                             workers=opts.workers, dtype=dtype):
            for position, counts in sink.add(enc, positions):
                commit(position, counts)
            bar.update(int(enc.nbytes.sum()))
            bar.set_postfix_str(f"{sink.docs:,} docs, {sink.tokens:,} tokens, file "
                                f"{min(positions[-1][0] + 1, len(files))}/{len(files)}",
                                refresh=False)
            if sink.periodic and (not enc.lengths.size or time.monotonic() - last
                                  > COMMIT_SECONDS):
                commit(positions[-1], sink.commit())
                last = time.monotonic()
        if not sink.docs and not getattr(sink, "_buf", None):
            raise DataError(f"the inputs ({', '.join(opts.inputs)}) gave no documents (empty "
                            f"files: {stats.empty}, invalid UTF-8: {stats.invalid_utf8}); "
                            "check the inputs, --text-field and --split")
        layout = {} if opts.domain else {"seq_len": opts.seq_len, "seed": opts.seed,
                                         "num_epochs": opts.num_epochs,
                                         "eval_fraction": opts.eval_fraction,
                                         "eval_split": opts.eval_split}
        return sink.finish(tokenizer_meta(tokenizer), layout, f"inputs:{' '.join(opts.inputs)}")
    finally:
        bar.close()
        sink.close()
