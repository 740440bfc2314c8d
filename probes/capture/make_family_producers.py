#!/usr/bin/env python3
"""Quantize the tiny transformers-made family models (tests/data/hf-families/<family>/, made by
make_hf_families.py) with the producers' own functions, and write each result as that producer
lays out a checkpoint, with the producer's own dequantization of one layer beside it.

    python3 make_family_producers.py --src tests/data/hf-families [--family qwen3_moe,deepseek_v3,gpt_oss]

Writes, per family, SRC/FAMILY/<kind>/ with config.json (the family's config plus the producer's
quantization_config), model.safetensors, hf_quant_config.json (ModelOpt) and dequant-layer1.safetensors
(`<tensor name>` → the producer's own float32 dequantization of layer 1's quantized weights, of the
routed experts only experts 0 and 1):

- ct-nvfp4 (deepseek_v3, qwen3_moe): compressed-tensors 0.20.0, preset NVFP4 (W4A4), every Linear but
  `lm_head` and the routers (`re:.*mlp.gate$`), as llm-compressor's recipes for these models ignore
  them. Weight global scales shared across a fused group (q/k/v; q_a/kv_a_with_mqa; gate/up) by their
  minimum, as llm-compressor's `update_fused_layer_weight_global_scales` does; block scales by
  `calculate_qparams`; bytes by `NVFP4PackedCompressor.compress`; dequantization by
  compressed-tensors' `dequantize`. `input_global_scale` = `generate_gparam` of the calibration amax.
- modelopt-nvfp4 (deepseek_v3, qwen3_moe): ModelOpt 0.47.0 `NVFP4QTensor.quantize`; DeepSeek-V3: the MLP
  linears only (routed and shared experts, the dense MLP), attention left BF16 as NVIDIA's
  DeepSeek-R1-FP4 does; Qwen3-MoE: every Linear but lm_head and the routers. `weight_scale_2` shared
  across a fused group (max amax), `input_scale` = amax / (6 · 448) (max over the group), as ModelOpt's
  export does; dequantization by `NVFP4QTensor.dequantize`.
- mxfp4 (gpt_oss): the released gpt-oss layout: `experts.gate_up_proj_blocks` [E, 2I, H/32, 16] U8,
  `experts.gate_up_proj_scales` [E, 2I, H/32] U8 (E8M0), `down_proj_blocks` / `down_proj_scales`, biases
  BF16, everything else BF16; `quantization_config` {quant_method: mxfp4, modules_to_not_convert}.
  Encoder: one E8M0 exponent per 32 inputs, 2^ceil(log2(amax/6)) (the scale rounding triton_kernels'
  `downcast_to_mxfp_torch` uses by default), E2M1 round-to-nearest-even, low nibble = even element.
  The reference dequantization is transformers' own `convert_moe_packed_tensors` (its gpt-oss loader).
- ct-nvfp4 (gpt_oss): as for the others, on the experts as llm-compressor quantizes gpt-oss: its
  `LinearExperts` (`gpt_oss_linear_experts`: `mlp.experts.experts.E.{gate,up,down}_proj` with biases, gate
  and up de-interleaved), gate/up sharing their global scale; router (`re:.*mlp.router$`) and lm_head
  ignored; the down projections calibrated on the clamped GLU of the biased gate and up.
- modelopt-nvfp4 (gpt_oss): ModelOpt's export of the fused experts, step by step as its
  `_export_quantized_weight` does for `GptOssExperts` (see `gpt_oss_modelopt_nvfp4`); the
  dequantization kept for the experts is ModelOpt's own, [E, out, in], experts 0 and 1.

Calibration: the activation amax of each linear's input is read from the family's FP32 trace
(trace-fp32.safetensors: the input norm's output for q/k/v and q_a/kv_a, the q_a/kv_a norms' for
q_b/kv_b, `o_proj:input`, `experts:input` for every expert's gate/up, i.e. all experts calibrated on
every token); an expert's down_proj input is computed from the BF16 weights on every token.
"""
import argparse
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

E2M1_MAX, E4M3_MAX = 6.0, 448.0


