"""Forward FLOPs of NSA's attention core (excluding the linear projections), as counted by
torchtitan-style MFU: 2 FLOPs per multiply-add, QK^T and PV per (query, visible key) pair."""

from .config import NSAConfig
from .rules import num_cmp


def visible_keys(cfg: NSAConfig, seq_len: int) -> dict[str, int]:
    """Sum over queries t < seq_len of the keys each branch reads (per head)."""
    T = seq_len
    names = cfg.branch_masks()
    # compressed: token t sees the blocks ended by t, num_cmp(t + 1) of them
    cmp = sum(num_cmp(t + 1, cfg.l, cfg.d) for t in range(T))
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
