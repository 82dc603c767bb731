"""Hugging Face generate() tokens/s: attn_implementation="portattn" vs "sdpa" vs "eager".

  python bench/bench_hf_generate.py [--quick] [--budget-s 450] [--out DIR] [--dry-run]

A Llama-style model with random weights from a config (no download): 8 layers, hidden 2048,
16 query / 4 KV heads (head dim 128), bf16. For each (batch, prompt) cell and each cache mode:
- eager_dynamic: generate() with the default DynamicCache, no compilation;
- static_compile: cache_implementation="static"; generate() compiles the decode step itself
  (CompileConfig(): inductor, mode="reduce-overhead", i.e. CUDA graphs);
`warm` is the fastest of --repeats generate() calls after the first of the same shapes in one
process (compiled graphs, caches and allocator warm), the implementations called in turn; `cold` is the first generate() of a fresh process (imports excluded,
compilation included), run for the --cold cells only (a process each). tokens/s = batch x
new tokens / generate()'s wall time. Cells past --budget-s are n/a with that reason, as are
out-of-memory ones (eager attention materialises batch x heads x prompt^2 scores).

Results: <out>/hf_generate.{json,md,png} through bench/peers.py's writer (device, date,
commit in each). --dry-run: a tiny float32 model on the CPU, two steps, the compile mode on
dynamo's "eager" backend: exercises every path and the writer; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peers  # noqa: E402

MODES = ("eager_dynamic", "static_compile")
IMPLS = ("portattn", "sdpa", "eager")


def model_config(dry_run: bool):
    import transformers

    if dry_run:
        return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=16384,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build(impl: str, dry_run: bool):
    from transformers import AutoModelForCausalLM

    if impl == "portattn":
        import portattn.integrations.transformers as pt_hf

        pt_hf.register()
    torch.manual_seed(0)
    device, dtype = ("cpu", torch.float32) if dry_run else ("cuda", torch.bfloat16)
    model = AutoModelForCausalLM.from_config(model_config(dry_run), attn_implementation=impl, dtype=dtype)
    return model.to(device).eval()


def generate_once(model, batch: int, prompt: int, new_tokens: int, mode: str, dry_run: bool) -> float:
    """Seconds of one generate() call (random prompt, no padding, exactly new_tokens tokens)."""
    from transformers import CompileConfig

    device = model.device
    generator = torch.Generator().manual_seed(batch * 7919 + prompt)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=generator).to(device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if mode == "static_compile":
        kwargs["cache_implementation"] = "static"
        if dry_run:  # CPU: dynamo's eager backend, no CUDA graphs
            config = CompileConfig(backend="eager", mode=None)
            config._compile_all_devices = True
            kwargs["compile_config"] = config
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**kwargs)
    sync()
    elapsed = time.perf_counter() - start
    assert out.shape == (batch, prompt + new_tokens), out.shape
    return elapsed


def warm_cells(impls, models, mode, batch, prompt, new_tokens, dry_run, repeats, na) -> dict:
    """{impl: seconds} of one (mode, batch, prompt) cell in this process for each impl: each
    model's first call, then `repeats` rounds calling the implementations in turn, the fastest
    call of each counting. A decode step is host-bound at small batches and the host's speed
    drifts by 10-20% over seconds, so the implementations alternate rather than run one after
    the other. A failed call (out of memory, a compile error) makes that impl's cell n/a in `na`."""
    def attempt(impl):
        try:
            return generate_once(models[impl], batch, prompt, new_tokens, mode, dry_run)
        except Exception as error:  # an n/a cell with its reason
            na[impl] = _reason(error)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None

    if mode == "static_compile":
        _allow_a_compile_per_cell()
    alive = [impl for impl in impls if attempt(impl) is not None]
    best = {}
    for _ in range(max(1, repeats)):
        for impl in list(alive):
            seconds = attempt(impl)
            if seconds is None:
                alive.remove(impl)
                best.pop(impl, None)
            else:
                best[impl] = min(seconds, best.get(impl, math.inf))
    return best


