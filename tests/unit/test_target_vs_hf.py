"""The target model against HF transformers on the same random weights (Llama and Qwen3),
batched over requests of different lengths through the paged KV cache."""

import pytest
import torch

from splitflash.services.verify.engine import VerifyInput
from splitflash.services.verify.sampling import Sampling
from tests.conftest import tiny_engine, tiny_model


def hf_twin(model):
    """An HF model holding exactly our weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg = model.cfg
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    if cfg.family == "llama":
        hf = LlamaForCausalLM(LlamaConfig(**common))
    else:
        hf = Qwen3ForCausalLM(Qwen3Config(**common))
    state = {}
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, t in model.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            for part, w in zip("qkv", t.split((q_dim, kv_dim, kv_dim)), strict=True):
                state[f"model.{base}{part}_proj.weight"] = w
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = t.split(cfg.intermediate_size)
            state[f"model.{base}gate_proj.weight"] = gate
            state[f"model.{base}up_proj.weight"] = up
        elif name.startswith("lm_head"):
            state[name] = t
        else:
            state[f"model.{name}"] = t
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf.eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logits_match_hf_for_a_batch_of_uneven_requests(family):
    model = tiny_model(family)
    hf = hf_twin(model)
    engine = tiny_engine(model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 11, 1)]
    firsts = {}
    for i, prompt in enumerate(prompts):
        report = engine.prefill(f"r{i}", prompt, Sampling(), (), 100)
        firsts[i] = report.outcome.committed[0]
    # one batched verify step with chains of different lengths, then compare every row
    drafts = [[3, 4, 5], [], [7, 8, 9, 10, 11, 12]]
    items = [
        VerifyInput(f"r{i}", len(p) + 1, d, 100)
        for i, (p, d) in enumerate(zip(prompts, drafts, strict=True))
    ]
    reports = engine.verify(items)
    for i, (prompt, draft) in enumerate(zip(prompts, drafts, strict=True)):
        seq = prompt + [firsts[i]] + draft
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        assert firsts[i] == int(ref[len(prompt) - 1].argmax())
        expect = ref[len(prompt) :].argmax(-1).tolist()  # target tokens after anchor + drafts
        a = reports[i].outcome.accepted_drafts
        assert reports[i].outcome.committed == draft[:a] + [expect[a]]
        assert not reports[i].violations


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_forward_logits_close_to_hf(family):
    model = tiny_model(family, seed=3)
    hf = hf_twin(model)
    engine = tiny_engine(model)
    prompt = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.cache.add("x")
    engine.cache.reserve("x", len(prompt))
    batch = engine._batch([("x", prompt, 0)])
    with torch.no_grad():
        ours = model(batch, engine.cache).logits
        ref = hf(torch.tensor([prompt])).logits[0]
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-5, rel
