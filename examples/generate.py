"""Generate with a fused MLA model: the embedded default preset, or a local checkpoint.

    python examples/generate.py                      # embedded default, seeded random weights
    python examples/generate.py --model DIR --dtype bfloat16 --device cuda
"""

import argparse
import time

import torch

import mla_fuser
from mla_fuser.presets import DEFAULT_PRESET, build_preset

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="local checkpoint directory")
parser.add_argument("--dtype", default="float32")
parser.add_argument("--device", default=None)
parser.add_argument("--max-new-tokens", type=int, default=32)
args = parser.parse_args()
dtype = getattr(torch, args.dtype)

if args.model:
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="vllm_mla", dtype=dtype,
                                                           device_map=args.device).eval()
else:
    model = build_preset(DEFAULT_PRESET, dtype=dtype, device=args.device)
print(model.fusion_report)

device = model.get_input_embeddings().weight.device
prompt = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
start = time.perf_counter()
out = model.generate(prompt, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
elapsed = time.perf_counter() - start
print("generated:", out[0, prompt.shape[1]:].tolist())
print(f"{args.max_new_tokens / elapsed:.1f} tokens/s")
