"""Compression phi (paper §3.3.1): blocks of l tokens, stride d -> one compressed key/value each.

Compressed block i covers tokens [i*d, i*d + l - 1]; there are `nsa_flex.rules.num_cmp(T, l, d)`
of them (0 when T < l). Keys are compressed after RoPE.
"""

import torch
from torch import Tensor, nn


def blocks(x: Tensor, l: int, d: int) -> Tensor:
    """x [B, H, T, D] -> [B, H, num_cmp, l, D] (overlapping views, no copy)."""
    return x.unfold(2, l, d).transpose(-1, -2)


class AvgCompress(nn.Module):
    """phi = mean of the l tokens of each block."""

    def __init__(self, l: int, d: int, head_dim: int):
        super().__init__()
        self.l, self.d = l, d

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[2] < self.l:
            return x.new_zeros(*x.shape[:2], 0, x.shape[-1])
        return x.unfold(2, self.l, self.d).mean(-1)

    def init_weights(self, init_std: float):
        pass


class MLPCompress(nn.Module):
    """phi = learnable MLP over the flattened block with an intra-block position encoding."""

    def __init__(self, l: int, d: int, head_dim: int):
        super().__init__()
        self.l, self.d = l, d
        self.pos = nn.Parameter(torch.zeros(l, head_dim))
        self.fc1 = nn.Linear(l * head_dim, head_dim, bias=True)
        self.fc2 = nn.Linear(head_dim, head_dim, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        B, H, T, D = x.shape
        if T < self.l:
            return x.new_zeros(B, H, 0, D)
        blk = blocks(x, self.l, self.d) + self.pos  # [B, H, N, l, D]
        return self.fc2(nn.functional.gelu(self.fc1(blk.flatten(-2))))

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.pos, std=init_std)
        # start close to mean pooling: fc1 averages the block, fc2 is near identity
        with torch.no_grad():
            D = self.fc2.weight.shape[0]
            eye = torch.eye(D, device=self.fc1.weight.device, dtype=self.fc1.weight.dtype)
            self.fc1.weight.copy_(eye.repeat(1, self.l) / self.l)
            self.fc1.weight.add_(torch.randn_like(self.fc1.weight) * init_std / self.l)
            self.fc1.bias.zero_()
            self.fc2.weight.copy_(eye)
            self.fc2.weight.add_(torch.randn_like(self.fc2.weight) * init_std)
            self.fc2.bias.zero_()


PHI = {"avg": AvgCompress, "mlp": MLPCompress}
