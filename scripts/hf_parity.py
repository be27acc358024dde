#!/usr/bin/python3
"""HF parity: an independent Hugging Face-convention forward of a ctitan HF export.

Reads the export (model.safetensors + config.json) with its own safetensors reader, runs
the model the way HF's LlamaForCausalLM / MixtralForCausalLM compute it (rotate_half RoPE
on the exported, permuted q/k weights, llama3 RoPE scaling, grouped-query attention,
RMSNorm in float32, SwiGLU, Mixtral's top-k router), and compares the logits with the ones
ctitan computed on the same tokens (`checkpoint_tool logits`). Optionally checks that a
consolidated .pt export, read with torch.load, holds the same tensors under ctitan's names
(q/k in ctitan's rotary order).

Uses PyTorch only (the venv's 2.13; no transformers). Run by scripts/hf_parity.sh.

  /usr/bin/python3 scripts/hf_parity.py --hf DIR --logits LOGITS.safetensors [--pt MODEL.pt] [--tol 1e-5]
"""
import argparse
import json
import math
import os
import re
import struct
import sys

import torch

DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
          "F64": (torch.float64, 8), "I64": (torch.int64, 8), "I32": (torch.int32, 4)}


def read_safetensors(path):
    """{name: tensor} and __metadata__ of a safetensors file, with the format's checks."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: header length {n} runs past the end of the file")
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    meta = header.pop("__metadata__", {})
    out, spans = {}, []
    for name, e in header.items():
        if set(e) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{path}: {name}: fields {sorted(e)}")
        dtype, size = DTYPES[e["dtype"]]
        b, t = e["data_offsets"]
        if t - b != size * math.prod(e["shape"]):
            raise ValueError(f"{path}: {name}: {t - b} bytes for shape {e['shape']} {e['dtype']}")
        spans.append((b, t))
        buf = bytearray(data[b:t])  # a writable copy: frombuffer warns on read-only memory
        out[name] = torch.frombuffer(buf, dtype=dtype).reshape(e["shape"]) if t > b else \
            torch.empty(e["shape"], dtype=dtype)
    spans.sort()
    pos = 0
    for b, t in spans:
        if b != pos:
            raise ValueError(f"{path}: offsets not contiguous at byte {b}")
        pos = t
    if pos != len(data):
        raise ValueError(f"{path}: {len(data) - pos} bytes belong to no tensor")
    return out, meta


# ---- the HF-convention model ------------------------------------------------------------------

def rms_norm(x, weight, eps):
    # HF LlamaRMSNorm: statistics in float32, weight applied in the input dtype.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def inverse_frequencies(cfg, head_dim):
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rs = cfg.get("rope_scaling")
    if rs:  # HF's "llama3" rope type
        assert rs.get("rope_type", rs.get("type")) == "llama3", rs
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(medium, blended, scaled)
    return inv


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention(x, w, prefix, cfg, cos, sin):
    T = x.shape[0]
    H, KV = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg["hidden_size"] // H
    q = (x @ w[prefix + "q_proj.weight"].T).view(T, H, hd).transpose(0, 1)   # [H, T, hd]
    k = (x @ w[prefix + "k_proj.weight"].T).view(T, KV, hd).transpose(0, 1)  # [KV, T, hd]
    v = (x @ w[prefix + "v_proj.weight"].T).view(T, KV, hd).transpose(0, 1)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k = k.repeat_interleave(H // KV, dim=0)  # head h uses kv head h // (H / KV)
    v = v.repeat_interleave(H // KV, dim=0)
    scores = (q @ k.transpose(1, 2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores.to(torch.float32), dim=-1).to(q.dtype)
    out = (probs @ v).transpose(0, 1).reshape(T, H * hd)
    return out @ w[prefix + "o_proj.weight"].T


def swiglu(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe(x, w, prefix, cfg):
    E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    probs = torch.softmax((x @ w[prefix + "gate.weight"].T).to(torch.float32), dim=-1)
    top, idx = torch.topk(probs, k, dim=-1)
    top = (top / top.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(E):
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        p = f"{prefix}experts.{e}."
        y = swiglu(x[rows], w[p + "w1.weight"], w[p + "w3.weight"], w[p + "w2.weight"])
        out.index_add_(0, rows, y * top[rows, slot].unsqueeze(-1))
    return out


def forward(w, cfg, tokens, dtype):
    w = {k: v.to(dtype) for k, v in w.items()}
    T, H = len(tokens), cfg["num_attention_heads"]
    hd = cfg["hidden_size"] // H
    eps = cfg["rms_norm_eps"]
    # As HF: float32 inverse frequencies; angles in the forward's dtype.
    ang = torch.outer(torch.arange(T, dtype=dtype), inverse_frequencies(cfg, hd).to(dtype))
    emb = torch.cat((ang, ang), dim=-1)  # HF: frequency i drives dimensions i and i + hd/2
    cos, sin = emb.cos(), emb.sin()
    x = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = x + attention(rms_norm(x, w[p + "input_layernorm.weight"], eps), w, p + "self_attn.", cfg, cos, sin)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if cfg["architectures"][0] == "MixtralForCausalLM":
            x = x + moe(h, w, p + "block_sparse_moe.", cfg)
        else:
            x = x + swiglu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T  # [T, V]


# ---- consolidated .pt ----------------------------------------------------------------------

def to_hf_name(fqn):
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", fqn)
    if not m:
        return {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}[fqn], None
    i, rest = m.groups()
    table = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
             "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
             "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
             "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight",
             "moe.router.gate.weight": "block_sparse_moe.gate.weight"}
    if rest in table:
        return f"model.layers.{i}.{table[rest]}", None
    m2 = re.fullmatch(r"moe\.experts\.(w[123])", rest)
    if m2:
        return f"model.layers.{i}.block_sparse_moe.experts.{{}}.{m2.group(1)}.weight", "experts"
    raise KeyError(fqn)


def hf_rotary_order(w, heads):
    """ctitan's interleaved rotary rows -> HF's half-split rows, per head."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).permute(0, 2, 1, 3).reshape(rows, cols)


