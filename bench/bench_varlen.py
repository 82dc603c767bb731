"""Packed sequences (cu_seqlens, issue #11): forward and forward+backward of varlen calls.

  python bench/bench_varlen.py [--head-dims 64,128] [--impls ...] [--out DIR] [--dry-run]

The shape of padding-free fine-tuning (HF transformers packs a batch's documents into one row
and calls flash_attn_varlen_func): 16k tokens per call, hidden 2048 (16 heads x 128 or 32 x 64),
bf16, documents of
  - equal length (16 x 1k, 4 x 4k): the same work as a dense batch, so SDPA's dense kernels
    (cuDNN, flash) on that batch are the yardstick a user would compare with;
  - mixed lengths (a fixed-seed draw between 64 and 4096 tokens): only varlen kernels and
    FlexAttention with a document mask can run it without padding.
Columns: portattn through the public API (the Hopper path on an H100), the sm80+ path forced
(what varlen training ran before the Hopper backward took varlen), SDPA cuDNN / flash on the
equal-length batch, FlexAttention (compiled, document block mask), torch's own varlen_attn
where this torch has it
(FlashAttention-2's varlen kernel, what SDPA flash runs for dense calls). TFLOP/s count 4 * H * D * sum(L^2) per forward (halved for causal),
backward 2.5x the forward. Results: <out>/varlen.{json,md,png}.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import random
import time

import torch

import peers

TOKENS = 16384
SCENARIOS = {
    "equal 16x1k": [1024] * 16,
    "equal 4x4k": [4096] * 4,
}
MIXED = "mixed 64-4096"
# Many short documents (BERT-style fine-tuning, padding-free): 64k tokens in documents of 32-300,
# where the hd64 forward's tile choice matters (Note [portattn hopper short calls on narrow tiles]).
SHORT = "short 32-300"
SHORT_TOKENS = 65536


def mixed_lengths(total: int = TOKENS, seed: int = 0, shortest: int = 64, longest: int = 4096) -> list:
    """Document lengths between `shortest` and `longest` (log-uniform draw, fixed seed) summing to `total`."""
    rng = random.Random(seed)
    lengths, left = [], total
    while left > 0:
        length = min(left, int(round(math.exp(rng.uniform(math.log(shortest), math.log(longest))))))
        if 0 < left - length < shortest:  # no document shorter than `shortest` at the end either
            length = left if left <= longest else left - shortest
        lengths.append(length)
        left -= length
    return lengths


def scenarios(dry_run: bool, only: str = "") -> dict:
    chosen = dict(SCENARIOS, **{MIXED: mixed_lengths(),
                                SHORT: mixed_lengths(SHORT_TOKENS, seed=1, shortest=32, longest=300)})
    if only:
        chosen = {name: lengths for name, lengths in chosen.items() if any(part in name for part in only.split(","))}
    if dry_run:  # CPU proxy: the reference backend is O(L^2) in time
        chosen = {name: [min(length, 48) for length in lengths[:3]] for name, lengths in chosen.items()}
    return chosen


def flops(lengths, heads, head_dim, causal, mode) -> float:
    forward = 4 * heads * head_dim * sum(length * length for length in lengths) / (2 if causal else 1)
    return forward * (1 + peers.BWD_FACTOR) if mode == "fwd_bwd" else forward


# ---- implementations: bind(q, k, v, lengths, cu, causal) -> call returning (total, H, D) -------

def _bind_portattn():
    import portattn

    def bind(q, k, v, lengths, cu, causal):
        longest = max(lengths)
        return lambda: portattn.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
    return bind


def _equal(lengths):
    if len(set(lengths)) != 1:
        raise ValueError("documents of different lengths: no dense batch does the same work")


def _bind_sdpa_dense():
    import torch.nn.functional as F

    def bind(q, k, v, lengths, cu, causal):
        _equal(lengths)
        n, length = len(lengths), lengths[0]
        qt, kt, vt = (x.view(n, length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2).reshape(q.shape)
    return bind


def _bind_flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Every (scenario, head dim, mask) is a new static shape: with the short-documents scenario the
    # grid passes dynamo's default limit of 8 recompiles (past it, hd128's cells went n/a).
    import torch._dynamo

    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)

    def bind(q, k, v, lengths, cu, causal):
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                      torch.tensor(lengths, device=q.device))

        def document(b, h, q_idx, kv_idx):
            same = doc[q_idx] == doc[kv_idx]
            return same & (q_idx >= kv_idx) if causal else same

        total = q.shape[0]
        mask = create_block_mask(document, None, None, total, total, device=q.device)
        qt, kt, vt = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
        return lambda: compiled(qt, kt, vt, block_mask=mask).transpose(1, 2).squeeze(0)
    return bind


def _bind_torch_varlen():
    import inspect

    from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10 (FlashAttention-2 inside); n/a before

    # 2.10 took is_causal=; 2.11 and later take window_size=(-1, 0) for causal instead.
    takes_window = "window_size" in inspect.signature(varlen_attn).parameters

    def bind(q, k, v, lengths, cu, causal):
        longest = max(lengths)
        mask = (dict(window_size=(-1, 0 if causal else -1)) if takes_window else dict(is_causal=causal))
        return lambda: varlen_attn(q, k, v, cu, cu, longest, longest, **mask)
    return bind


IMPLS = {impl.name: impl for impl in (
    peers.Impl("portattn", "portattn varlen", "pa", _bind_portattn,
               lambda: peers._portattn_forced(None)),
    peers.Impl("portattn_sm80", "portattn varlen, sm80+ path (forced)", "sm80", _bind_portattn,
               lambda: peers._portattn_forced("cuda")),
    peers.Impl("sdpa_cudnn", "SDPA cuDNN (dense batch, equal lengths)", "cudnn", _bind_sdpa_dense,
               lambda: peers._sdpa_context("CUDNN_ATTENTION")),
    peers.Impl("sdpa_flash", "SDPA flash (dense batch, equal lengths)", "fa2", _bind_sdpa_dense,
               lambda: peers._sdpa_context("FLASH_ATTENTION")),
    peers.Impl("flex", "FlexAttention (document mask, compiled)", "flex", _bind_flex),
    peers.Impl("torch_varlen", "torch varlen_attn", "tvar", _bind_torch_varlen),
)}
RATIO_PEERS = ("sdpa_cudnn", "torch_varlen", "flex", "portattn_sm80")
DRY_IMPLS = ("portattn",)  # the CPU has the reference backend only


def measure(impl, mode, bound_inputs, lengths, causal, timer, work, salt):
    bind, why = _load(impl.name)
    if bind is None:
        return None, why
    q, k, v, cu, dout = bound_inputs
    try:
        with impl.context():
            return peers.time_call(lambda q, k, v: bind(q, k, v, lengths, cu, causal), mode, (q, k, v, dout),
                                   timer, work, salt), None
    except Exception as error:  # one refusing peer is an n/a cell, never the end of the run
        if not timer.dry_run:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        return None, peers._reason(error)


_LOADED: dict = {}


def _load(name):
    if name not in _LOADED:
        try:
            _LOADED[name] = (IMPLS[name].load(), None)
        except Exception as error:
            _LOADED[name] = (None, peers._reason(error))
    return _LOADED[name]


def run(head_dims, impls, timer, dry_run, budget_s=math.inf, modes=tuple(peers.MODES), only=""):
    """Past `budget_s` the remaining cells are n/a (a device call has a hard limit)."""
    start = time.monotonic()
    rows = []
    device = "cpu" if dry_run else "cuda"
    for head_dim in head_dims:
        heads = 2 if dry_run else peers.HIDDEN // head_dim
        for name, lengths in scenarios(dry_run, only).items():
            total = sum(lengths)
            cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
            q, k, v = (torch.randn(total, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)
            for causal in (False, True):
                row = {"scenario": name, "documents": len(lengths), "head_dim": head_dim, "heads": heads,
                       "causal": causal, "tflops": {}, "ms": {}, "na": {}}
                for mode in modes:
                    work = flops(lengths, heads, head_dim, causal, mode)
                    for impl in impls:
                        if time.monotonic() - start > budget_s:
                            ms, why = None, f"not run: the {budget_s:.0f} s time budget was spent"
                        else:
                            ms, why = measure(impl, mode, (q, k, v, cu, dout), lengths, causal, timer, work,
                                              f"{impl.name}/{mode}/{name}/{head_dim}/{causal}")
                        row["ms"].setdefault(mode, {})[impl.name] = ms
                        row["tflops"].setdefault(mode, {})[impl.name] = work / ms / 1e9 if ms else None
                        if why:
                            row["na"].setdefault(mode, {})[impl.name] = why
                rows.append(row)
                print(_line(row, impls), flush=True)
    return rows


def _ratio(row, mode, peer):
    values = row["tflops"].get(mode, {})
    return values["portattn"] / values[peer] if values.get("portattn") and values.get(peer) else None


def _line(row, impls):
    parts = [f"hd{row['head_dim']} {row['scenario']:>14} {'causal' if row['causal'] else 'full  '}"]
    for mode in [m for m in peers.MODES if m in row["tflops"]]:
        cells = [f"{impl.short} {peers.fmt_num(row['tflops'][mode].get(impl.name))}" for impl in impls]
        ratios = [f"pa/{IMPLS[p].short} {peers.fmt_num(_ratio(row, mode, p), 2)}" for p in RATIO_PEERS
                  if p in row["tflops"][mode]]
        parts.append(f"{'f+b' if mode == 'fwd_bwd' else mode}: " + " ".join(cells + ratios))
    return " | ".join(parts)


def markdown(rows, impls) -> list:
    lines = []
    present = [m for m in peers.MODES if rows and m in rows[0]["tflops"]]
    for mode, title in ((m, peers.MODES[m]) for m in present):
        shown = [p for p in RATIO_PEERS if any(p == impl.name for impl in impls)]
        lines += [f"## {title}, TFLOP/s (ratio = portattn / peer)", "",
                  "| hd | documents | causal | " + " | ".join([impl.label for impl in impls]
                                                             + [f"/ {IMPLS[p].short}" for p in shown]) + " |",
                  "|---" * (3 + len(impls) + len(shown)) + "|"]
        for row in rows:
            cells = [peers.fmt_num(row["tflops"][mode].get(impl.name)) for impl in impls]
            ratios = [peers.fmt_num(_ratio(row, mode, p), 2) for p in shown]
            lines.append(f"| {row['head_dim']} | {row['scenario']} | {row['causal']} | " + " | ".join(cells + ratios)
                         + " |")
        lines.append("")
    reasons = {}
    for row in rows:
        for per_mode in row["na"].values():
            for name, why in per_mode.items():
                if why not in reasons.setdefault(name, []):
                    reasons[name].append(why)
    if reasons:
        lines += ["n/a cells:", ""] + [f"- {name}: " + " | ".join(whys[:2]) for name, whys in reasons.items()]
    return lines


def plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["rows"]
    labels = [f"hd{r['head_dim']}\n{r['scenario']}\n{'causal' if r['causal'] else 'full'}" for r in rows]
    modes = [m for m in peers.MODES if rows and m in rows[0]["tflops"]]
    if not modes:
        return
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(8, 1.1 * len(rows)), 7), squeeze=False)
    width = 0.8 / max(1, len(result["impls"]))
    for i, mode in enumerate(modes):
        ax = axes[i][0]
        for j, name in enumerate(result["impls"]):
            ys = [r["tflops"][mode].get(name) or 0.0 for r in rows]
            ax.bar([x + j * width for x in range(len(rows))], ys, width, label=IMPLS[name].label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(f"{peers.MODES[mode]} TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"varlen, {result['device']} {result['date']} ({result['commit']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--out", default=peers.LATEST)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--modes", default=",".join(peers.MODES), help="fwd, fwd_bwd or both")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="cells after this many seconds are n/a")
    parser.add_argument("--scenarios", default="", help="only the scenarios whose names contain one of these "
                                                         "comma-separated parts (e.g. short)")
    parser.add_argument("--name", default="varlen", help="result file name (without extension)")
    args = parser.parse_args(argv)
    peers.require_device(args.dry_run)
    names = [n.strip() for n in (",".join(DRY_IMPLS) if args.dry_run else args.impls).split(",") if n.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        raise SystemExit(f"unknown implementation(s) {unknown}; choose from {', '.join(IMPLS)}")
    impls = [IMPLS[n] for n in names]
    timer = peers.Timer(dry_run=args.dry_run)
    modes = [m.strip() for m in args.modes.split(",") if m.strip() in peers.MODES]
    rows = run(peers.parse_ints(args.head_dims), impls, timer, args.dry_run, args.budget_s, modes, args.scenarios)
    result = dict(peers.header(args.dry_run), title="Packed sequences (varlen), 16k tokens (short: 64k), hidden 2048, bf16",
                  impls=names, rows=rows, lengths={k: v for k, v in scenarios(args.dry_run, args.scenarios).items()},
                  note=f"Mixed lengths (seed 0): {mixed_lengths()}. Short documents: {SHORT_TOKENS} tokens in "
                       f"{len(scenarios(False)[SHORT])} documents of 32-300 (seed 1).")
    path = peers.write_results(result, args.out, args.name, extra_markdown=markdown(rows, impls), plot=plot)
    print("\n".join(markdown(rows, impls)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
