"""Decoding speed and cache size of `nemotron_recipe.generation` against transformers' `generate`.

    python -m benchmarks.decode                       # h1024, batches 1 and 8, fp32 and bf16, 128 new tokens
    python -m benchmarks.decode --batches 1 --dtypes bf16 --new-tokens 32 --prompt-len 32
    python -m benchmarks.decode --device cuda --dtypes bf16 --new-tokens 64 --rounds 1 --no-record

One Hugging Face directory is written from a seeded `transformers.NemotronHForCausalLM` of the
config; ours loads it with `from_pretrained` and theirs with `AutoModelForCausalLM`, so both run the
same weights. Each side generates greedily through its own API (`generate`), EOS off, once with one
new token (the prefill: the prompts' forward and the first token) and once with `--new-tokens`; decode
tokens/s = batch x (new tokens - 1) / (the second time - the first). The two sides alternate for
`--rounds` rounds and report medians, so a machine that other jobs load slows both alike; the
bracketed ratio uses process CPU time, which leaves out time spent waiting for a core.

Cache: the bytes of ours after the last step (its tensors) against the formula (`cache_bytes`: per
Mamba2 block the conv window plus the fp32 SSM state, per attention block 2 x kv heads x head_dim x
length), theirs (every tensor its cache object holds), and the growth of the process's peak resident
set during our timed generation of the last round above the resident set before it (CPU, Linux),
which counts the cache together with the prefill's activations and the logits (on CUDA: the
allocator's peak during that generation above its start).

With `--compile`, ours runs its batch-1 generations with `GenerationConfig(compile=True)` (one-row
steps compiled, `nemotron_recipe/generation/compiled.py`; the compile happens in the warmup); its rows
say "ours compiled". Batches of several rows run as without it.

Ours runs as `generate` does by default: on CPU its linear layers use weights reordered for oneDNN
where that pays (`nemotron_recipe/generation/packed.py`); the reordering is part of each call's
prefill time.

Both sides run with OpenMP's default thread waits (spinning a while before sleeping), as a process
that sets nothing does; `recipes.generate` sets passive waits unless told otherwise, which on an idle
machine makes one-row steps slower (docs/generation.md, "Speed and memory").

Each run appends its rows to benchmarks/RESULTS.md with the exact command (`--no-record` to skip).
"""

from __future__ import annotations

import argparse
import functools
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.measure import _reset_hwm, _rss_hwm, device_name
from benchmarks.results import append_row, measured
from benchmarks.throughput import BENCH_PRESETS
from nemotron_recipe.generation import DecodeCache, GenerationConfig, cache_bytes, generate
from nemotron_recipe.models.nemotron_v3 import NemotronHForCausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADER = ("| date (commit) | device | config | dtype | batch x prompt + new | prefill ours / theirs (s) | "
          "decode tok/s ours | theirs | ours/theirs | cache ours (formula) | theirs | peak RSS growth | command |")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device) -> tuple[float, float]:
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def _tensor_bytes(obj, seen: set[int] | None = None, depth: int = 0) -> int:
    """Bytes of every distinct tensor storage reachable from `obj` (lists, dicts, attributes)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if depth > 4:
        return 0
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if hasattr(obj, "__dict__") else ()
    return sum(_tensor_bytes(v, seen, depth + 1) for v in items)


def _ours(model, prompts: list[list[int]], new: int, compile: bool = False) -> None:
    generate(model, prompts, GenerationConfig(max_new_tokens=new, eos_token_ids=(), batch_size=len(prompts),
                                              compile=compile))


def _theirs(model, ids: torch.Tensor, new: int) -> None:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + new


def _cache_sizes(ours, theirs, ids: torch.Tensor, new: int) -> tuple[int, int, int]:
    """(ours, ours by formula, theirs) once `new` tokens are generated. Ours is allocated for the prompt
    plus the new tokens at the prefill; theirs grows, and holds the prompt and all but the last new token
    at the end, as after one forward of that many positions."""
    cache = DecodeCache(torch.ones_like(ids, dtype=torch.bool), ids.shape[1] + new, len(ours.model.layers))
    longer = torch.cat([ids, ids[:, :1].expand(-1, new - 1)], dim=1)
    with torch.no_grad():
        ours(ids, cache=cache)
        out = theirs(longer, use_cache=True)
    dtype = next(p for n, p in ours.named_parameters() if n.endswith("q_proj.weight")).dtype
    return cache.nbytes(), cache_bytes(ours.config, ids.shape[0], cache.capacity, dtype), \
        _tensor_bytes(out.past_key_values)


def _peak_growth(fn, device: torch.device) -> int | None:
    """Growth of the peak resident set (CUDA: allocated memory) while `fn` runs, above the start."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        return torch.cuda.max_memory_allocated(device) - before
    if not _reset_hwm():
        fn()
        return None
    before = _rss_hwm()
    fn()
    after = _rss_hwm()
    return None if before is None or after is None else after[1] - before[0]


