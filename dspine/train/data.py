"""`dspine regen`: target-regenerated responses, written as a Parquet dataset (loadable with `datasets`).

The target answers each prompt itself (chat template applied, greedy by default, a fixed dtype: SmolLM2's
greedy output differs between fp32 and bf16). Output folder:
    part-00000.parquet ...   one row per answered prompt: id, prompt, thinking, prompt_ids, response_ids,
                             response_text, finish_reason (each part written to a temp file, then renamed)
    errors.jsonl             one line per prompt that could not be answered (id, error)
    manifest.json            input / ok / error / skipped counts (ok + error + skipped == input) and settings
Re-running with the same folder skips prompts already answered (resume after a crash or a larger --limit).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dspine.io import atomic_write, atomic_write_text
from dspine.target import Target

COLUMNS = ("id", "prompt", "thinking", "prompt_ids", "response_ids", "response_text", "finish_reason")


class RegenError(ValueError):
    """Regeneration cannot start (bad output folder, bad settings)."""


@dataclass
class RegenReport:
    input: int
    ok: int
    error: int
    skipped: int

    def check(self) -> None:
        assert self.ok + self.error + self.skipped == self.input, self


def existing_ids(out: Path) -> set[str]:
    import pyarrow.parquet as pq

    ids: set[str] = set()
    for part in sorted(out.glob("part-*.parquet")):
        ids.update(pq.read_table(part, columns=["id"]).column("id").to_pylist())
    return ids


def _generate_batch(
    target: Target, batch: list[list[int]], max_new_tokens: int, temperature: float, seed: int
) -> list[tuple[list[int], str]]:
    """Left-padded batched generation -> (response ids without EOS, finish reason) per row."""
    pad = target.tokenizer.pad_token_id if target.tokenizer and target.tokenizer.pad_token_id is not None else 0
    L = max(map(len, batch))
    dev = target.device
    ids = torch.tensor([[pad] * (L - len(s)) + s for s in batch], device=dev)
    mask = torch.arange(L, device=dev)[None] >= torch.tensor([L - len(s) for s in batch], device=dev)[:, None]
    torch.manual_seed(seed)
    kw = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        if temperature > 0
        else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    )
    with torch.no_grad():
        gen = target.model.generate(
            input_ids=ids, attention_mask=mask.long(), max_new_tokens=max_new_tokens, pad_token_id=pad, **kw
        )
    eos = target.eos_token_ids
    out = []
    for row in gen[:, L:].tolist():
        resp, reason = [], "length"
        for t in row:
            if t in eos:
                reason = "stop"
                break
            resp.append(t)
        out.append((resp, reason))
    return out


def _generate_fitting(
    target: Target, batch: list[list[int]], max_new_tokens: int, temperature: float, seed: int
) -> list[tuple[list[int], str]]:
    """`_generate_batch`, halving the batch on out-of-memory (the longest prompts of a large batch) instead of
    losing it; a single row that does not fit raises."""
    try:
        return _generate_batch(target, batch, max_new_tokens, temperature, seed)
    except torch.OutOfMemoryError:
        if len(batch) == 1:
            raise
    if target.device.type == "cuda":
        torch.cuda.empty_cache()
    h = len(batch) // 2
    return _generate_fitting(target, batch[:h], max_new_tokens, temperature, seed) + _generate_fitting(
        target, batch[h:], max_new_tokens, temperature, seed + h
    )


def _writable(out: Path) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".probe-")
        probe.close()
    except OSError as e:
        raise RegenError(f"cannot write to {out}: {e.strerror or e}") from None
    return out


def _encode(target: Target, todo: list[tuple[str, str]], max_new_tokens: int, errors: list[dict]) -> list[tuple]:
    """(id, prompt, chat ids) of each prompt that fits the context; the others go to `errors`."""
    max_ctx = target.info.max_position_embeddings
    encoded = []
    for i, p in todo:
        try:
            messages = [{"role": "user", "content": p}] if isinstance(p, str) else p
            if not messages or not all(str(m.get("content", "")).strip() for m in messages):
                raise ValueError("empty prompt")
            ids = target.chat_ids(messages)
            if len(ids) + max_new_tokens > max_ctx:
                raise ValueError(f"prompt of {len(ids)} tokens + {max_new_tokens} new exceeds the context {max_ctx}")
            encoded.append((i, p, ids))
        except ValueError as e:
            errors.append({"id": i, "error": str(e)})
    return encoded


def regenerate_dataset(
    target: Target,
    items: list[tuple[str, str | list[dict]]],
    out: str | Path,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    temperature: float = 0.0,
    thinking: str = "none",
    part_size: int = 256,
    progress: bool = True,
    seed: int = 0,
) -> RegenReport:
    """items: (id, prompt text or chat messages). Answers every prompt not already in `out`; returns the
    accounting."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm

    if max_new_tokens <= 0 or batch_size <= 0:
        raise RegenError("max_new_tokens and batch_size must be positive")
    out = _writable(Path(out))
    ids_seen = [i for i, _ in items]
    if len(set(ids_seen)) != len(ids_seen):
        raise RegenError("prompt ids are not unique")
    done = existing_ids(out)
    todo = [(i, p) for i, p in items if i not in done]
    report = RegenReport(input=len(items), ok=0, error=0, skipped=len(items) - len(todo))
    errors: list[dict] = []
    rows: list[dict] = []
    next_part = len(list(out.glob("part-*.parquet")))

    def flush():
        nonlocal rows, next_part
        if not rows:
            return
        table = pa.table({c: [r[c] for r in rows] for c in COLUMNS})
        atomic_write(out / f"part-{next_part:05d}.parquet", lambda p: pq.write_table(table, p))
        next_part += 1
        rows = []

    encoded = _encode(target, todo, max_new_tokens, errors)
    encoded.sort(key=lambda x: len(x[2]))  # similar lengths batch together (less padding)
    bar = tqdm(total=len(todo), desc="regen", disable=not progress)
    bar.update(len(errors))
    for b in range(0, len(encoded), batch_size):
        chunk = encoded[b : b + batch_size]
        try:
            res = _generate_fitting(target, [c[2] for c in chunk], max_new_tokens, temperature, seed + b)
        except (RuntimeError, ValueError) as e:  # e.g. out of memory at a single row: record, carry on
            errors.extend({"id": i, "error": f"{type(e).__name__}: {e}"} for i, _, _ in chunk)
            bar.update(len(chunk))
            continue
        for (i, p, ids), (resp, reason) in zip(chunk, res):
            rows.append(
                {
                    "id": i,
                    "prompt": p if isinstance(p, str) else json.dumps(p),
                    "thinking": thinking,
                    "prompt_ids": ids,
                    "response_ids": resp,
                    "response_text": target.decode(resp),
                    "finish_reason": reason,
                }
            )
        if len(rows) >= part_size:
            flush()
        bar.update(len(chunk))
    flush()
    bar.close()
    report.ok = len(todo) - len(errors)
    report.error = len(errors)
    report.check()
    if errors:
        with open(out / "errors.jsonl", "a") as f:
            for e in errors:
                f.write(json.dumps(e) + "\n")
    manifest = {
        **report.__dict__,
        "target": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "thinking": thinking,
        "answered_total": len(done) + report.ok,
    }
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return report


