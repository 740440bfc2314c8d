"""compressed-tensors 0.20.0 MXFP8 (preset MXFP8, format mxfp8-quantized) of the six BF16 producer weights
(shared/fixtures/producers/weights-bf16.safetensors), with compressed-tensors' own decompression."""
import sys, torch
from safetensors.torch import load_file, save_file
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from compressed_tensors.compressors.mxfp8 import MXFP8QuantizationCompressor

src = load_file(sys.argv[1])
scheme = preset_name_to_scheme("MXFP8", ["Linear"]); args = scheme.weights
packed, deq = {}, {}
for k, W in src.items():
    m = k[: -len(".weight")]
    out, inn = W.shape
    blocks = W.float().view(out, inn // 32, 32)
    scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
    sd = MXFP8QuantizationCompressor.compress({"weight": W, "weight_scale": scale}, scheme)
    packed[m + ".weight"] = sd["weight"].contiguous()
    packed[m + ".weight_scale"] = sd["weight_scale"].contiguous()
    d = MXFP8QuantizationCompressor.decompress({"weight": sd["weight"], "weight_scale": sd["weight_scale"]}, scheme)
    deq[m + ":ct"] = d["weight"].float().contiguous()
    print(m, sd["weight"].dtype, tuple(sd["weight"].shape), sd["weight_scale"].dtype, tuple(sd["weight_scale"].shape),
          "scale bytes", int(sd["weight_scale"].min()), int(sd["weight_scale"].max()), "deq dtype", d["weight"].dtype,
          "cos", float(torch.nn.functional.cosine_similarity(d["weight"].float().flatten(), W.float().flatten(), 0)))
meta = {"producer": "compressed-tensors", "producer_version": "0.20.0", "scheme": "MXFP8", "format": "mxfp8-quantized"}
save_file(packed, "ct-mxfp8.safetensors", metadata=meta)
save_file(deq, "ct-mxfp8-dequant.safetensors", metadata=meta)
