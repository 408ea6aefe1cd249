"""peer_torch: a minimal single-file PyTorch training loop.

A peer baseline for comparing ushard against: the same Llama-style decoder LM
as tools/peer_jax.py (RMSNorm pre-norm, RoPE, SwiGLU, causal attention via
F.scaled_dot_product_attention, untied embedding / output projection, no
biases), float32 master params with bfloat16 autocast, cross-entropy in
float32, AdamW (fused on CUDA). The model's forward (which returns the loss) is
compiled with torch.compile, so AOTAutograd compiles the backward too; the
fused AdamW step runs as one kernel. Runs on one device (cuda if available).

Defaults are the "bench_1b" model. Prints ONE line of JSON to stdout, e.g.
  python tools/peer_torch.py
Tiny CPU smoke test:
  python tools/peer_torch.py --d_model 64 --n_layers 2 --n_heads 4 \
      --d_ff 128 --vocab 256 --seq_len 32 --batch 2
"""
import argparse
import json
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def flops_per_token(n_params_no_embed, n_layers, seq_len, d_model):
    """Training FLOPs per token: 6*N (fwd+bwd matmuls over the weights, N
    excluding the input embedding table and norm scales, including the output projection)
    plus 6*L*T*d for causal attention scores and values (12*L*T*d fwd+bwd,
    halved because of the causal mask)."""
    return 6 * n_params_no_embed + 6 * n_layers * seq_len * d_model


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("vocab", 32000), ("d_model", 2048), ("n_layers", 16),
                          ("n_heads", 16), ("n_kv_heads", None), ("d_ff", 5632),
                          ("seq_len", 2048), ("batch", 16), ("steps", 10),
                          ("warmup", 3), ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--compile_mode", default="default",
                   help='torch.compile mode, e.g. "default", "max-autotune-no-cudagraphs"; '
                        '"none" runs eagerly')
    p.add_argument("--fixed_batch", action="store_true",
                   help="reuse one random batch every step (loss should fall)")
    p.add_argument("--log_loss", action="store_true",
                   help="print every step's loss to stderr (adds a sync per step)")
    a = p.parse_args()
    a.n_kv_heads = a.n_kv_heads or a.n_heads  # default: as many kv heads as heads (16)
    return a


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


def apply_rope(x, cos, sin):
    """x: (B, T, H, hd); rotate the two halves of the head dim (Llama style)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.nh, self.nkv, self.hd = a.n_heads, a.n_kv_heads, a.d_model // a.n_heads
        self.attn_norm, self.mlp_norm = RMSNorm(a.d_model), RMSNorm(a.d_model)
        self.wq = nn.Linear(a.d_model, self.nh * self.hd, bias=False)
        self.wk = nn.Linear(a.d_model, self.nkv * self.hd, bias=False)
        self.wv = nn.Linear(a.d_model, self.nkv * self.hd, bias=False)
        self.wo = nn.Linear(self.nh * self.hd, a.d_model, bias=False)
        self.w_gate = nn.Linear(a.d_model, a.d_ff, bias=False)
        self.w_up = nn.Linear(a.d_model, a.d_ff, bias=False)
        self.w_down = nn.Linear(a.d_ff, a.d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = apply_rope(self.wq(h).view(B, T, self.nh, self.hd), cos, sin)
        k = apply_rope(self.wk(h).view(B, T, self.nkv, self.hd), cos, sin)
        v = self.wv(h).view(B, T, self.nkv, self.hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        if self.nkv != self.nh:  # GQA: query head n uses kv head n // (nh // nkv)
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class LM(nn.Module):
    def __init__(self, a, theta=500000.0):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.d_model)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.final_norm = RMSNorm(a.d_model)
        self.out = nn.Linear(a.d_model, a.vocab, bias=False)
        hd = a.d_model // a.n_heads
        inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.arange(a.seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for name, prm in self.named_parameters():
            if not name.endswith("norm.weight"):
                nn.init.normal_(prm, std=0.02)

    def forward(self, inputs, targets):
        T = inputs.shape[1]
        x = self.embed(inputs).to(torch.bfloat16)  # bf16 residual stream, as in peer_jax
        for layer in self.layers:
            x = layer(x, self.cos[:T], self.sin[:T])
        logits = self.out(self.final_norm(x))  # bf16 matmul under autocast
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    a = parse_args()
    torch.manual_seed(a.seed)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_float32_matmul_precision("high")

    model = LM(a).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    # Norm scales multiply no matmul: leave them out of N, as ushard/metrics.py does.
    n_norm = (2 * a.n_layers + 1) * a.d_model
    n_no_embed = n_params - model.embed.weight.numel() - n_norm
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=cuda)
    cmodel = model if a.compile_mode == "none" else torch.compile(model, mode=a.compile_mode)

    def train_step(tokens):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = cmodel(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    gen = torch.Generator(device=device).manual_seed(a.seed + 1)
    n_batches = 1 if a.fixed_batch else a.warmup + a.steps
    batches = torch.randint(0, a.vocab, (n_batches, a.batch, a.seq_len + 1),
                            generator=gen, device=device)

    loss = None
    for i in range(a.warmup + a.steps):
        if i == a.warmup:  # start the clock once all warmup work has finished
            sync()
            t0 = time.perf_counter()
        loss = train_step(batches[i % n_batches])
        if a.log_loss:
            print(f"step {i} loss {loss.item():.4f}", file=sys.stderr)
    sync()
    elapsed = time.perf_counter() - t0

    step_time = elapsed / a.steps
    tokens_per_s = a.batch * a.seq_len / step_time
    n_devices = 1  # this peer runs on a single device
    fpt = flops_per_token(n_no_embed, a.n_layers, a.seq_len, a.d_model)
    tflops = fpt * tokens_per_s / n_devices / 1e12
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = 989.0 if ("H100" in name or "H200" in name) else None
    print(json.dumps({
        "name": "peer_torch", "tokens_per_s": tokens_per_s, "step_time_s": step_time,
        "tflops_per_device": tflops, "mfu": tflops / peak if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "final_loss": loss.item(), "n_params": int(n_params),
    }))


if __name__ == "__main__":
    main()
