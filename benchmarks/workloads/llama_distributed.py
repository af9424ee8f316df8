"""The 1B-class HF Llama (random weights, no download) data-parallel over every rank of a
torchrun job: DDP or FSDP2 (`fully_shard` per decoder layer). The issue-25 workload.

    torchrun --nproc-per-node 2 benchmarks/workloads/llama_distributed.py --wrap ddp|fsdp
    kprof profile --nproc-per-node 2 benchmarks/workloads/llama_distributed.py -- --wrap fsdp

hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192, vocab 128256, bf16, fused
AdamW, batch 4 x 2048 per rank. On a CPU (gloo) use --tiny.
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--wrap", choices=("ddp", "fsdp"), default="ddp")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--seq-len", type=int, default=2048)
p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: a CPU smoke run")
args = p.parse_args()

cuda = torch.cuda.is_available() and not args.tiny
dist.init_process_group("nccl" if cuda else "gloo")
rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
device = torch.device("cuda", local) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)

size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512) if args.tiny else
        dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256))
seq = 64 if args.tiny else args.seq_len
torch.manual_seed(0)  # the same initial weights on every rank
model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=seq, attn_implementation="sdpa", **size))
model = model.to(device, torch.bfloat16 if cuda else torch.float32)
if args.wrap == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
else:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
g = torch.Generator(device="cpu").manual_seed(rank)  # each rank its own data
for step in range(args.steps):
    ids = torch.randint(0, size["vocab_size"], (args.batch_size, seq), generator=g).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
