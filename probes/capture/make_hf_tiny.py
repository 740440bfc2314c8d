#!/usr/bin/env python3
"""Build the tiny transformers-made DeepSeek-V4 reference used by nvfp4-probe's tests (tests/data/hf-tiny).

    python3 make_hf_tiny.py --out DIR

Creates a random DeepseekV4ForCausalLM from a small config covering every layer kind (sliding, HCA ratio 128,
CSA ratio 4 with the indexer really selecting, hash-routed and biased-top-k MoE), makes the parameters that
transformers initialises to constants (sinks, position biases, hc base/scale, router bias, tid2eid) random,
scales one layer's experts up so the SwiGLU clamp engages, saves it with `save_pretrained` in BF16 (the
hybrid naming transformers writes) and captures FP32 activations with hf_capture.py for T = 300 and T = 77.
"""
import argparse
import json
import os

import torch

from hf_capture import capture
from safetensors.torch import save_file

ROWS_300 = [0, 1, 2, 3, 63, 127, 128, 129, 200, 255, 256, 257, 299]
ROWS_77 = [0, 1, 5, 40, 76]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(20261130)
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        vocab_size=256, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=5,
        num_attention_heads=2, head_dim=512, q_lora_rank=64, o_groups=2, o_lora_rank=64,
        num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, routed_scaling_factor=1.5,
        compress_ratios=[0, 128, 4, 128, 4, 0], num_hash_layers=2, qk_rope_head_dim=64,
        index_n_heads=16, index_head_dim=128, index_topk=8, sliding_window=128,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
        num_nextn_predict_layers=0, torch_dtype="bfloat16",
    )
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.endswith("sinks"):
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.5)
            elif name.endswith("position_bias"):
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
            elif name.endswith(".base") or name.endswith("hc_base"):
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                prm.copy_(1.0 + torch.randn(prm.shape, generator=g) * 0.2)
            elif name.endswith(".fn") or name.endswith("hc_fn"):
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.05)
            elif "norm" in name and name.endswith("weight"):
                prm.copy_(1.0 + torch.randn(prm.shape, generator=g) * 0.1)
        for i, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                # k distinct experts per token
                t = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(cfg.vocab_size)])
                gate.tid2eid.copy_(t)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.1)
        # layer 1: experts large enough that gate/up exceed the swiglu limit for some tokens
        model.model.layers[1].mlp.experts.gate_up_proj.mul_(40.0)
        model.model.layers[1].mlp.shared_experts.gate_proj.weight.mul_(40.0)
    os.makedirs(a.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(a.out)
    # reload exactly what was saved, in float32, and capture
    ref = DeepseekV4ForCausalLM.from_pretrained(a.out, dtype=torch.float32).eval()
    for T, rows in ((300, ROWS_300), (77, ROWS_77)):
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=g).tolist()
        json.dump(ids, open(os.path.join(a.out, f"tokens-{T}.json"), "w"))
        acts = capture(ref, torch.tensor([ids]), rows)
        acts["input_ids"] = torch.tensor(ids, dtype=torch.int64)
        save_file(acts, os.path.join(a.out, f"trace-{T}.safetensors"),
                  metadata={"producer": "make_hf_tiny.py", "rows": ",".join(map(str, rows)), "dtype": "float32"})
        print(T, len(acts), "tensors")


if __name__ == "__main__":
    main()
