"""Unsharded float32 replica of the tensor-parallel training check of tests/gpu/test_graphed.py:
how far its SGD loop drifts (max |dx|, max |h|, weight spread) over the replays, on CPU.

    OMP_NUM_THREADS=1 python3 tools/sgd_divergence.py --ffn 16384 --tokens 2048 --lr 1e-4   # world 8, old lr: NaN ~step 96
    OMP_NUM_THREADS=1 python3 tools/sgd_divergence.py --ffn 16384 --tokens 2048 --lr 2.5e-5 # stable_lr at world 8

Same block as the test (RMSNorm -> Linear -> GELU(tanh) -> Linear -> + residual -> RMSNorm, hidden
1024), the same initialisation scales, fresh random x, r, dy, dh every step. A sequence-parallel
check over ``world`` ranks is this block with ``tokens = 256 x world``, ``ffn = 2048 x world``.
"""

import argparse
import math

import torch


def rms(x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.manual_seed(0)
    h_, f_, t_ = args.hidden, args.ffn, args.tokens
    g0 = (1 + 0.2 * torch.randn(h_)).requires_grad_()
    g1 = (1 + 0.2 * torch.randn(h_)).requires_grad_()
    w1 = (torch.randn(f_, h_) / math.sqrt(h_)).requires_grad_()
    b1 = (0.2 * torch.randn(f_)).requires_grad_()
    w2 = (torch.randn(h_, f_) / math.sqrt(f_)).requires_grad_()
    b2 = (0.2 * torch.randn(h_)).requires_grad_()
    opt = torch.optim.SGD([g0, w1, b1, w2, b2, g1], lr=args.lr)
    for step in range(args.steps):
        x = torch.randn(t_, h_, requires_grad=True)
        r = torch.randn(t_, h_, requires_grad=True)
        h = r + torch.nn.functional.gelu(rms(x, g0) @ w1.T + b1, approximate="tanh") @ w2.T + b2
        y = rms(h, g1)
        opt.zero_grad()
        torch.autograd.backward((y, h), (torch.randn(t_, h_), torch.randn(t_, h_)))
        if step % 10 == 0 or step >= args.steps - 3:
            print(f"step {step}: max|dx| {x.grad.abs().max():.3g}  max|h| {h.abs().max():.3g}  "
                  f"std W2 {w2.std():.3g}  std W1 {w1.std():.3g}", flush=True)
        opt.step()


if __name__ == "__main__":
    main()
