"""Shared by the distillation tests (test_distill.py, test_indexer.py)."""

import torch

from nsa_flex import telemetry as tm


def kl_before_and_after(m, x, params, lr: float, steps: int = 60) -> tuple[float, float]:
    """The layer's distillation KL (telemetry) before and after `steps` Adam steps on `params`
    following the distillation alone (the output's own loss is zero)."""
    opt = torch.optim.Adam(params, lr=lr)

    def kl():
        m.telemetry = True
        (0 * m(x)).sum().backward()
        return float(m.telemetry_stats[tm.DISTILL])

    first = kl()
    for _ in range(steps):
        opt.zero_grad()
        kl()
        opt.step()
    return first, kl()


def gpu_kl_pair(shape: dict, sharpen):
    """The flex and reference layers of `shape` (the same weights; `sharpen(layer)` lists the
    linears drawn at std 2 / sqrt(dim): scores of std ~4, block masses far from uniform), each
    run on one batch (2 x 1024 tokens, a document boundary at 300) in bf16 with only the
    distillation's gradient; asserts their KLs agree within 3%. -> (ref, flex, x, doc_ids)."""
    from nsa_flex import NSAAttention, NSAConfig

    torch.manual_seed(0)
    ref = NSAAttention(NSAConfig(**shape, backend="reference")).cuda()
    ref.init_weights()
    with torch.no_grad():
        for lin in sharpen(ref):
            lin.weight.normal_(0, 2 * shape["dim"] ** -0.5)
    flex = NSAAttention(NSAConfig(**shape, backend="flex")).cuda()
    flex.load_state_dict(ref.state_dict())
    x = torch.randn(2, 1024, shape["dim"], device="cuda")
    doc_ids = torch.zeros(2, 1024, dtype=torch.long, device="cuda")
    doc_ids[:, 300:] = 1
    for m in (ref, flex):
        m.telemetry = True
        with torch.autocast("cuda", torch.bfloat16):
            (0 * m(x, doc_ids)).sum().backward()
    kl_ref, kl_flex = float(ref.telemetry_stats[tm.DISTILL]), float(flex.telemetry_stats[tm.DISTILL])
    assert kl_ref > 0.05 and abs(kl_flex - kl_ref) < 0.03 * kl_ref, (kl_ref, kl_flex)
    return ref, flex, x, doc_ids
