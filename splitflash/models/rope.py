"""RoPE frequencies shared by the target model and the DFlash drafter."""

from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """[head_dim / 2] fp32 RoPE frequencies."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    return 1.0 / (theta ** (exponents / head_dim))


class RopeFrequencies:
    """rope_inv_freq computed once per device instead of in every forward: five launches
    fewer a step. Not a module buffer, since model.to(bf16) would round it."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta = head_dim, theta
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = rope_inv_freq(self.head_dim, self.theta, device)
        return self._by_device[device]
