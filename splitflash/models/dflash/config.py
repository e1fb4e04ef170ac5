"""DFlash drafter configuration, parsed from the public HF `config.json`.

Public format (as published with z-lab DFlash drafters; loaded as it is):

config.json (a Qwen3 config plus a `dflash_config` block)
  hidden_size D, num_hidden_layers L, num_attention_heads H, num_key_value_heads H_KV,
  head_dim (default D // H), intermediate_size, rms_norm_eps, vocab_size V,
  rope_theta (top level, or `rope_parameters.rope_theta` in transformers >= 5; only the
  default RoPE type is accepted), layer_types: L x "sliding_attention" | "full_attention"
  (absent: every layer full), sliding_window W (required > 0 when a layer slides),
  num_target_layers (optional: the target's decoder layer count),
  is_causal (optional, top level or inside dflash_config; `causal` is accepted as an alias).
  dflash_config: target_layer_ids (K ids: the output of target decoder layer i, i.e. HF
  `hidden_states[i + 1]`), mask_token_id (inside V), block_size (the trained block size B),
  input_embedding_scale (optional, default 1.0).
  Causality when no flag is given: non-causal inside the block, as in the paper. (Recent
  upstream code defaults sliding layers to causal when the flag is absent; public sliding
  checkpoints set the flag explicitly, and the policy summary always states the causality.)

model.safetensors (or a sharded `model.safetensors.index.json`; an optional `model.`
prefix on every name is accepted)
  fc.weight                                   [D, K*D]   target features -> D
  hidden_norm.weight                          [D]        RMSNorm after fc
  layers.{i}.input_layernorm.weight           [D]
  layers.{i}.self_attn.q_proj.weight          [H*hd, D]
  layers.{i}.self_attn.k_proj.weight          [H_KV*hd, D]  (also projects the context)
  layers.{i}.self_attn.v_proj.weight          [H_KV*hd, D]  (also projects the context)
  layers.{i}.self_attn.o_proj.weight          [D, H*hd]
  layers.{i}.self_attn.{q,k}_norm.weight      [hd]       per-head RMSNorm before RoPE
  layers.{i}.post_attention_layernorm.weight  [D]
  layers.{i}.mlp.{gate,up}_proj.weight        [I, D]     SwiGLU
  layers.{i}.mlp.down_proj.weight             [D, I]
  norm.weight                                 [D]        final RMSNorm before the shared head
There is no embedding and no LM head: both are the target's, shared and frozen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitflash.models.config import TargetConfig

SLIDING = "sliding_attention"
FULL = "full_attention"
# DFlash2 checkpoints carry extra modules (dynamic convolutions, a candidate selector)
# that this drafter does not implement; loading one silently would draft garbage.
_UNSUPPORTED_DFLASH_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank")


def _req(d: dict[str, Any], key: str, where: str = "config.json") -> Any:
    if key not in d:
        raise ValueError(f"DFlash {where} is missing required key {key!r}")
    return d[key]


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"DFlash config {name} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int  # D (equals the target's: embedding and head are shared)
    num_hidden_layers: int  # L draft layers
    num_attention_heads: int  # H
    num_key_value_heads: int  # H_KV
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # V
    layer_types: tuple[str, ...]
    sliding_window: int | None  # W
    target_layer_ids: tuple[int, ...]  # K ids
    mask_token_id: int
    block_size: int  # B the drafter was trained at
    causal: bool | None = None  # None: flag absent in the checkpoint -> non-causal
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], target_num_layers: int | None = None) -> DFlashConfig:
        if not isinstance(d, dict):
            raise ValueError("DFlash config.json must hold a JSON object")
        dcfg = _req(d, "dflash_config")
        if not isinstance(dcfg, dict):
            raise ValueError("DFlash config.json: dflash_config must be an object")
        bad = [k for k in _UNSUPPORTED_DFLASH_KEYS if k in dcfg]
        if bad or "DFlash2DraftModel" in d.get("architectures", []):
            raise ValueError(f"DFlash2 checkpoints are not supported (found {bad or 'DFlash2'})")
        if d.get("attention_bias"):
            raise ValueError("DFlash config.json: attention_bias=true is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"DFlash config.json: hidden_act {d['hidden_act']!r} != 'silu'")
        n_layers = _int(_req(d, "num_hidden_layers"), "num_hidden_layers")
        hidden = _int(_req(d, "hidden_size"), "hidden_size")
        heads = _int(_req(d, "num_attention_heads"), "num_attention_heads")
        layer_types = d.get("layer_types")
        ids = _req(dcfg, "target_layer_ids", "dflash_config")
        if not isinstance(ids, list) or not isinstance(layer_types, list | None):
            raise ValueError("DFlash config: target_layer_ids and layer_types must be lists")
        if layer_types is None:
            if d.get("use_sliding_window"):
                raise ValueError(
                    "DFlash config.json sets use_sliding_window but has no layer_types: "
                    "the per-layer policy is ambiguous; give layer_types explicitly"
                )
            layer_types = [FULL] * n_layers
        causal = d.get("is_causal", dcfg.get("is_causal", dcfg.get("causal")))
        if causal is not None and not isinstance(causal, bool):
            raise ValueError(f"DFlash config: is_causal must be true/false, got {causal!r}")
        known = {"dflash_config", "layer_types", "is_causal", "rope_parameters", "rope_theta"}
        known |= set(cls.__dataclass_fields__)
        n_target = d.get("num_target_layers")
        if n_target is not None and target_num_layers is not None and n_target != target_num_layers:
            raise ValueError(
                f"DFlash config num_target_layers={n_target} but the target has "
                f"{target_num_layers} layers: this drafter was trained for another target"
            )
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=_int(d.get("num_key_value_heads", heads), "num_key_value_heads"),
            head_dim=_int(d.get("head_dim") or hidden // max(heads, 1), "head_dim"),
            intermediate_size=_int(_req(d, "intermediate_size"), "intermediate_size"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(d),
            vocab_size=_int(_req(d, "vocab_size"), "vocab_size"),
            layer_types=tuple(layer_types),
            sliding_window=d.get("sliding_window"),
            target_layer_ids=tuple(ids),
            mask_token_id=_req(dcfg, "mask_token_id", "dflash_config"),
            block_size=dcfg.get("block_size", d.get("block_size", 16)),
            causal=causal,
            num_target_layers=target_num_layers if target_num_layers is not None else n_target,
            input_embedding_scale=float(dcfg.get("input_embedding_scale", 1.0)),
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def from_json(cls, path: str | Path, target_num_layers: int | None = None) -> DFlashConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f), target_num_layers)

    def to_dict(self) -> dict[str, Any]:
        """The public config.json form (round-trips through `from_dict`)."""
        d = dict(self.extra)
        d.setdefault("architectures", ["DFlashDraftModel"])
        d.setdefault("model_type", "qwen3")
        d.update(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            vocab_size=self.vocab_size,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
            hidden_act="silu",
            attention_bias=False,
        )
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.causal is not None:
            d["is_causal"] = self.causal
        d["dflash_config"] = {
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
            "block_size": self.block_size,
        }
        if self.input_embedding_scale != 1.0:
            d["dflash_config"]["input_embedding_scale"] = self.input_embedding_scale
        return d

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            if _int(getattr(self, name), name) <= 0:
                raise ValueError(f"DFlash config {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DFlash config num_attention_heads {self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DFlash config head_dim {self.head_dim} must be even for RoPE")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"DFlash config layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        unknown = sorted({repr(t) for t in self.layer_types if t not in (SLIDING, FULL)})
        if unknown:
            raise ValueError(f"DFlash config: unknown layer type(s) {unknown} ({SLIDING}|{FULL})")
        if SLIDING in self.layer_types:
            w = self.sliding_window
            if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
                raise ValueError(
                    f"DFlash config has sliding layers but sliding_window={w!r}: need an int > 0"
                )
        mask = _int(self.mask_token_id, "mask_token_id")
        if not 0 <= mask < self.vocab_size:
            raise ValueError(
                f"DFlash mask_token_id {mask} is outside the vocab [0, {self.vocab_size})"
            )
        if _int(self.block_size, "block_size") < 2:
            raise ValueError(f"DFlash block_size must be >= 2, got {self.block_size}")
        ids = [_int(i, "target_layer_ids[]") for i in self.target_layer_ids]
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"DFlash target_layer_ids must be non-empty and unique: {ids}")
        n_t = self.num_target_layers
        bad = [i for i in ids if i < 0 or (n_t is not None and i >= n_t)]
        if bad:
            raise ValueError(
                f"DFlash target_layer_ids {bad} out of range for a target with "
                f"{n_t if n_t is not None else '?'} layers"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("DFlash config rms_norm_eps and rope_theta must be > 0")

    def check_target(self, vocab_size: int, hidden_size: int, num_layers: int) -> None:
        """Refuse a target this drafter cannot serve (shared embedding/head, feature ids)."""
        if vocab_size != self.vocab_size or hidden_size != self.hidden_size:
            raise ValueError(
                f"DFlash drafter (V={self.vocab_size}, D={self.hidden_size}) does not fit the "
                f"target (V={vocab_size}, D={hidden_size}): embedding and head are shared"
            )
        if self.num_target_layers is not None and self.num_target_layers != num_layers:
            raise ValueError(
                f"DFlash drafter expects {self.num_target_layers} target layers, target has "
                f"{num_layers}"
            )
        bad = [i for i in self.target_layer_ids if i >= num_layers]
        if bad:
            raise ValueError(f"DFlash target_layer_ids {bad} out of range for {num_layers} layers")

    def check_target_config(self, target: TargetConfig) -> None:
        self.check_target(target.vocab_size, target.hidden_size, target.num_layers)

    @property
    def is_causal(self) -> bool:
        return bool(self.causal)

    @property
    def num_target_features(self) -> int:  # K
        return len(self.target_layer_ids)

    @property
    def feature_dim(self) -> int:  # K * D_target
        return self.num_target_features * self.hidden_size


def _rope_theta(d: dict[str, Any]) -> float:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"DFlash config: bad rope parameters {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"DFlash config: RoPE type {kind!r} is not supported (default only)")
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta)
