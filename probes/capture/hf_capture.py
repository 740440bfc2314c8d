#!/usr/bin/env python3
"""Capture per-module activations of Hugging Face transformers' DeepSeek-V4 into safetensors.

Run it next to transformers (>= 5.17, which ships DeepseekV4ForCausalLM):

    python3 hf_capture.py --model DIR --token-ids 1,2,3 --out trace.safetensors [--dtype float32|bfloat16]
    python3 hf_capture.py --model DIR --tokens tokens.json --out trace.safetensors --rows 0,1,127,128

Writes one tensor per hooked module, keyed by the module path (e.g. `model.layers.0.self_attn.q_a_proj`),
auxiliary outputs as `PATH:name` (`model.layers.0.attn_hc:post`), and the token ids as `input_ids` (I64).
`nvfp4-probe compare --names hf --trace trace.safetensors` maps these names to op ids.
With --rows only those token rows of every activation are kept (keyed with the row list in the metadata), which
keeps reference data small. The model runs on the CPU unless --device is given; TF32 is disabled either way.
"""
import argparse
import json

import torch
from safetensors.torch import save_file


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--token-ids", help="comma-separated token ids")
    p.add_argument("--tokens", help="JSON file with an array of token ids")
    p.add_argument("--out", required=True, help="output safetensors file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", help="keep only these token rows (comma-separated)")
    return p.parse_args()


BF16_AUTOCAST = False


def capture(model, input_ids, rows=None):
    """Run one forward with hooks; return {name: tensor (float32, CPU)}."""
    out = {}
    hooks = []

    def keep(name, t):
        t = t.detach().float().cpu().clone()  # module outputs can alias (self_attn is o_b_proj)
        # every activation is [1, T, ...]; the compressor's rows are compressed entries, not tokens
        if rows is not None and t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == input_ids.shape[1]:
            t = t[:, rows]
        out[name] = t.contiguous()

    def fwd(name):
        def hook(mod, args, res):
            if isinstance(res, tuple):
                cls = type(mod).__name__
                if cls == "DeepseekV4HyperConnection":
                    post, comb, collapsed = res
                    keep(name, collapsed)
                    keep(name + ":post", post)
                    keep(name + ":comb", comb)
                elif cls.endswith("Router"):
                    logits, weights, idx = res
                    keep(name + ":logits", logits.view(1, -1, logits.shape[-1]))
                    keep(name, weights.view(1, -1, weights.shape[-1]))
                    keep(name + ":idx", idx.view(1, -1, idx.shape[-1]).float())
                elif cls.endswith("Compressor"):
                    compressed_kv = res[0]  # [B, 1, n_c, head_dim]
                    out[name] = compressed_kv[:, 0].detach().float().cpu().contiguous()
                elif cls == "DeepseekV4Attention":
                    keep(name, res[0])
                else:
                    keep(name, res[0])
            elif torch.is_tensor(res):
                if type(mod).__name__ == "DeepseekV4Indexer":
                    out[name] = res.detach().float().cpu().contiguous()
                else:
                    keep(name, res)
        return hook

    def pre(name):
        def hook(mod, args):
            keep(name, args[0])
        return hook

    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls in ("DeepseekV4RotaryEmbedding", "DeepseekV4UnweightedRMSNorm", "ModuleList", "DeepseekV4Model",
                   "DeepseekV4ForCausalLM", "DeepseekV4IndexerScorer", "SiLUActivation", "SiLU"):
            continue
        if name == "":
            continue
        hooks.append(mod.register_forward_hook(fwd(name)))
        if cls == "DeepseekV4GroupedLinear":
            # the attention core output (after inverse RoPE), grouped [B, S, G, H*Dh/G]
            hooks.append(mod.register_forward_pre_hook(pre(name + ":input")))
        if cls == "DeepseekV4HyperConnection" and name.endswith("ffn_hc"):
            # the residual streams after the attention-side mHC post
            hooks.append(mod.register_forward_pre_hook(pre(name + ":input")))
    # transformers 5.17's DeepseekV4 keeps the hyper-connection math in float32 and feeds its float32 output
    # to BF16 linears, which plain BF16 weights refuse; a BF16 run therefore runs under autocast (the way
    # such models are run in BF16 in practice): every linear in BF16, the model's explicit float32 parts as written.
    amp = torch.autocast(input_ids.device.type, dtype=torch.bfloat16) if BF16_AUTOCAST else torch.autocast(
        input_ids.device.type, enabled=False)
    with torch.no_grad(), amp:
        logits = model(input_ids=input_ids).logits
    keep("logits", logits)
    for h in hooks:
        h.remove()
    return out


def main():
    a = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from transformers import DeepseekV4ForCausalLM

    if a.token_ids:
        ids = [int(x) for x in a.token_ids.split(",")]
    elif a.tokens:
        ids = json.load(open(a.tokens))
    else:
        raise SystemExit("give --token-ids or --tokens")
    dtype = getattr(torch, a.dtype)
    global BF16_AUTOCAST
    BF16_AUTOCAST = a.dtype == "bfloat16"
    model = DeepseekV4ForCausalLM.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    input_ids = torch.tensor([ids], dtype=torch.long, device=a.device)
    rows = [int(r) for r in a.rows.split(",")] if a.rows else None
    acts = capture(model, input_ids, rows)
    acts["input_ids"] = torch.tensor(ids, dtype=torch.int64)
    meta = {"producer": "hf_capture.py", "transformers_dtype": a.dtype,
            "autocast": "bfloat16" if BF16_AUTOCAST else "off", "device": a.device}
    if rows is not None:
        meta["rows"] = ",".join(map(str, rows))
    save_file(acts, a.out, metadata=meta)
    print(f"wrote {len(acts)} tensors to {a.out}")


if __name__ == "__main__":
    main()
