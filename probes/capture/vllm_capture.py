#!/usr/bin/env python3
"""Dump per-module activations of vLLM's DeepSeek-V4 for `nvfp4-probe compare --names vllm`.

UNTESTED AGAINST A LIVE ENGINE: written from vLLM's DeepSeek-V4 module tree (DSV4-LAYER.md section 2.4) and
its V0/V1 executor layout; module paths and the way to reach the model move between vLLM releases. Check
the printed module count, and `compare`'s "unmapped" list, on the first run.

    python3 vllm_capture.py --model /ckpt/DeepSeek-V4-Flash-NVFP4 --tokens tokens.json --out dumps/ \
        [--tp 8] [--layers 0-4] [--rows 0,1,127,128] [--dtype bfloat16]

Writes dumps/rank{R}.safetensors per tensor-parallel rank (compare joins them: q_b and the attention core
are column-parallel over heads, wo_a over groups, MoE outputs are partial sums). Run it with
enforce_eager=True (CUDA graphs skip Python hooks) and one prompt, so one forward pass is the prefill.

Reaching the model: V0 / single-process `llm.llm_engine.model_executor.driver_worker.model_runner.model`;
newer vLLM `llm.llm_engine.model_executor.driver_worker.worker.model_runner.model`; with several workers the
hooks must be installed inside each worker, which is what `collective_rpc` does below (the function is
shipped to every rank and writes that rank's file). With VLLM_ENABLE_V1_MULTIPROCESSING=1 set the same
applies. The layer returns (y2, X1, post_f, C_f): they are kept as `model.layers.N:0..3` and compare
recombines them into the layer output (DSV4-LAYER.md section 3.2).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", help="JSON array of token ids")
    p.add_argument("--token-ids", help="comma-separated token ids")
    p.add_argument("--out", required=True, help="output directory (rank{R}.safetensors)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", default="0-4", help="layers to hook, inclusive range A-B")
    p.add_argument("--rows", help="keep only these token rows")
    p.add_argument("--dtype", default=None, help="store activations as this dtype (default: as computed)")
    return p.parse_args()


# Module path suffixes under model.layers.N that map to op ids (see src/trace/names.rs, map_vllm).
SUFFIXES = ("attn_norm", "attn.fused_wqa_wkv", "attn.wq_a", "attn.wkv", "attn.q_norm", "attn.kv_norm",
            "attn.wq_b", "attn.mla_attn.compressor", "attn.indexer", "attn.wo_a", "attn.wo_b", "attn",
            "ffn.norm_gate", "ffn.experts", "ffn.shared_experts", "ffn")


def install_and_run(model, cfg):
    """Runs inside each worker: hooks, then the caller's generate() fills them; returns the recorder."""
    from _dump import Recorder
    import torch
    a, b = cfg["layers"]

    def include(name, mod):
        if name in ("model.embed_tokens", "model.norm", "model.hc_head", "lm_head"):
            return True
        if not name.startswith("model.layers."):
            return False
        rest = name[len("model.layers."):]
        n, _, sub = rest.partition(".")
        return n.isdigit() and a <= int(n) <= b and (sub == "" or sub in SUFFIXES)

    dtype = getattr(torch, cfg["dtype"]) if cfg["dtype"] else None
    rec = Recorder(model, include=include, inputs_of=("attn.wo_a",), rows=cfg["rows"], dtype=dtype)
    rec.num_tokens = cfg["num_tokens"]
    return rec


def main():
    a = parse_args()
    from vllm import LLM, SamplingParams
    ids = json.load(open(a.tokens)) if a.tokens else [int(x) for x in a.token_ids.split(",")]
    lo, _, hi = a.layers.partition("-")
    cfg = {"layers": (int(lo), int(hi or lo)), "rows": [int(r) for r in a.rows.split(",")] if a.rows else None,
           "dtype": a.dtype, "num_tokens": len(ids), "out": os.path.abspath(a.out), "ids": ids}
    os.makedirs(a.out, exist_ok=True)
    llm = LLM(model=a.model, tensor_parallel_size=a.tp, enforce_eager=True, enable_prefix_caching=False)

    def hook_worker(self):
        # `self` is the worker; self.model_runner.model is the nn.Module on this rank
        import torch.distributed as dist
        model = self.model_runner.model
        self._nvfp4_rec = install_and_run(model, cfg)
        self._nvfp4_rank = dist.get_rank() if dist.is_initialized() else 0
        return len(self._nvfp4_rec.hooks)

    def save_worker(self):
        rec = self._nvfp4_rec
        rec.remove()
        path = os.path.join(cfg["out"], f"rank{self._nvfp4_rank}.safetensors")
        return rec.save(path, cfg["ids"], extra_meta={"producer": "vllm_capture.py"})

    print("hooks per rank:", llm.collective_rpc(hook_worker))
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0))
    print("tensors per rank:", llm.collective_rpc(save_worker))
    print(f"next: nvfp4-probe compare --model {a.model} --trace {a.out} --names vllm")


if __name__ == "__main__":
    main()
