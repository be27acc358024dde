#!/usr/bin/env python3
"""HF parity: ctitan against Hugging Face transformers' own LlamaForCausalLM / MixtralForCausalLM.

Two modes, both in the venv of scripts/install_deps.sh (PyTorch 2.13, transformers, tokenizers):

  hf_parity.py roundtrip --bin BUILD_DIR --tokenizer DIR --out WORK [--models llama3,mixtral,llama2] [--tol 1e-4]
      For each model: transformers builds a random model of a ctitan debug flavor's shapes
      (Llama: debugmodel_gqa, 16 query / 8 kv heads, llama3 RoPE scaling; Mixtral: debugmodel,
      8 experts, top-2; llama2: debugmodel, 8 layers, 16 kv heads, RoPE theta 1e4 unscaled), with the vocabulary of the Hugging Face tokenizer in DIR (a
      tokenizer.json folder, scripts/make_hf_tokenizers.py's llama3/), and save_pretrained()s it
      in bfloat16, sharded (max_shard_size 2MB, with model.safetensors.index.json), with that
      tokenizer. Then:
        1. logits: ctitan (`checkpoint_tool logits`, a batch of 2 sequences of Moby-Dick text)
           against the model from_pretrained() in float32 (both upcast the same bf16 weights):
           max |Δ| <= tol;
        2. greedy: ctitan `generate --prompt TEXT --max-new-tokens 32` (its own tokenizer, its KV
           cache) against transformers' generate(do_sample=False, max_new_tokens=32) on the
           prompt its tokenizer encodes: the prompt ids and all 32 new ids equal;
        3. export: ctitan converts the HF folder to its own step folder and that back to an HF
           folder (`checkpoint_tool convert`, ctitan's writer); from_pretrained() of the export
           gives logits equal to the original's (max |Δ| <= tol) and bitwise-equal weights.
  hf_parity.py compare --hf DIR --logits FILE [--pt MODEL.pt] [--tol 1e-5]
      An HF folder ctitan exported (a training run's last_save_in_hf): from_pretrained() in
      float32 against ctitan's logits of the same tokens (`checkpoint_tool logits`); with --pt,
      that a consolidated .pt export read by torch.load holds the same tensors (q/k rows in
      ctitan's rotary order). Run by scripts/hf_parity.sh.

Exit 0 when every check passes, 1 otherwise; one line per check.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import transformers  # noqa: E402
transformers.utils.logging.disable_progress_bar()
from safetensors import safe_open  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          MixtralConfig, MixtralForCausalLM)

PROMPT = "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money"
BATCH = ["Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse,",
         "It is a way I have of driving off the spleen and regulating the circulation. Whenever I find myself"]


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return p


def read_logits(path):
    with safe_open(path, "pt") as f:
        return f.get_tensor("logits"), f.get_tensor("tokens")


def hf_logits(folder, ids):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model, model(torch.tensor(ids)).logits


# ---- roundtrip -------------------------------------------------------------------------------

def make_model(name, vocab, seed):
    """A random transformers model of the ctitan flavor's shapes, weights spread enough that
    logits differ by units (greedy paths do not hinge on rounding-level ties)."""
    torch.manual_seed(seed)
    common = dict(hidden_size=256, num_attention_heads=16, num_hidden_layers=6, vocab_size=vocab,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
                  initializer_range=0.02)
    if name == "llama2":
        # ctitan's llama2 debugmodel: 8 layers, FFN 768, 16 kv heads (no GQA), RoPE theta 1e4
        # without scaling. The folder carries no ctitan metadata: LlamaForCausalLM loads as
        # llama3 unless a llama3 flavor does not fit and a llama2 one does (this one).
        common.update(num_hidden_layers=8, max_position_embeddings=4096)
        cfg = LlamaConfig(intermediate_size=768, num_key_value_heads=16,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
        model = LlamaForCausalLM(cfg)
    elif name == "llama3":
        # ctitan's llama3 debugmodel_gqa: FFN 768, 8 kv heads, RoPE theta 5e5 with llama3 scaling.
        cfg = LlamaConfig(intermediate_size=768, num_key_value_heads=8,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192}, **common)
        model = LlamaForCausalLM(cfg)
    else:
        # ctitan's mixtral debugmodel: 8 experts of FFN 768, top-2, 16 kv heads, theta 1e6.
        cfg = MixtralConfig(intermediate_size=768, num_key_value_heads=16, num_local_experts=8,
                            num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                            **common)
        model = MixtralForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))   # norms that matter
            elif "embed_tokens" in n:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5)  # unit-scale activations through each layer
    return model.eval()


def roundtrip(a):
    status = 0
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    vocab = len(tok)
    print(f"hf_parity: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"tokenizer {a.tokenizer} ({vocab} ids)")
    tool, gen = os.path.join(a.bin, "checkpoint_tool"), os.path.join(a.bin, "generate")
    for name in a.models.split(","):
        t0 = time.time()
        work = os.path.join(a.out, name)
        hf_dir = os.path.join(work, "hf")
        os.makedirs(work, exist_ok=True)
        make_model(name, vocab, seed=1234).to(torch.bfloat16).save_pretrained(hf_dir, max_shard_size="2MB")
        tok.save_pretrained(hf_dir)
        files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
        print(f"{name}: save_pretrained: {len(files)} bf16 safetensors shards + index, tokenizer.json")

        # 1. logits on a batch
        enc = [tok(t)["input_ids"] for t in BATCH]
        T = min(len(e) for e in enc)
        ids = [e[:T] for e in enc]
        ref_model, ref = hf_logits(hf_dir, ids)
        lf = os.path.join(work, "logits.safetensors")
        run([tool, "logits", hf_dir, ";".join(",".join(map(str, e)) for e in ids), lf])
        got, got_tokens = read_logits(lf)
        d = (got - ref).abs().max().item()
        ok = d <= a.tol and got_tokens.tolist() == ids
        status |= not ok
        print(f"{name}: logits [{len(ids)}, {T}, {vocab}] float32: max |ctitan - transformers| = {d:.2e} "
              f"(max |logit| {ref.abs().max().item():.1f}, argmax agreement "
              f"{(got.argmax(-1) == ref.argmax(-1)).float().mean().item() * 100:.0f}%) "
              f"{'PASS' if ok else 'FAIL'} (tol {a.tol:g})")

        # 2. 32 greedy tokens
        ref_model.generation_config.eos_token_id = None  # 32 tokens, EOS or not (ctitan: --ignore-eos)
        ref_model.generation_config.pad_token_id = 0
        prompt_ids = tok(PROMPT)["input_ids"]
        with torch.no_grad():
            res = ref_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=32,
                                     output_scores=True, return_dict_in_generate=True)
        want = res.sequences[0].tolist()[len(prompt_ids):]
        # How far from a tie each greedy choice was (a gap at rounding level would make the
        # comparison fragile, not meaningful).
        gap = min((lambda t: (t[0] - t[1]).item())(s[0].topk(2).values) for s in res.scores)
        idf = os.path.join(work, "generate.json")
        g = run([gen, hf_dir, "--prompt", PROMPT, "--max-new-tokens", "32", "--ignore-eos", "--threads", "1",
                 "--ids-out", idf])
        mine = json.load(open(idf))
        same_prompt = mine["prompt_ids"] == prompt_ids
        first_diff = next((i for i, (x, y) in enumerate(zip(mine["generated_ids"], want)) if x != y), None)
        ok = same_prompt and mine["generated_ids"] == want and len(want) == 32
        status |= not ok
        if ok:
            verdict = "all equal PASS"
        else:
            verdict = f"first difference at {first_diff}: {mine['generated_ids']} vs {want} FAIL"
        print(f"{name}: greedy generate, prompt {len(prompt_ids)} tokens (ctitan's tokenizer "
              f"{'gives the same ids' if same_prompt else 'DIFFERS'}), 32 new tokens (smallest top-1/top-2 "
              f"logit gap on the path {gap:.2e}): {verdict}")
        print(f"{name}:   ctitan: {g.stderr.strip().splitlines()[-1]}")

        # 3. ctitan's export read by from_pretrained
        step = os.path.join(work, "ckpt", "step-1")
        export = os.path.join(work, "export")
        run([tool, "convert", hf_dir, step])
        run([tool, "convert", step, export, "--to", "hf"])
        exp_model, exp = hf_logits(export, ids)
        d2 = (exp - ref).abs().max().item()
        same_w = all(torch.equal(p, q) for p, q in zip(ref_model.state_dict().values(), exp_model.state_dict().values()))
        ok = d2 <= a.tol and same_w
        status |= not ok
        print(f"{name}: ctitan export (HF -> step folder -> HF) from_pretrained: weights "
              f"{'bitwise equal' if same_w else 'DIFFER'}, max |Δ logits| vs the original = {d2:.2e} "
              f"{'PASS' if ok else 'FAIL'}")
        print(f"{name}: {time.time() - t0:.1f} s")
    return status


# ---- compare (an export of a trained run) ------------------------------------------------------

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


def read_hf_tensors(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
    return out


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


def compare(a):
    cfg = json.load(open(os.path.join(a.hf, "config.json")))
    got, tokens = read_logits(a.logits)
    ids = tokens.reshape(-1, tokens.shape[-1]).tolist()
    _, ref = hf_logits(a.hf, ids)
    ref = ref.reshape(got.shape)
    d = (got - ref).abs().max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"hf_parity: {cfg['architectures'][0]} from_pretrained({a.hf}) in float32, transformers "
          f"{transformers.__version__}, torch {torch.__version__}; {tokens.numel()} tokens")
    print(f"  max |ctitan - transformers| = {d:.3e}; max |logit| = {ref.abs().max().item():.3f}; "
          f"argmax agreement {agree * 100:.1f}%")
    ok = d <= a.tol
    if a.pt:
        n, bad, missing = check_pt(a.pt, read_hf_tensors(a.hf), cfg)
        print(f"  consolidated {os.path.basename(a.pt)} (torch.load): {n} tensors; "
              f"{'all equal the HF export (q/k permuted)' if not bad else 'MISMATCH: ' + ', '.join(bad[:5])}"
              f"{'' if not missing else '; HF tensors not in the .pt: ' + ', '.join(missing[:5])}")
        ok = ok and not bad and not missing
    print(f"  {'PASS' if ok else 'FAIL'} (tolerance {a.tol:g})")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("roundtrip")
    r.add_argument("--bin", required=True, help="build folder with checkpoint_tool and generate")
    r.add_argument("--tokenizer", required=True, help="folder with tokenizer.json + tokenizer_config.json")
    r.add_argument("--out", required=True)
    r.add_argument("--models", default="llama3,mixtral,llama2")
    r.add_argument("--tol", type=float, default=1e-4)
    c = sub.add_parser("compare")
    c.add_argument("--hf", required=True)
    c.add_argument("--logits", required=True)
    c.add_argument("--pt")
    c.add_argument("--tol", type=float, default=1e-5)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("CTITAN_PARITY_THREADS", "2")))
    return roundtrip(a) if a.mode == "roundtrip" else compare(a)


if __name__ == "__main__":
    sys.exit(main())
