"""Weight loading: GGUF files (dequantised through the `gguf` package) and HF checkpoint
directories (config.json + *.safetensors), both into HF tensor names and a TargetConfig."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from splitflash.models.config import TargetConfig

# GGUF tensor name -> HF name (per-layer names use {i}).
_GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF rotate-half halves).

    w: [n_heads * head_dim, in]
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_config(reader) -> TargetConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen3)")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return TargetConfig(
        family=arch,
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 8192)),
        qk_norm=arch == "qwen3",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def load_gguf(path: Path, progress=None) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    """Read and dequantise every tensor of a GGUF file; returns fp32 tensors in HF names."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    cfg = gguf_config(reader)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", tensor.name)
        key = match.group(2) if match else tensor.name
        if key not in _GGUF_NAMES:
            continue  # e.g. rope_freqs: recomputed from rope_theta
        hf_name = _GGUF_NAMES[key]
        if match:
            hf_name = f"layers.{match.group(1)}.{hf_name}"
        # GGUF stores dims innermost-first; dequantize gives the torch [out, in] layout.
        w = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(tensor.shape)])
        if cfg.family == "llama" and key == "attn_q.weight":
            w = _unpermute_rope(w, cfg.num_heads)
        elif cfg.family == "llama" and key == "attn_k.weight":
            w = _unpermute_rope(w, cfg.num_kv_heads)
        state[hf_name] = torch.from_numpy(np.array(w, dtype=np.float32))  # writable copy
        if progress is not None:
            progress()
    return cfg, state


def hf_config(config: dict) -> TargetConfig:
    model_type = config.get("model_type", "llama")
    family = "qwen3" if model_type.startswith("qwen3") else model_type
    heads = int(config["num_attention_heads"])
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return TargetConfig(
        family=family,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        rope_theta=float(config.get("rope_theta", 10000.0)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
        qk_norm=family == "qwen3",
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_hf_dir(path: Path) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} has no config.json (expected an HF checkpoint directory)")
    cfg = hf_config(json.loads(config_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    state = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            state[name.removeprefix("model.")] = tensor
    return cfg, state


def load_checkpoint(path: Path, progress=None) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, progress)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").exists():
            return load_gguf(ggufs[0], progress)
        return load_hf_dir(path)
    raise ValueError(f"{path}: not a .gguf file nor an HF checkpoint directory")


def checkpoint_config(path: Path) -> TargetConfig:
    """The checkpoint's config without its weights, in load_checkpoint's order of formats
    (a GGUF file is memory-mapped: only its header is read)."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").exists():
        return hf_config(json.loads((path / "config.json").read_text()))
    ggufs = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    if not ggufs:
        raise ValueError(f"{path}: not a .gguf file nor an HF checkpoint directory")
    from gguf import GGUFReader

    return gguf_config(GGUFReader(str(ggufs[0])))


def load_tokenizer(path: Path):
    """The tokenizer (with its chat template) stored beside the weights, via transformers."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.is_file():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def load_target(path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Load a target checkpoint into a TargetModel, with a progress bar over the tensors."""
    from rich.progress import Progress

    from splitflash.models.target import build_target

    with Progress(transient=True) as bar:
        task = bar.add_task(f"loading {Path(path).name}", total=None)
        cfg, state = load_checkpoint(Path(path), progress=lambda: bar.advance(task))
    return build_target(cfg, state, dtype=dtype, device=device)
