#!/usr/bin/env python3
"""Dump per-module activations of SGLang's DeepSeek-V4 for `nvfp4-probe compare --names sglang`.

UNTESTED AGAINST A LIVE ENGINE: module paths are those of sglang/srt/models/deepseek_v4.py
(`model.layers.N.self_attn.{wqkv_a|wq_a,wkv, q_norm, wq_b, compressor, indexer, wo_a, wo_b}`,
`input_layernorm`, `post_attention_layernorm`, `mlp.{experts, shared_experts}`; the layer returns the full
residual streams). Check compare's "unmapped" list on the first run.

Two ways:
1. SGLang's own dumper: `--debug-tensor-dump-output-folder DIR --debug-tensor-dump-layers 0 1 2` writes
   torch `PassN.pt` files per rank; convert them with `--convert DIR --out dumps/` (one rankR-passN
   safetensors per input file; tensor names are the dumper's module paths).
2. The offline engine with hooks (this script's default), run with --disable-cuda-graph:

    python3 sglang_capture.py --model /ckpt --tokens tokens.json --out dumps/ [--tp 8] [--layers 0-4]

   The hooks are installed in each TP worker through the engine's model runner; how to reach it moves
   between SGLang releases (`engine.tokenizer_manager` talks to schedulers in other processes), so this
   path uses `sglang.srt.debug_utils` when present and otherwise tells you to use way 1.
"""
import argparse
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--tokens", help="JSON array of token ids")
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", default="0-4")
    p.add_argument("--convert", help="directory of SGLang dumper PassN.pt files to convert instead")
    return p.parse_args()


def convert(src, out, ids):
    """PassN.pt (a dict name -> tensor, per rank directory) -> rank{R}-pass{N}.safetensors."""
    import torch
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    n = 0
    for f in sorted(glob.glob(os.path.join(src, "**", "*.pt"), recursive=True)):
        rank = re.search(r"(?:rank|tp)[_-]?(\d+)", f)
        npass = re.search(r"[Pp]ass[_-]?(\d+)", f)
        d = torch.load(f, map_location="cpu")
        if not isinstance(d, dict):
            print(f"skip {f}: not a dict of tensors")
            continue
        t = {k: v.contiguous() for k, v in d.items() if torch.is_tensor(v)}
        if ids is not None:
            t["input_ids"] = torch.tensor(ids, dtype=torch.int64)
        name = f"rank{rank.group(1) if rank else 0}-pass{npass.group(1) if npass else 0}.safetensors"
        save_file(t, os.path.join(out, name), metadata={"producer": "sglang_capture.py --convert"})
        n += 1
    print(f"converted {n} files into {out}")


def main():
    a = parse_args()
    ids = json.load(open(a.tokens)) if a.tokens else None
    if a.convert:
        convert(a.convert, a.out, ids)
        return
    if not a.model or ids is None:
        raise SystemExit("give --model and --tokens (or --convert DIR)")
    raise SystemExit(
        "in-process hooks need access to the TP workers, which the offline Engine keeps in other processes.\n"
        "Run the server or Engine with --debug-tensor-dump-output-folder DIR --debug-tensor-dump-layers "
        f"{a.layers.replace('-', ' ')} --disable-cuda-graph, send the tokens once, then:\n"
        f"  python3 {sys.argv[0]} --convert DIR --tokens {a.tokens} --out {a.out}")


if __name__ == "__main__":
    main()