def trace(src):
    with safe_open(os.path.join(src, "trace-fp32.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def linears(sd, family):
    """Quantizable 2-D linear weights (module names), in a stable order."""
    out = []
    for k, v in sd.items():
        if not k.endswith(".weight") or v.dim() != 2 or not k.startswith("model.layers."):
            continue
        m = k[: -len(".weight")]
        if m.endswith("mlp.gate") or "layernorm" in m or m.endswith("_norm") or "norm" in m.split(".")[-1]:
            continue
        out.append(m)
    return sorted(out)


def fused_group(m):
    """The fused group a linear belongs to in vLLM/SGLang (its members share global scales)."""
    for a, bs in ((".q_proj", (".q_proj", ".k_proj", ".v_proj")), (".k_proj", None), (".v_proj", None),
                  (".q_a_proj", (".q_a_proj", ".kv_a_proj_with_mqa")), (".kv_a_proj_with_mqa", None),
                  (".gate_proj", (".gate_proj", ".up_proj")), (".up_proj", None)):
        if m.endswith(a):
            base = m[: -len(a)]
            if bs is None:
                for a2, bs2 in ((".q_proj", (".q_proj", ".k_proj", ".v_proj")),
                                (".q_a_proj", (".q_a_proj", ".kv_a_proj_with_mqa")),
                                (".gate_proj", (".gate_proj", ".up_proj"))):
                    if a in bs2:
                        return tuple(base + b for b in bs2)
            return tuple(base + b for b in bs)
    return (m,)


def input_amax(m, tr, sd, cfg):
    """Calibration amax of the input of linear m (see the module docstring)."""
    parts = m.split(".")
    layer = ".".join(parts[:3])
    leaf = parts[-1]
    if leaf in ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa"):
        x = tr[layer + ".input_layernorm"]
    elif leaf == "q_b_proj":
        x = tr[layer + ".self_attn.q_a_layernorm"]
    elif leaf == "kv_b_proj":
        x = tr[layer + ".self_attn.kv_a_layernorm"]
    elif leaf == "o_proj":
        x = tr[m + ":input"]
    elif ".experts." in m:
        x = tr[layer + ".mlp.experts:input"]
        if leaf == "down_proj":
            base = m[: -len(".down_proj")]
            g = x.float() @ sd[base + ".gate_proj.weight"].float().T
            u = x.float() @ sd[base + ".up_proj.weight"].float().T
            if base + ".gate_proj.bias" in sd:  # gpt-oss's linear experts: biases, clamped GLU
                lim = cfg.get("swiglu_limit", 7.0)
                g = (g + sd[base + ".gate_proj.bias"].float()).clamp(max=lim)
                u = (u + sd[base + ".up_proj.bias"].float()).clamp(-lim, lim)
                x = (u + 1) * g * torch.sigmoid(1.702 * g)
            else:
                x = torch.nn.functional.silu(g) * u
    elif leaf in ("gate_proj", "up_proj"):  # shared experts, dense MLP
        x = tr[layer + ".post_attention_layernorm"]
    elif leaf == "down_proj":
        x = tr[m + ":input"]
    else:
        raise SystemExit(f"no calibration input for {m}")
    return x.float().abs().amax()


def keep_deq(m):
    """The weights whose producer dequantization is kept: layer 1's, routed experts 0 and 1 only."""
    if not m.startswith("model.layers.1."):
        return False
    return ".experts." not in m or any(f".experts.{e}." in m for e in (0, 1))


def gpt_oss_linear_experts(sd):
    """transformers' fused gpt-oss experts as llm-compressor's `LinearExperts` holds them for quantizing
    (`convert_model_for_quantization_gptoss`): per expert E three nn.Linear with bias,
    `mlp.experts.experts.E.{gate,up,down}_proj`, gate and up de-interleaved from `gate_up_proj`
    [E, H, 2I] (gate column 2i, up column 2i + 1) and transposed to [I, H]; `down_proj` [E, I, H] → [H, I];
    the biases split the same way."""
    new = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p, b = k[: -len("gate_up_proj")], sd[k + "_bias"]
            for e in range(v.shape[0]):
                new[f"{p}experts.{e}.gate_proj.weight"] = v[e][:, 0::2].T.contiguous()
                new[f"{p}experts.{e}.up_proj.weight"] = v[e][:, 1::2].T.contiguous()
                new[f"{p}experts.{e}.gate_proj.bias"] = b[e][0::2].contiguous()
                new[f"{p}experts.{e}.up_proj.bias"] = b[e][1::2].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            p, b = k[: -len("down_proj")], sd[k + "_bias"]
            for e in range(v.shape[0]):
                new[f"{p}experts.{e}.down_proj.weight"] = v[e].T.contiguous()
                new[f"{p}experts.{e}.down_proj.bias"] = b[e].contiguous()
        elif not (k.endswith("_bias") and ".mlp.experts." in k):
            new[k] = v
    return new


def ct_nvfp4(family, sd, cfg, tr, out):
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    args = scheme.weights
    router = "router" if family == "gpt_oss" else "gate"
    qs = [m for m in linears(sd, family) if not m.endswith("mlp." + router)]
    gsc = {m: generate_gparam(sd[m + ".weight"].float().amin(), sd[m + ".weight"].float().amax()) for m in qs}
    new, deq = {k: v for k, v in sd.items()}, {}
    for m in qs:
        W = sd[m + ".weight"]
        o, i = W.shape
        g = torch.stack([gsc[x] for x in fused_group(m) if x in gsc]).amin(0)
        blocks = W.float().view(o, i // 16, 16)
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=g)
        c = NVFP4PackedCompressor.compress({"weight": W, "weight_scale": scale, "weight_global_scale": g}, scheme)
        a = input_amax(m, tr, sd, cfg)
        del new[m + ".weight"]
        new[m + ".weight_packed"] = c["weight_packed"].contiguous()
        new[m + ".weight_scale"] = c["weight_scale"].contiguous()
        new[m + ".weight_global_scale"] = g.reshape(1).float().contiguous()
        new[m + ".input_global_scale"] = generate_gparam(-a, a).reshape(1).float().contiguous()
        if keep_deq(m):
            deq[m + ".weight"] = dequantize(
                x_q=unpack_fp4_from_uint8(c["weight_packed"], o, i, dtype=torch.float32),
                scale=c["weight_scale"].to(torch.float32), zero_point=None, args=args,
                dtype=torch.float32, global_scale=g).contiguous()
    qc = QuantizationConfig(
        config_groups={"group_0": scheme}, quant_method="compressed-tensors", format="nvfp4-pack-quantized",
        quantization_status="compressed", ignore=["lm_head", f"re:.*mlp.{router}$"],
    ).model_dump(mode="json")
    qc["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    qc["version"] = "0.20.0"
    write(out, cfg, qc, new, deq, {"producer": "compressed-tensors", "producer_version": "0.20.0"})


def modelopt_linears(qs, sd, amax_w, amax_x, new, deq):
    """ModelOpt's NVFP4 of plain linears: `weight_scale_2` shared across a fused group (max amax),
    `input_scale` = amax / (6 · 448) (max over the group), as ModelOpt's export does; its
    dequantization kept for `keep_deq`'s weights."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    for m in qs:
        grp = [x for x in fused_group(m) if x in amax_w]
        s2 = torch.stack([amax_w[x] for x in grp]).amax() / (E2M1_MAX * E4M3_MAX)
        qt, ws, ws2 = NVFP4QTensor.quantize(sd[m + ".weight"], 16, weights_scaling_factor_2=s2.float())
        new[m + ".weight"] = qt._quantized_data.contiguous()
        new[m + ".weight_scale"] = ws.contiguous()
        new[m + ".weight_scale_2"] = ws2.float().reshape(()).contiguous()
        new[m + ".input_scale"] = (torch.stack([amax_x[x] for x in grp]).amax() / (E2M1_MAX * E4M3_MAX)).float().reshape(()).contiguous()
        if keep_deq(m):
            deq[m + ".weight"] = qt.dequantize(dtype=torch.float32, scale=ws, double_scale=ws2,
                                               block_sizes={-1: 16}).contiguous()


def modelopt_write(out, cfg, new, deq, exclude):
    """A ModelOpt checkpoint: `quantization_config` and hf_quant_config.json of NVFP4."""
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
          "exclude_modules": exclude}
    hq = {"producer": {"name": "modelopt", "version": "0.47.0"},
          "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                           "exclude_modules": exclude}}
    write(out, cfg, qc, new, deq, {"producer": "modelopt", "producer_version": "0.47.0"}, hq)


def modelopt_nvfp4(family, sd, cfg, tr, out):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    qs = [m for m in linears(sd, family) if family != "deepseek_v3" or ".mlp." in m]
    amax_w = {m: sd[m + ".weight"].float().abs().amax() for m in qs}
    amax_x = {m: input_amax(m, tr, sd, cfg) for m in qs}
    new, deq = {k: v for k, v in sd.items()}, {}
    modelopt_linears(qs, sd, amax_w, amax_x, new, deq)
    exclude = ["lm_head"] + sorted({".".join(k.split(".")[:-1]) for k in sd if k.endswith(".weight")
                                    and k.startswith("model.layers.") and ".".join(k.split(".")[:-1]) not in qs
                                    and (k.endswith("mlp.gate.weight") or "_proj" in k)})
    modelopt_write(out, cfg, new, deq, exclude)


def gpt_oss_modelopt_nvfp4(family, sd, cfg, tr, out):
    """ModelOpt's NVFP4 export of gpt-oss, step by step as its `_export_quantized_weight` does it for a
    BMM-style expert module (`GptOssExperts`): the fused [E, in, out] weight transposed to [E, out, in],
    one weight_scale_2 for the whole tensor (one weight quantizer per projection: amax over every
    expert / 2688), `NVFP4QTensor.quantize` along `in`, then packed bytes and block scales transposed
    back: `gate_up_proj` U8 [E, in/2, out], `gate_up_proj_weight_scale` [E, in/16, out],
    `_weight_scale_2` and `_input_scale` F32 scalars (one input quantizer per projection). Every other
    Linear but the router and lm_head as a plain NVFP4 linear (q/k/v sharing weight_scale_2)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    new, deq = {k: v for k, v in sd.items()}, {}
    lim, alpha = cfg.get("swiglu_limit", 7.0), 1.702
    for k, v in sd.items():
        if not (k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")):
            continue
        layer = k[: k.index(".mlp.")]
        x = tr[layer + ".mlp.experts:input"].float()
        x = x.reshape(-1, x.shape[-1])
        if k.endswith("gate_up_proj"):
            amax_x = x.abs().amax()
        else:  # the down projection's input: every expert's clamped SwiGLU on every token
            gu_w, gu_b = sd[layer + ".mlp.experts.gate_up_proj"].float(), sd[layer + ".mlp.experts.gate_up_proj_bias"].float()
            gu = torch.einsum("td,edn->etn", x, gu_w) + gu_b[:, None, :]
            g, u = gu[..., ::2].clamp(max=lim), gu[..., 1::2].clamp(-lim, lim)
            amax_x = ((u + 1) * g * torch.sigmoid(g * alpha)).abs().amax()
        W = v.transpose(-2, -1).contiguous()  # [E, out, in]
        s2 = (W.float().abs().amax() / (E2M1_MAX * E4M3_MAX)).float()
        qt, ws, ws2 = NVFP4QTensor.quantize(W, 16, weights_scaling_factor_2=s2)
        new[k] = qt._quantized_data.transpose(-2, -1).contiguous()
        new[k + "_weight_scale"] = ws.transpose(-2, -1).contiguous()
        new[k + "_weight_scale_2"] = ws2.float().reshape(()).contiguous()
        new[k + "_input_scale"] = (amax_x / (E2M1_MAX * E4M3_MAX)).float().reshape(()).contiguous()
        if ".layers.1." in k:  # experts 0 and 1, [E, out, in] as ModelOpt dequantizes them
            d = qt.dequantize(dtype=torch.float32, scale=ws, double_scale=ws2, block_sizes={-1: 16})
            deq[k] = d[:2].contiguous()
    qs = [m for m in linears(sd, family) if not m.endswith("mlp.router")]
    amax_w = {m: sd[m + ".weight"].float().abs().amax() for m in qs}
    amax_x = {m: input_amax(m, tr, sd, cfg) for m in qs}
    modelopt_linears(qs, sd, amax_w, amax_x, new, deq)
    exclude = ["lm_head"] + sorted({k[: -len(".weight")] for k in sd if k.endswith("mlp.router.weight")})
    modelopt_write(out, cfg, new, deq, exclude)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_encode(w):
    """[R, K] float → blocks [R, K/32, 16] U8, scales [R, K/32] U8 (E8M0)."""
    r, k = w.shape
    b = w.float().reshape(r, k // 32, 32)
    amax = b.abs().amax(-1)
    m, e = torch.frexp(amax / 6.0)  # amax/6 = m·2^e, m in [0.5, 1)
    exp = torch.where(m == 0.5, e - 1, e)  # ceil(log2(amax/6)); exact power of two stays
    exp = torch.where(amax == 0, torch.full_like(exp, -127), exp).clamp(-127, 127)
    y = b / torch.ldexp(torch.ones_like(amax), exp).unsqueeze(-1)
    mag = y.abs().clamp(max=6.0)
    d = (mag.unsqueeze(-1) - E2M1).abs()
    best = d.min(-1, keepdim=True).values
    ties = d == best
    # nearest; on a tie the even code (codes 0, 2, 4, 6 have an even mantissa bit)
    cand = torch.where(ties, torch.arange(8).expand_as(d), torch.full_like(d, 99, dtype=torch.long))
    even = torch.where(cand % 2 == 0, cand, torch.full_like(cand, 99)).amin(-1)
    anyc = cand.amin(-1)
    code = torch.where(even < 99, even, anyc)
    code = code | ((y < 0).long() << 3)
    code = code.to(torch.uint8).reshape(r, k // 32, 16, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def mxfp4(family, sd, cfg, tr, out):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    new, deq = {}, {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            wt = v.float().transpose(1, 2).contiguous()  # [E, out, in], as released
            e, o, i = wt.shape
            blocks, scales = mxfp4_encode(wt.reshape(e * o, i))
            blocks, scales = blocks.reshape(e, o, i // 32, 16), scales.reshape(e, o, i // 32)
            new[k + "_blocks"], new[k + "_scales"] = blocks, scales
            if ".layers.1." in k:  # experts 0 and 1 of the [E, in, out] result
                deq[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[:2].contiguous()
        else:
            new[k] = v
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    write(out, cfg, qc, new, deq, {"producer": "gpt-oss release layout (this script's encoder)"})


def write(out, cfg, qc, tensors, deq, meta, hq=None):
    os.makedirs(out, exist_ok=True)
    c = dict(cfg)
    c["quantization_config"] = qc
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    if hq is not None:
        with open(os.path.join(out, "hf_quant_config.json"), "w") as f:
            json.dump(hq, f, indent=2)
            f.write("\n")
    meta = {"format": "pt", **{k: str(v) for k, v in meta.items()}}
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, os.path.join(out, "model.safetensors"),
              metadata=meta)
    save_file(deq, os.path.join(out, "dequant-layer1.safetensors"), metadata=meta)
    print(out, len(tensors), "tensors,", len(deq), "dequantized")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--family", default="qwen3_moe,deepseek_v3,gpt_oss")
    ap.add_argument("--kinds", default="ct-nvfp4,modelopt-nvfp4,mxfp4", help="gpt_oss: which checkpoints to write")
    a = ap.parse_args()
    for fam in a.family.split(","):
        d = os.path.join(a.src, fam)
        sd = load_file(os.path.join(d, "model.safetensors"))
        cfg = json.load(open(os.path.join(d, "config.json")))
        tr = trace(d)
        if fam == "gpt_oss":
            if "mxfp4" in a.kinds:
                mxfp4(fam, sd, cfg, tr, os.path.join(d, "mxfp4"))
            if "modelopt-nvfp4" in a.kinds:
                gpt_oss_modelopt_nvfp4(fam, sd, cfg, tr, os.path.join(d, "modelopt-nvfp4"))
            if "ct-nvfp4" in a.kinds:
                ct_nvfp4(fam, gpt_oss_linear_experts(sd), cfg, tr, os.path.join(d, "ct-nvfp4"))
        else:
            ct_nvfp4(fam, sd, cfg, tr, os.path.join(d, "ct-nvfp4"))
            modelopt_nvfp4(fam, sd, cfg, tr, os.path.join(d, "modelopt-nvfp4"))


if __name__ == "__main__":
    main()