def check_pt(pt_path, hf, cfg):
    sd = torch.load(pt_path)
    H, KV = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    used, bad = set(), []
    for fqn, t in sd.items():
        key, kind = to_hf_name(fqn)
        if kind == "experts":
            for e in range(t.shape[0]):
                used.add(key.format(e))
                if not torch.equal(hf[key.format(e)].to(t.dtype), t[e]):
                    bad.append(f"{fqn}[{e}]")
            continue
        want = t
        if fqn.endswith("attention.wq.weight"):
            want = hf_rotary_order(t, H)
        elif fqn.endswith("attention.wk.weight"):
            want = hf_rotary_order(t, KV)
        used.add(key)
        if not torch.equal(hf[key].to(want.dtype), want):
            bad.append(fqn)
    missing = sorted(set(hf) - used)
    return len(sd), bad, missing


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="folder with model.safetensors and config.json")
    ap.add_argument("--logits", required=True, help="ctitan's logits (checkpoint_tool logits)")
    ap.add_argument("--pt", help="consolidated .pt export of the same model, checked against the HF tensors")
    ap.add_argument("--tol", type=float, default=1e-5, help="max |Δ logit| allowed in float32")
    a = ap.parse_args()

    cfg = json.load(open(os.path.join(a.hf, "config.json")))
    weights = {}
    for name in sorted(os.listdir(a.hf)):
        if name.endswith(".safetensors"):
            t, _ = read_safetensors(os.path.join(a.hf, name))
            weights.update(t)
    got, meta = read_safetensors(a.logits)
    tokens = got["tokens"].tolist()
    ctitan = got["logits"].to(torch.float32)

    with torch.no_grad():
        ref32 = forward(weights, cfg, tokens, torch.float32)
        ref64 = forward(weights, cfg, tokens, torch.float64)
    d32 = (ctitan - ref32).abs().max().item()
    d64 = (ctitan.double() - ref64).abs().max().item()
    ref_err = (ref32.double() - ref64).abs().max().item()
    agree = (ctitan.argmax(-1) == ref32.argmax(-1)).float().mean().item()
    arch = cfg["architectures"][0]
    print(f"hf_parity: {arch} {meta.get('model', '')}, {len(weights)} tensors, {len(tokens)} tokens, "
          f"vocab {ctitan.shape[-1]}")
    print(f"  max |ctitan - HF forward (float32)|   = {d32:.3e}")
    print(f"  max |ctitan - HF forward (float64)|   = {d64:.3e}")
    print(f"  max |HF float32 - HF float64|         = {ref_err:.3e}  (float32 rounding of the reference itself)")
    print(f"  max |logit| = {ref64.abs().max().item():.3f}; argmax agreement {agree * 100:.1f}%")
    ok = d32 <= a.tol
    if a.pt:
        n, bad, missing = check_pt(a.pt, weights, cfg)
        print(f"  consolidated {os.path.basename(a.pt)} (torch.load): {n} tensors; "
              f"{'all equal the HF export (q/k permuted)' if not bad else 'MISMATCH: ' + ', '.join(bad[:5])}"
              f"{'' if not missing else '; HF tensors not in the .pt: ' + ', '.join(missing[:5])}")
        ok = ok and not bad and not missing
    print(f"  {'PASS' if ok else 'FAIL'} (tolerance {a.tol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