def workload_items(
    workload: str, limit: int | None = None, max_chars: int | None = None, suffix: str = ""
) -> list[tuple[str, str | list[dict]]]:
    """(id, prompt) of a workload's prompts (`dspine.workloads.load_pools`: "a+b" joins pools, the limit per
    pool), ids "<pool>/<index in the pool><suffix>": a prompt keeps its id when the limit grows or other pools are
    joined, so a regeneration resumed under a larger recipe answers only what is new."""
    from dspine.workloads import load_pools

    return [
        (f"{pool}/{i}{suffix}", p)
        for pool, prompts in load_pools(workload, limit=limit, max_chars=max_chars)
        for i, p in enumerate(prompts)
    ]


def pack_dataset(src: str | Path, dest: str | Path, max_bytes: int = 15_000_000) -> list[Path]:
    """A regen folder's compact copy, to carry between machines: the same rows in the same order (so training
    draws the same held-out split), token ids as uint16 when the vocabulary fits, the text columns emptied,
    zstd parts of at most `max_bytes`. The copy is a regen folder itself: training reads it, regen skips its
    prompts. Returns the files written (parts, manifest, errors)."""
    import io
    import shutil

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    src, dest = Path(src), Path(dest)
    parts = sorted(src.glob("part-*.parquet"))
    if not parts:
        raise RegenError(f"{src}: no regenerated data (part-*.parquet) to pack")
    if dest.exists() and any(dest.iterdir()):
        raise RegenError(f"{dest}: not empty; pack into a new folder")
    # permissive: a packed set that regeneration went on answering mixes packed (uint16) and fresh (int64) ids
    table = pa.concat_tables([pq.read_table(p) for p in parts], promote_options="permissive")
    top = max(pc.max(pc.list_flatten(table[c])).as_py() or 0 for c in ("prompt_ids", "response_ids"))
    ids_type = pa.list_(pa.uint16() if top < 2**16 else pa.int32())
    for c in ("prompt", "response_text"):
        table = table.set_column(table.schema.get_field_index(c), c, pa.array([""] * len(table), pa.string()))
    for c in ("prompt_ids", "response_ids"):
        table = table.set_column(table.schema.get_field_index(c), c, table[c].cast(ids_type))

    def encoded(t) -> bytes:
        buf = io.BytesIO()
        pq.write_table(t, buf, compression="zstd", compression_level=19)
        return buf.getvalue()

    pieces = 1
    while True:  # fewest equal row slices whose files all fit
        step = -(-len(table) // pieces)
        blobs = [encoded(table.slice(i, step)) for i in range(0, len(table), step)]
        if max(map(len, blobs)) <= max_bytes:
            break
        if step == 1:
            raise RegenError(f"{src}: a single row packs to more than {max_bytes} bytes")
        pieces = max(pieces + 1, int(pieces * max(map(len, blobs)) / max_bytes) + 1)
    dest.mkdir(parents=True, exist_ok=True)
    out = [
        atomic_write(dest / f"part-{k:05d}.parquet", lambda p, b=b: Path(p).write_bytes(b)) for k, b in enumerate(blobs)
    ]
    manifest = json.loads((src / "manifest.json").read_text()) if (src / "manifest.json").is_file() else {}
    out.append(atomic_write_text(dest / "manifest.json", json.dumps({**manifest, "packed": True}, indent=1) + "\n"))
    if (src / "errors.jsonl").is_file():
        out.append(atomic_write(dest / "errors.jsonl", lambda p: shutil.copyfile(src / "errors.jsonl", p)))
    return out


def load_samples(path: str | Path, min_response: int = 1) -> list[tuple[list[int], int]]:
    """A regen folder -> [(prompt + response ids, index of the first response token)]."""
    import pyarrow.parquet as pq

    path = Path(path)
    parts = sorted(path.glob("part-*.parquet"))
    if not parts:
        raise RegenError(f"{path}: no regenerated data (part-*.parquet); run `dspine regen` first")
    out = []
    for part in parts:
        t = pq.read_table(part, columns=["prompt_ids", "response_ids"])
        for p, r in zip(t.column("prompt_ids").to_pylist(), t.column("response_ids").to_pylist()):
            if len(r) >= min_response:
                out.append((list(p) + list(r), len(p)))
    return out
