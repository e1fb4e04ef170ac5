"""Turning target logits into the distribution a request samples from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits [R, V] -> probabilities [R, V] after temperature, top-k and top-p."""
    scaled = logits.float() / max(sampling.temperature, 1e-6)
    if sampling.top_k > 0 and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
