#!/usr/bin/env python3
"""One training step of Tessera's decoder written in PyTorch eager: the baseline of
bench/torch_compare, which runs it in the same job and prints the ratio.

The model is nn::Decoder layer for layer: token embedding, n_layers blocks of
(RMSNorm, grouped-query causal attention with rotary embeddings on pairs (2i, 2i+1),
RMSNorm, SwiGLU feed-forward) with residuals, a final RMSNorm and an output projection,
all without biases; cross-entropy over every token; AdamW (lr 1e-3, weight decay 1e-2).
float32 with TF32 off, as Tessera computes. Prints one JSON line:
{"torch": version, "device": ..., "parameters": ..., "median_ms": ..., "step_ms": [...]}.
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * rstd * self.weight


def rope_tables(max_seq, head_dim, theta, device):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rope(x, cos, sin):
    # x [B, T, H, D]; pairs (2i, 2i+1) rotated by the angle of (t, i).
    t = x.size(1)
    c = cos[:t].view(1, t, 1, -1)
    s = sin[:t].view(1, t, 1, -1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg, device):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.cos, self.sin = rope_tables(cfg.seq, self.head_dim, 10000.0, device)

    def forward(self, x):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, self.n_heads, self.head_dim), self.cos, self.sin)
        k = rope(self.wk(x).view(b, t, self.n_kv, self.head_dim), self.cos, self.sin)
        v = self.wv(x).view(b, t, self.n_kv, self.head_dim)
        groups = self.n_heads // self.n_kv
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg, device):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, 1e-6)
        self.attention = Attention(cfg, device)
        self.ffn_norm = RMSNorm(cfg.dim, 1e-6)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, cfg, device):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, device) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, 1e-6)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--n-heads", dest="n_heads", type=int, required=True)
    p.add_argument("--n-kv-heads", dest="n_kv_heads", type=int, required=True)
    p.add_argument("--ffn-dim", dest="ffn_dim", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    cfg = p.parse_args()

    torch.set_num_threads(cfg.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(7)
    device = torch.device(cfg.device)
    model = Decoder(cfg, device).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), device=device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for s in range(cfg.warmup + cfg.steps):
        sync()
        t0 = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, cfg.vocab), targets.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if s >= cfg.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    if not math.isfinite(loss.item()):
        print("decoder_step.py: the loss is not finite", file=sys.stderr)
        return 1
    print(json.dumps({"torch": torch.__version__, "device": str(device),
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "median_ms": statistics.median(times),
                      "step_ms": [round(t, 3) for t in times]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
