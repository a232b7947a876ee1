"""A GGUF file as a bf16 Hugging Face folder, for a peer that reads no GGUF (vs_vllm.py).

    python gguf_to_hf.py MODEL.gguf OUT_DIR

transformers dequantizes the GGUF's tensors; its GGUF quantizer is then dropped, so that the
folder saves as plain bf16 weights a server loads like any other. Needs transformers >= 5.25
(5.19's tokenizer conversion drops the `<bos>` the chat template starts with).
"""
from __future__ import annotations

import sys
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 25):
        raise SystemExit(f"gguf_to_hf: needs transformers >= 5.25 (its conversion keeps <bos>), "
                         f"this Python has {transformers.__version__}")

    quantization = GgufConfig(gguf_file=gguf.name, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, quantization_config=quantization,
                                                 dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)  # a folder that exists is a whole one


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python gguf_to_hf.py MODEL.gguf OUT_DIR")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
