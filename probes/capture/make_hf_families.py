#!/usr/bin/env python3
"""Build tiny transformers-made references of the other MoE families nvfp4-probe is to serve
(DeepSeek-V3/R1, Qwen3-MoE, gpt-oss): each model made by transformers itself, saved with
`save_pretrained` in BF16 (its own on-disk layout), reloaded in float32 and run with a hook on every
module; the activations of that FP32 run and of a BF16 run (under autocast, as such models are run)
are written as safetensors traces keyed by module path, like hf_capture.py's.

    python3 make_hf_families.py --out DIR [--family deepseek_v3,qwen3_moe,gpt_oss] [--tokens 64] [--device cuda]

For each family, DIR/FAMILY/ holds config.json, model.safetensors, tokens.json, trace-fp32.safetensors,
trace-bf16.safetensors and structure.json (every parameter's name, shape and dtype as saved, and every
module's path and class: what a reader of the layout needs). Parameters that transformers initialises
to constants (biases, sinks, correction biases, norm weights) are made random so that every path is
exercised; one layer's experts are scaled up so that a clamped SwiGLU (gpt-oss) engages.
"""
import argparse
import json
import os
import traceback

import torch
from safetensors.torch import save_file

SKIP = ("RotaryEmbedding", "ModuleList", "Dropout", "SiLU", "SiLUActivation", "GELUActivation", "Identity")


def configs():
    from transformers import DeepseekV3Config, GptOssConfig, Qwen3MoeConfig

    return {
        "deepseek_v3": (
            "DeepseekV3ForCausalLM",
            DeepseekV3Config(
                vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rms_norm_eps=1e-6,
                max_position_embeddings=4096, rope_theta=10000.0,
                rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                tie_word_embeddings=False,
            ),
        ),
        "qwen3_moe": (
            "Qwen3MoeForCausalLM",
            Qwen3MoeConfig(
                vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096,
                tie_word_embeddings=False,
            ),
        ),
        "gpt_oss": (
            "GptOssForCausalLM",
            GptOssConfig(
                vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                num_experts_per_tok=2, sliding_window=16,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                rope_theta=150000.0, max_position_embeddings=4096,
                rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 4096},
                rms_norm_eps=1e-5, tie_word_embeddings=False,
            ),
        ),
    }


def capture(model, input_ids, autocast):
    """One forward with a hook on every module; {name: float32 CPU tensor}."""
    out = {}
    hooks = []

    def keep(name, t):
        if torch.is_tensor(t) and t.is_floating_point() or (torch.is_tensor(t) and t.dtype in (torch.int64, torch.int32)):
            out[name] = t.detach().float().cpu().clone().contiguous()

    def fwd(name):
        def hook(mod, args, res):
            if torch.is_tensor(res):
                keep(name, res)
            elif isinstance(res, (tuple, list)):
                for i, r in enumerate(res):
                    if torch.is_tensor(r):
                        keep(f"{name}:{i}", r)
                if res and torch.is_tensor(res[0]):
                    keep(name, res[0])
        return hook

    def pre(name):
        def hook(mod, args, kwargs=None):
            if args and torch.is_tensor(args[0]):
                keep(name + ":input", args[0])
        return hook

    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if name == "" or any(cls.endswith(s) for s in SKIP):
            continue
        hooks.append(mod.register_forward_hook(fwd(name)))
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("o_proj", "down_proj", "experts", "mlp"):
            hooks.append(mod.register_forward_pre_hook(pre(name)))
    amp = torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast)
    with torch.no_grad(), amp:
        logits = model(input_ids=input_ids).logits
    keep("logits", logits)
    for h in hooks:
        h.remove()
    return out


def randomise(model, g):
    with torch.no_grad():
        for name, prm in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "sinks":
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.5)
            elif leaf == "e_score_correction_bias":
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.1)
            elif "norm" in name and leaf == "weight":
                prm.copy_(1.0 + torch.randn(prm.shape, generator=g) * 0.1)
            elif "bias" in leaf:
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.02)
            elif prm.dim() >= 2 and "embed" not in name:
                # transformers' 0.02 init makes logits that never route decisively; a trained model's
                # weights are larger relative to their fan-in
                fan_in = prm.shape[-1] if prm.dim() == 2 else 128  # fused experts: hidden 128 in every config here
                prm.copy_(torch.randn(prm.shape, generator=g) / fan_in ** 0.5)
            elif "embed" in name:
                prm.copy_(torch.randn(prm.shape, generator=g))


def make(family, arch, cfg, out, T, device, seed):
    import transformers

    torch.manual_seed(seed)
    cls = getattr(transformers, arch)
    cfg._attn_implementation = "eager"
    model = cls(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    randomise(model, g)
    if family == "gpt_oss":
        # layer 1's experts large enough that gate/up pass the SwiGLU clamp for some tokens
        ex = model.model.layers[1].mlp.experts
        for n, p in ex.named_parameters():
            if "gate_up" in n and "bias" not in n:
                p.data.mul_(8.0)
    d = os.path.join(out, family)
    os.makedirs(d, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(d)
    from safetensors import safe_open

    params = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as st:
                for k in st.keys():
                    t = st.get_slice(k)
                    params[k] = {"shape": list(t.get_shape()), "dtype": str(t.get_dtype()), "file": f}
    ref = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").to(device).eval()
    modules = {n: type(m).__name__ for n, m in ref.named_modules()}
    json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "arch": arch,
               "params": params, "modules": modules}, open(os.path.join(d, "structure.json"), "w"), indent=1)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g).tolist()
    json.dump(ids, open(os.path.join(d, "tokens.json"), "w"))
    x = torch.tensor([ids], device=device)
    acts = capture(ref, x, autocast=False)
    acts["input_ids"] = torch.tensor(ids, dtype=torch.int64)
    save_file(acts, os.path.join(d, "trace-fp32.safetensors"),
              metadata={"producer": "make_hf_families.py", "dtype": "float32", "device": device})
    bf = cls.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="eager").to(device).eval()
    acts = capture(bf, x, autocast=True)
    acts["input_ids"] = torch.tensor(ids, dtype=torch.int64)
    save_file(acts, os.path.join(d, "trace-bf16.safetensors"),
              metadata={"producer": "make_hf_families.py", "dtype": "bfloat16", "autocast": "bfloat16",
                        "device": device})
    print(f"{family}: {len(params)} tensors saved, {len(acts)} activations, T={T}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--family", default="deepseek_v3,qwen3_moe,gpt_oss")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=20261202)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfgs = configs()
    ok = True
    for fam in a.family.split(","):
        arch, cfg = cfgs[fam]
        try:
            make(fam, arch, cfg, a.out, a.tokens, a.device, a.seed)
        except Exception:
            ok = False
            print(f"{fam}: FAILED")
            traceback.print_exc()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
