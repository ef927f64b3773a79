"""Forward FLOPs of NSA's attention core (excluding the linear projections), as counted by
torchtitan-style MFU: 2 FLOPs per multiply-add, QK^T and PV per (query, visible key) pair."""

from .config import NSAConfig


def visible_keys(cfg: NSAConfig, seq_len: int) -> dict[str, int]:
    """Sum over queries t < seq_len of the keys each branch reads (per head)."""
    T = seq_len
    names = cfg.branch_masks()
    # compressed: blocks i with i*d + l - 1 <= t  ->  floor((t - l + 1) / d) + 1 for t >= l - 1
    cmp = sum((t - cfg.l + 1) // cfg.d + 1 for t in range(cfg.l - 1, T))
    tokens = {
        "causal": T * (T + 1) // 2,
        "sliding_window": sum(min(t + 1, cfg.window) for t in range(T)),
    }
    sel_tokens = sum(min(t + 1, cfg.n_sel * cfg.l_sel) for t in range(T))
    out = {"scorer": cmp if names["sel"] == "topn" else 0}
    out["cmp"] = cmp if names["cmp"] != "none" else 0
    out["sel"] = 0 if names["sel"] == "none" else tokens.get(names["sel"], sel_tokens)
    out["win"] = 0 if names["win"] == "none" else tokens.get(names["win"], sel_tokens)
    return out


def nsa_attention_flops(cfg: NSAConfig, seq_len: int) -> int:
    """Forward attention-core FLOPs of one NSA layer over one sequence of seq_len tokens."""
    keys = visible_keys(cfg, seq_len)
    per_pair = 2 * cfg.n_heads * (cfg.d_qk + cfg.d_v)
    total = per_pair * (keys["cmp"] + keys["sel"] + keys["win"])
    total += 2 * cfg.n_heads * cfg.d_qk * keys["scorer"]  # the scorer's q.K_cmp recomputation
    return int(total)


def full_attention_flops(cfg: NSAConfig, seq_len: int) -> int:
    return int(2 * cfg.n_heads * (cfg.d_qk + cfg.d_v) * seq_len * (seq_len + 1) // 2)