def bench(args, path: Path, dtype_name: str, batch: int) -> str:
    import transformers

    dtype, device = DTYPES[dtype_name], torch.device(args.device)
    ours = NemotronHForCausalLM.from_pretrained(str(path)).to(device=device, dtype=dtype).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    theirs.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, ours.config.vocab_size, (batch, args.prompt_len), generator=g).to(device)
    prompts = ids.tolist()
    times = {k: [] for k in ("ours1", "oursN", "theirs1", "theirsN")}
    cpu = {k: [] for k in times}

    def times_of(key, fn):
        wall, proc = _time(fn, device)
        times[key].append(wall)
        cpu[key].append(proc)

    compiled = args.compile and batch == 1  # `compile` leaves batches of several rows eager
    with torch.no_grad():
        _ours(ours, prompts, 2, compiled)  # warmup (and the compile)
        _theirs(theirs, ids, 2)
        for _ in range(args.rounds):
            for key, fn in (("ours1", lambda: _ours(ours, prompts, 1, compiled)),
                            ("theirs1", lambda: _theirs(theirs, ids, 1)),
                            ("oursN", lambda: _ours(ours, prompts, args.new_tokens, compiled)),
                            ("theirsN", lambda: _theirs(theirs, ids, args.new_tokens))):
                if key == "oursN":
                    growth = _peak_growth(functools.partial(times_of, key, fn), device)
                else:
                    times_of(key, fn)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    steps = batch * (args.new_tokens - 1)
    ours_tps, theirs_tps = steps / (med["oursN"] - med["ours1"]), steps / (med["theirsN"] - med["theirs1"])
    cpu_ratio = (med_cpu["theirsN"] - med_cpu["theirs1"]) / max(med_cpu["oursN"] - med_cpu["ours1"], 1e-9)
    ours_cache, formula, theirs_cache = _cache_sizes(ours, theirs, ids, args.new_tokens)
    command = "python -m benchmarks.decode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    config = f"{args.preset}, ours compiled" if compiled else args.preset
    row = (f"| {measured()} | {device_name(device)} | {config} | {dtype_name} | "
           f"{batch} x {args.prompt_len} + {args.new_tokens} | {med['ours1']:.3f} / {med['theirs1']:.3f} | "
           f"{ours_tps:,.1f} | {theirs_tps:,.1f} | {ours_tps / theirs_tps:.2f}x (cpu {cpu_ratio:.2f}x) | "
           f"{_mib(ours_cache)} ({_mib(formula)}) | {_mib(theirs_cache)} | "
           f"{'n/a' if growth is None else _mib(growth)} | `{command}` |")
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="h1024", choices=sorted(BENCH_PRESETS))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--compile", action="store_true",
                   help="ours with GenerationConfig(compile=True): compiled one-row steps (batch 1 only)")
    p.add_argument("--no-record", dest="record", action="store_false")
    args = p.parse_args(argv)
    import transformers

    cfg = BENCH_PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(args.seed)
        transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg.to_hf_dict())).save_pretrained(tmp)
        for dtype_name in args.dtypes.split(","):
            for batch in map(int, args.batches.split(",")):
                row = bench(args, Path(tmp), dtype_name, batch)
                if args.record:
                    append_row(HEADER, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
