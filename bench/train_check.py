"""Training check (issue #4): the same small transformer trained with portattn and with SDPA.

    python bench/train_check.py [--steps 300] [--out bench/results/latest]

A 2-layer causal language model (d_model 512, 8 heads of 64, bf16 attention,
fp32 weights and AdamW) learns a synthetic task with structure: sequences from a
fixed random first-order Markov chain over 256 tokens with a few copied spans,
so the loss has somewhere to go. Both runs start from the same weights and see
the same batches in the same order; only the attention call differs
(portattn.flash_attn_func vs torch SDPA with the flash backend allowed to be
chosen freely). The curves must agree within run-to-run noise: the report
gives the mean |difference| of the smoothed curves against the spread of
SDPA's own curve, and the final losses.
Writes <out>/train_check.{json,md,png} through peers.write_results.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import peers
import portattn

VOCAB, D_MODEL, HEADS, LAYERS, SEQLEN, BATCH = 256, 512, 8, 2, 512, 16


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x):
        batch, seqlen, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seqlen, 3, HEADS, D_MODEL // HEADS)
        q, k, v = qkv.to(torch.bfloat16).unbind(2)  # (B, S, H, D) views of one packed tensor
        y = self.attention(q, k, v).reshape(batch, seqlen, D_MODEL).float()
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


def portattn_attention(q, k, v):
    return portattn.flash_attn_func(q, k, v, causal=True)


def sdpa_attention(q, k, v):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True)
    return out.transpose(1, 2)


class Model(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQLEN, D_MODEL) * 0.02)
        self.blocks = nn.ModuleList(Block(attention) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_batches(steps, device):
    generator = torch.Generator(device="cpu").manual_seed(1234)
    # Sparse random transition table: each token has 4 likely successors.
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=generator)
    batches = []
    for _ in range(steps):
        tokens = torch.empty(BATCH, SEQLEN + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=generator)
        choice = torch.randint(0, 4, (BATCH, SEQLEN), generator=generator)
        for t in range(SEQLEN):
            tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
        # A copied span: attention must look back to predict it.
        start, span = SEQLEN // 2, SEQLEN // 8
        tokens[:, start : start + span] = tokens[:, 16 : 16 + span]
        batches.append(tokens.to(device))
    return batches


def train(model, batches, lr):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def smooth(values, window=20):
    out, acc = [], 0.0
    for index, value in enumerate(values):
        acc += value
        if index >= window:
            acc -= values[index - window]
        out.append(acc / min(index + 1, window))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default=peers.LATEST)
    parser.add_argument("--replot", metavar="JSON", help="only redraw the PNG from a saved train_check.json")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as handle:
            plot(json.load(handle), os.path.join(args.out, "train_check.png"))
        return
    torch.manual_seed(0)
    batches = make_batches(args.steps, "cuda")
    reference = Model(sdpa_attention).cuda()
    ours = copy.deepcopy(reference)
    for block in ours.blocks:
        block.attention = portattn_attention
    curves = {"sdpa": train(reference, batches, args.lr), "portattn": train(ours, batches, args.lr)}
    sdpa_s, ours_s = smooth(curves["sdpa"]), smooth(curves["portattn"])
    tail = slice(args.steps // 2, None)
    gap = sum(abs(a - b) for a, b in zip(sdpa_s[tail], ours_s[tail])) / len(sdpa_s[tail])
    # Noise scale: how far SDPA's raw losses sit from their own smoothed curve.
    noise = math.sqrt(sum((a - b) ** 2 for a, b in zip(curves["sdpa"][tail], sdpa_s[tail])) / len(sdpa_s[tail]))
    result = {
        **peers.header(dry_run=False),
        "title": "Training check: the same small transformer trained with portattn and with SDPA",
        "config": dict(vocab=VOCAB, d_model=D_MODEL, heads=HEADS, layers=LAYERS, seqlen=SEQLEN,
                       batch=BATCH, steps=args.steps, lr=args.lr),
        "losses": curves,
        "final_smoothed": {"sdpa": sdpa_s[-1], "portattn": ours_s[-1]},
        "mean_abs_gap_second_half": gap,
        "sdpa_noise_rms": noise,
        "agree": gap <= noise,
    }
    summary = (f"train_check: first loss sdpa {curves['sdpa'][0]:.4f} portattn {curves['portattn'][0]:.4f}; "
               f"final (smoothed) sdpa {sdpa_s[-1]:.4f} portattn {ours_s[-1]:.4f}; mean |gap| over the second "
               f"half {gap:.4f} vs SDPA noise rms {noise:.4f} -> {'agree' if result['agree'] else 'DIFFER'}")
    peers.write_results(result, args.out, "train_check", [summary], plot=plot)
    print(summary)


def plot(result, path):
    curves = result["losses"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("sdpa", "tab:blue"), ("portattn", "tab:orange")):
        ax.plot(curves[name], color=color, alpha=0.25)
        ax.plot(smooth(curves[name]), color=color, label=f"{name} (smoothed)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"train_check: {result['device']} {result['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
