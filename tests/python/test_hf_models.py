"""Hugging Face transformers models (tiny random configs, nothing downloaded) on
rfsdp, 2 ranks (processes, Gloo), against the same model in one process on the
whole batch: Qwen3-MoE (fused 3-D experts) sharded per decoder layer with
gradient checkpointing (reentrant and not); Llama with tied embeddings trained,
saved with save_pretrained from a full state dict, loaded with from_pretrained
into an unsharded model and into rfsdp at another world size (1 rank);
generate() on the sharded model gives the unsharded model's tokens."""
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402

transformers = pytest.importorskip("transformers")

WORLD = 2
STEPS = 3


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=24, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def shard(model, pg=None):
    for layer in model.model.layers:
        rfsdp.fully_shard(layer, process_group=pg)
    rfsdp.fully_shard(model, process_group=pg)
    return model


def train(model, ids, rank, world, checkpointing=None):
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = ids.shape[1] // world
    losses = []
    for s in range(STEPS):
        batch = ids[s, rank * per:(rank + 1) * per]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def params_of(model):
    info = [rfsdp.shard_info(p) for p in model.parameters()]
    if any(i is not None for i in info):
        return rfsdp.full_parameters(model)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def worker(rank, world, seed, d):
    one_rank = dist.new_group([0])  # "another world size": rank 0 alone
    out = {}
    ids = torch.randint(0, 64, (STEPS, 4, 10), generator=torch.Generator().manual_seed(seed))
    for reentrant in (True, False):
        torch.manual_seed(seed)
        m = shard(qwen3_moe())
        out["moe", reentrant] = train(m, ids, rank, WORLD, checkpointing=reentrant), params_of(m)

    torch.manual_seed(seed)
    m = shard(llama())
    out["llama_losses"] = train(m, ids, rank, WORLD)
    m.eval()
    with torch.no_grad():
        out["llama_logits"] = m(input_ids=ids[0]).logits
        prompt = ids[0, :, :4]
        out["generated"] = m.generate(prompt, max_new_tokens=6, do_sample=False,
                                      pad_token_id=0)
    rfsdp.set_state_dict_type(m, "full", rank0_only=True, cpu_offload=True)
    m.save_pretrained(os.path.join(d, "hf"), is_main_process=rank == 0)
    dist.barrier()
    if rank == 0:
        plain = transformers.LlamaForCausalLM.from_pretrained(os.path.join(d, "hf"))
        plain.eval()
        with torch.no_grad():
            out["plain_logits"] = plain(input_ids=ids[0]).logits
            out["plain_generated"] = plain.generate(prompt, max_new_tokens=6, do_sample=False,
                                                    pad_token_id=0)
        again = shard(transformers.LlamaForCausalLM.from_pretrained(os.path.join(d, "hf")),
                      one_rank)
        again.eval()
        with torch.no_grad():
            out["one_rank_logits"] = again(input_ids=ids[0]).logits
    return out if rank == 0 else None


def reference(seed):
    ids = torch.randint(0, 64, (STEPS, 4, 10), generator=torch.Generator().manual_seed(seed))
    out = {}
    for reentrant in (True, False):
        torch.manual_seed(seed)
        m = qwen3_moe()
        out["moe", reentrant] = train(m, ids, 0, 1, checkpointing=reentrant), params_of(m)
    torch.manual_seed(seed)
    m = llama()
    out["llama_losses"] = train(m, ids, 0, 1)
    return out


def test_transformers_models_train_save_and_load_like_one_process():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    with tempfile.TemporaryDirectory() as d:
        got = run_ranks(worker, WORLD, seed, d)[0]
    want = reference(seed)
    for reentrant in (True, False):
        (got_losses, got_params), (want_losses, want_params) = got["moe", reentrant], want["moe", reentrant]
        assert got_losses == pytest.approx(want_losses, rel=1e-5), (reentrant, seed)
        assert set(got_params) == set(want_params)
        for k in want_params:
            torch.testing.assert_close(got_params[k], want_params[k], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: "%s, reentrant %s (seed %d): %s"
                                       % (k, reentrant, seed, m))
    assert got["llama_losses"] == pytest.approx(want["llama_losses"], rel=1e-5), seed
    torch.testing.assert_close(got["plain_logits"], got["llama_logits"], rtol=1e-5, atol=1e-5)
    assert torch.equal(got["generated"], got["plain_generated"]), seed
    assert got["generated"].shape[1] == 10
    torch.testing.assert_close(got["one_rank_logits"], got["llama_logits"], rtol=1e-5, atol=1e-5)
