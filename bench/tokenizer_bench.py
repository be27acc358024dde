#!/usr/bin/env python3
"""Hugging Face `tokenizers`' own encode speed on one thread, the reference for
bench/tokenizer_bench.cpp (bench/tokenizer_bench.sh runs both on the same documents).

    RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
      python bench/tokenizer_bench.py <hf_assets folder> <text file or folder> [passes=3]

The documents are cut as ctitan's reader cuts them and encoded one call each, as torchtitan's
HuggingFaceTokenizer.encode(text, add_bos=True, add_eos=True) does it (one `Tokenizer.encode`
per document; no encode_batch, so no thread pool). The first pass is reported as cold (a fresh
tokenizer), the best pass as the steady state. Prints one JSON line like tokenizer_bench.
"""
import json
import os
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from make_hf_tokenizers import TitanStyle, jsonl_documents, txt_documents  # noqa: E402


def main():
    folder, source = sys.argv[1], sys.argv[2]
    passes = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    docs = txt_documents(source) if source.endswith(".txt") else jsonl_documents(source)
    t = TitanStyle(folder)
    encode = t.tok.encode
    bos = None if t.adds_bos else t.bos_id
    eos = None if t.adds_eos else t.eos_id
    cold = best = 0.0
    tokens = 0
    for p in range(passes):
        n = 0
        t0 = time.perf_counter()
        for text in docs:
            ids = encode(text).ids
            if bos is not None:
                ids.insert(0, bos)
            if eos is not None:
                ids.append(eos)
            n += len(ids)
        rate = n / (time.perf_counter() - t0)
        cold = rate if p == 0 else cold
        best = max(best, rate)
        tokens = n
    print(json.dumps({"docs": len(docs), "bytes": sum(len(d.encode()) for d in docs), "tokens": tokens,
                      "cold_tokens_per_s": round(cold, 1), "tokens_per_s": round(best, 1)}))


if __name__ == "__main__":
    main()
