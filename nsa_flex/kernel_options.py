"""Block sizes and Triton tile options for FlexAttention's NSA masks.

Group-centric packing makes the selection branch's q block small (one position's G heads, e.g.
16 rows) and its kv block the selection block (64). Default Triton tiles (fwd 128x64, bwd
64x64 and up) do not divide a 16-row block, so we pass explicit tiles through `kernel_options`
(fwd BLOCK_M/BLOCK_N, bwd BLOCK_M1/N1/M2/N2 with N1 % M1 == 0 and M2 % N2 == 0).

torch <= 2.13 filters the backward configs by the sparse block size *before* applying
kernel_options (pytorch #176025), so a 16-row block finds no backward config on GPU.
`install_small_block_bwd_configs()` appends backward configs that divide 16-row blocks to the
candidates of `InductorChoices.get_flex_attention_bwd_configs` (the hook inductor documents for
custom heuristics); they come after the defaults, so masks with large blocks keep the default
choice. Newer torch (PR #184797) applies kernel_options first; the extra configs are harmless.
"""

import math

import torch

PACK_ROWS = 16  # tensor-core minimum for a q tile


def packed_block_size(G: int, spec) -> tuple[int, int]:
    """(q block, kv block) of the packed layout: q block = P positions x G heads, a multiple of
    16 rows; kv block = largest of 64/32/16 dividing the mask's block length (l')."""
    P = PACK_ROWS // math.gcd(G, PACK_ROWS)
    lsel = spec.kv_block or 64
    kb = next((b for b in (64, 32, 16) if lsel % b == 0), lsel)
    return G * P, kb


def _largest_tile(n: int) -> int:
    return next((b for b in (64, 32, 16) if n % b == 0), 16)


def flex_kernel_options(q: torch.Tensor, block_size: tuple[int, int]) -> dict | None:
    if q.device.type != "cuda":
        return None
    QB, KB = block_size
    bm, bn = _largest_tile(QB), _largest_tile(KB)
    return {
        "fwd_BLOCK_M": bm, "fwd_BLOCK_N": bn,
        "bwd_BLOCK_M1": 16, "bwd_BLOCK_N1": bn, "bwd_BLOCK_M2": bm, "bwd_BLOCK_N2": 16,
    }


_installed = False


def install_small_block_bwd_configs():
    """Append small-block backward configs to inductor's flex backward candidates (all threads:
    the backward graph is compiled on autograd's thread, so a thread-local choices handler set
    here would not be seen there; we wrap the method on InductorChoices itself, once)."""
    global _installed
    if _installed:
        return
    from torch._inductor.choices import InductorChoices
    from torch._inductor.template_heuristics.triton import FlexBwDConfig

    original = InductorChoices.get_flex_attention_bwd_configs

    def get_flex_attention_bwd_configs(self, head_dim, dtype, device_type="cuda"):
        confs = list(original(self, head_dim, dtype, device_type))
        stages = 1 if head_dim > 128 else 2
        for extra in (FlexBwDConfig(16, 64, 16, 16, stages, 4),
                      FlexBwDConfig(16, 32, 16, 16, stages, 4),
                      FlexBwDConfig(16, 16, 16, 16, 1, 4)):
            if extra not in confs:
                confs.append(extra)
        return confs

    InductorChoices.get_flex_attention_bwd_configs = get_flex_attention_bwd_configs
    _installed = True


# installed at import, outside any traced region (dynamo cannot trace the patching itself)
install_small_block_bwd_configs()
