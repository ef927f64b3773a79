"""Document boundaries of packed token rows."""

import torch


def doc_ids_from_tokens(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index of every position: documents end at (and include) an EOS token."""
    is_eos = (tokens == eos_id).to(torch.int32)
    return (torch.cumsum(is_eos, dim=1) - is_eos).to(torch.long)