def _allow_a_compile_per_cell() -> None:
    """Each static cell compiles transformers' decode step for its shapes, and every model shares
    that one code object, so the cells of one process would pass dynamo's recompile limit (8)
    and the later ones would silently run uncompiled. Raised so each cell gets its own graph."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 256))


def cold_cell(impl, mode, batch, prompt, new_tokens, dry_run, timeout_s) -> float:
    """The first generate() of a fresh process (this script with --single)."""
    spec = json.dumps(dict(impl=impl, mode=mode, batch=batch, prompt=prompt, new_tokens=new_tokens, dry_run=dry_run))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--single", spec], capture_output=True,
                          text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError((done.stderr or done.stdout).strip().splitlines()[-1][:300])
    return json.loads(done.stdout.strip().splitlines()[-1])["first_s"]


def run_single(spec: str) -> None:
    cell = json.loads(spec)
    model = build(cell["impl"], cell["dry_run"])
    seconds = generate_once(model, cell["batch"], cell["prompt"], cell["new_tokens"], cell["mode"], cell["dry_run"])
    print(json.dumps({"first_s": seconds}))


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def markdown(result) -> list:
    lines = [f"{result['new_tokens']} new tokens per sequence; tokens/s = batch x new tokens / generate() time "
             f"(warm: the fastest of {result.get('repeats', 1)} calls after the first"
             f"{', the implementations called in turn' if result.get('interleaved') else ''}). "
             "portattn / SDPA > 1 means portattn is faster.", ""]
    for when in ("warm", "cold"):
        rows = [r for r in result["rows"] if when in r["tokens_per_s"]]
        if not rows:
            continue
        lines += [f"## {when.capitalize()} tokens/s", "",
                  "| mode | batch | prompt | " + " | ".join(result["impls"]) + " | portattn / SDPA |",
                  "|---|---|---|" + "---|" * (len(result["impls"]) + 1)]
        for row in rows:
            cells = row["tokens_per_s"][when]
            values = [peers.fmt_num(cells.get(name)) if cells.get(name) is not None else "n/a"
                      for name in result["impls"]]
            ours, sdpa = cells.get("portattn"), cells.get("sdpa")
            ratio = f"{ours / sdpa:.2f}x" if ours and sdpa else "n/a"
            lines.append(f"| {row['mode']} | {row['batch']} | {row['prompt']} | " + " | ".join(values) + f" | {ratio} |")
        lines.append("")
    reasons = sorted({f"{name} ({r['mode']}, {r['batch']}x{r['prompt']}, {when}): {why}"
                      for r in result["rows"] for when, per in r["na"].items() for name, why in per.items()})
    if reasons:
        lines += ["n/a cells:", ""] + [f"- {text}" for text in reasons]
    return lines


def plot(result, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["rows"] if "warm" in r["tokens_per_s"]]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.8 / len(result["impls"])
    for i, name in enumerate(result["impls"]):
        ys = [r["tokens_per_s"]["warm"].get(name) or math.nan for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], ys, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([f"{r['mode']}\n{r['batch']}x{r['prompt']}" for r in rows], fontsize=7)
    ax.set_ylabel("warm tokens/s")
    ax.legend(fontsize=8)
    ax.set_title(f"generate(), {result['device']} {result['date']} ({result['commit']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Defaults by run kind (full / --quick / --dry-run); an explicit value always wins.
    parser.add_argument("--batches", default=None, help="full: 8,1,32; quick: 8,1; dry run: 2")
    parser.add_argument("--prompts", default=None, help="full: 1024,8192; quick: 1024; dry run: 16")
    parser.add_argument("--new-tokens", type=int, default=None, help="full: 128; quick: 64; dry run: 3")
    parser.add_argument("--impls", default=None, help="full, dry run: portattn,sdpa,eager; quick: portattn,sdpa")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--cold", default=None,
                        help="batch x prompt cells also run in a fresh process ('' none); full, quick: 8x1024")
    parser.add_argument("--budget-s", type=float, default=450.0, help="cells starting past this are n/a")
    parser.add_argument("--repeats", type=int, default=None,
                        help="warm generate() calls per cell, the fastest counts; full, quick: 3; dry run: 1")
    parser.add_argument("--quick", action="store_true", help="batches 8,1; prompt 1024; 64 new tokens; no eager")
    parser.add_argument("--out", default=peers.LATEST)
    parser.add_argument("--name", default="hf_generate")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--single", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.single:
        run_single(args.single)
        return 0
    peers.require_device(args.dry_run)
    kind = "dry_run" if args.dry_run else "quick" if args.quick else "full"
    defaults = {"full": ("8,1,32", "1024,8192", 128, ",".join(IMPLS), "8x1024", 3),
                "quick": ("8,1", "1024", 64, "portattn,sdpa", "8x1024", 3),
                "dry_run": ("2", "16", 3, ",".join(IMPLS), "2x16", 1)}[kind]
    for name, value in zip(("batches", "prompts", "new_tokens", "impls", "cold", "repeats"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    impls = [name for name in args.impls.split(",") if name]
    modes = [mode for mode in args.modes.split(",") if mode]
    cold = {tuple(int(x) for x in cell.split("x")) for cell in args.cold.split(",") if cell}
    result = dict(peers.header(args.dry_run), title="generate() tokens/s: portattn vs SDPA vs eager (transformers)",
                  impls=impls, modes=modes, new_tokens=args.new_tokens, rows=[], budget_s=args.budget_s,
                  repeats=args.repeats, interleaved=True)
    try:
        import transformers

        result["versions"] = dict(result.get("versions", {}), transformers=transformers.__version__)
    except ImportError as error:
        raise SystemExit(f"bench_hf_generate needs transformers: {error}")
    begin = time.perf_counter()
    models = {}
    for prompt in peers.parse_ints(args.prompts):
        for batch in peers.parse_ints(args.batches):
            for mode in modes:
                row = dict(mode=mode, batch=batch, prompt=prompt, tokens_per_s={"warm": {}}, seconds={}, na={})
                if time.perf_counter() - begin > args.budget_s:
                    row["na"]["warm"] = {impl: f"time budget ({args.budget_s:.0f} s) spent" for impl in impls}
                else:
                    for impl in impls:
                        if impl not in models:
                            models[impl] = build(impl, args.dry_run)
                    na = {}
                    warm = warm_cells(impls, models, mode, batch, prompt, args.new_tokens, args.dry_run,
                                      args.repeats, na)
                    if na:
                        row["na"]["warm"] = na
                    for impl, seconds in warm.items():
                        row["seconds"].setdefault("warm", {})[impl] = seconds
                        row["tokens_per_s"]["warm"][impl] = batch * args.new_tokens / seconds
                for impl in impls if (batch, prompt) in cold else ():
                    spent = time.perf_counter() - begin
                    if spent > args.budget_s:
                        row["na"].setdefault("cold", {})[impl] = f"time budget ({args.budget_s:.0f} s) spent"
                        continue
                    try:
                        seconds = cold_cell(impl, mode, batch, prompt, args.new_tokens, args.dry_run,
                                            max(30.0, args.budget_s - spent + 60.0))
                    except Exception as error:  # OOM, compile failure, timeout: an n/a cell with its reason
                        row["na"].setdefault("cold", {})[impl] = _reason(error)
                        continue
                    row["seconds"].setdefault("cold", {})[impl] = seconds
                    row["tokens_per_s"].setdefault("cold", {})[impl] = batch * args.new_tokens / seconds
                result["rows"].append(row)
                print(markdown(dict(result, rows=[row]))[-2] if row["tokens_per_s"]["warm"] else row, flush=True)
    result["wall_s"] = time.perf_counter() - begin
    lines = markdown(result)
    peers.write_results(result, args.out, args.name, extra_markdown=lines, plot=plot)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
