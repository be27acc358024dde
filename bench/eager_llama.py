#!/usr/bin/env python3
"""PyTorch 2 reference of ctitan's Llama 3 training step (the venv's PyTorch 2.13).

Written for bench/perf.sh: the same model (torchtitan's Llama 3 layout and parameter names,
so ctitan's consolidated export loads with load_state_dict), the same loss (token-mean
cross-entropy on float32 logits), AdamW (fused, torchtitan's default implementation) and
gradient-norm clipping, run the way a torchtitan user runs it on a CPU: attention through
F.scaled_dot_product_attention (is_causal, GQA without repeat_kv copies), bf16 through
torch.autocast("cpu", torch.bfloat16), and optionally:
  --compile   each transformer block under torch.compile (inductor), as torchtitan's
              compile.enable does;
  --fsdp      FSDP2: fully_shard on every block, then the root, over Gloo; bf16 as
              MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) instead of autocast,
              as torchtitan does. Start it with torchrun; tokens/s is summed over the ranks.
  --device cuda  on one GPU (scripts/gpu_check.sh's benchmark): model, batch and fused AdamW
              there, bf16 through torch.autocast("cuda"); the timed steps end with a device
              synchronisation (each step's loss.item()), peak CUDA memory reported.

Two modes:
  speed:  random tokens, --warmup steps untimed, then --steps timed; prints one JSON line
          (--profile PATH: then one more step under torch.profiler, its trace written to PATH).
  parity: --weights <ctitan export .pt> --windows <CTITAN_TRACE_WINDOWS file>
          --lrs <comma-separated per-step learning rates>; prints the per-step losses.
"""
import argparse
import json
import os
import resource
import time

import torch
import torch.nn.functional as F
from torch import nn


def ffn_hidden(dim, multiple_of=256):
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def rope_table(head_dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex64 [end, hd/2]


def rotate(x, table):
    # Meta's interleaved pairs: (x[2i], x[2i+1]) as one complex number.
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * table[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x, table):
        B, T, _ = x.shape
        q = rotate(self.wq(x).view(B, T, -1, self.hd), table)
        k = rotate(self.wk(x).view(B, T, -1, self.hd), table)
        v = self.wv(x).view(B, T, -1, self.hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention = Attention(a.dim, a.heads, a.kv_heads)
        # Callers that import this module build `a` themselves, without ffn_hidden
        # (scripts/dcp_torchtitan.py): torchtitan's width from dim then.
        self.feed_forward = FeedForward(a.dim, getattr(a, "ffn_hidden", 0) or ffn_hidden(a.dim))
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, table):
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)
        self.register_buffer("freqs_cis", rope_table(a.dim // a.heads, a.seq, a.rope_theta), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for blk in self.layers:
            h = blk(h, self.freqs_cis)
        return self.output(self.norm(h))


def shard(model, args):
    """FSDP2 as torchtitan applies it: every block, then the root. Returns the world size."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
                              reduce_dtype=torch.float32)
    for blk in model.layers:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return dist.get_world_size()


def train_step(model, opt, inputs, labels, args, lr=None):
    if lr is not None:
        for g in opt.param_groups:
            g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16" and not args.fsdp):
        logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
    opt.step()
    return loss.item(), norm.item()


def read_windows(path, batch, seq):
    """CTITAN_TRACE_WINDOWS lines: step, seq input ids, last label. Returns {step: (inputs, labels)}."""
    by_step = {}
    with open(path) as f:
        for line in f:
            vals = [int(v) for v in line.split()]
            by_step.setdefault(vals[0], []).append(vals[1:])
    out = {}
    for step, rows in by_step.items():
        assert len(rows) == batch, f"step {step}: {len(rows)} windows, expected {batch}"
        toks = torch.tensor(rows, dtype=torch.long)  # [B, T+1]
        out[step] = (toks[:, :seq].contiguous(), toks[:, 1:].contiguous())
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--norm-eps", type=float, default=1e-5)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--weights", help="ctitan consolidated export (.pt): parity mode")
    p.add_argument("--windows", help="CTITAN_TRACE_WINDOWS file of the ctitan run: parity mode")
    p.add_argument("--lrs", help="comma-separated learning rate of each step: parity mode")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (inductor)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over Gloo (start with torchrun)")
    p.add_argument("--ffn-hidden", type=int, default=0, help="FFN width (default: torchtitan's from dim)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--profile", help="speed mode: one more step after the timed ones under torch.profiler "
                   "(CPU ops, and CUDA kernels on a GPU), its Chrome trace written here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Llama(args)
    opt_kw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)
    world = 1
    if args.fsdp:
        world = shard(model, args)
    if args.compile:  # per block, as torchtitan's apply_compile
        for i, blk in enumerate(model.layers):
            model.layers[i] = torch.compile(blk)

    if args.weights:  # parity: ctitan's weights, ctitan's batches, ctitan's learning rates
        state = torch.load(args.weights)
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        opt = torch.optim.AdamW(model.parameters(), **opt_kw)
        windows = read_windows(args.windows, args.batch, args.seq)
        lrs = [float(v) for v in args.lrs.split(",")]
        losses = []
        for step in range(1, len(lrs) + 1):
            inputs, labels = windows[step]
            loss, norm = train_step(model, opt, inputs, labels, args, lr=lrs[step - 1])
            losses.append({"step": step, "loss": loss, "grad_norm": norm})
        print(json.dumps({"losses": losses}))
        return

    for prm in model.parameters():  # speed only: torchtitan-like scales
        nn.init.normal_(prm, std=0.02) if prm.dim() > 1 else None
    model.to(args.device)
    opt = torch.optim.AdamW(model.parameters(), fused=not args.fsdp, **opt_kw)
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    inputs, labels = toks[:, :-1].contiguous().to(args.device), toks[:, 1:].contiguous().to(args.device)
    for _ in range(args.warmup):
        train_step(model, opt, inputs, labels, args)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss, _ = train_step(model, opt, inputs, labels, args)
    dt = (time.perf_counter() - t0) / args.steps
    if args.profile:  # after the timing, so the numbers above are unprofiled
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            train_step(model, opt, inputs, labels, args)
            if args.device == "cuda":
                torch.cuda.synchronize()
        prof.export_chrome_trace(args.profile)
    if args.fsdp and int(os.environ["RANK"]) != 0:
        return
    out = {
        "tokens_per_s": world * args.batch * args.seq / dt,
        "step_s": dt,
        "loss": loss,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if args.device == "cuda":
        out["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        out["peak_gpu_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(out))


if __name__ == "__main__":
    main()
