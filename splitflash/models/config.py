"""Target model configuration: the shape facts every part of splitflash agrees on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetConfig:
    """Shapes of a Llama/Qwen3-family decoder (names as in HF config.json)."""

    family: str  # "llama" | "qwen3"
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # H_KV
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    qk_norm: bool = False  # Qwen3 normalises q and k per head before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in ("llama", "qwen3"):
            raise ValueError(f"unsupported model family {self.family!r} (llama or qwen3)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
