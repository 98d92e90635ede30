"""Hugging Face transformers models (tiny random configs, nothing downloaded) on
rfsdp, 2 ranks (processes, Gloo), against the same model in one process on the
whole batch: Qwen3-MoE (fused 3-D experts) sharded per decoder layer with
gradient checkpointing (reentrant and not); Llama with tied embeddings trained,
saved with save_pretrained from a full state dict, loaded with from_pretrained
into an unsharded model and into rfsdp at another world size (1 rank);
generate() on the sharded model gives the unsharded model's tokens."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402
from slice_training import assert_trains_like, train_on_slices, train_reference  # noqa: E402

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


def hf_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


def train(model, ids, rank, world, checkpointing=None):
    """STEPS steps of torch AdamW, the batch ids[s] split over the ranks (world 1:
    the reference); each step's loss."""
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if world == 1:
        return train_reference(model, opt, ids, ids, loss_of=hf_loss)
    return train_on_slices(model, opt, ids, ids, rank, world, loss_of=hf_loss)


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


@pytest.fixture(scope="module")
def seed():
    return int(torch.randint(0, 2 ** 30, ()).item())


@pytest.fixture(scope="module")
def got(seed, tmp_path_factory):
    """Rank 0's results: the models trained, saved and loaded once for the module."""
    return run_ranks(worker, WORLD, seed, str(tmp_path_factory.mktemp("hf")))[0]


@pytest.fixture(scope="module")
def want(seed):
    return reference(seed)


@pytest.mark.parametrize("reentrant", [True, False])
def test_qwen3_moe_with_checkpointing_has_the_one_process_losses(got, want, seed, reentrant):
    assert got["moe", reentrant][0] == pytest.approx(want["moe", reentrant][0], rel=1e-5), seed


@pytest.mark.parametrize("reentrant", [True, False])
def test_qwen3_moe_with_checkpointing_trains_like_one_process(got, want, seed, reentrant):
    assert_trains_like(want["moe", reentrant][1], got["moe", reentrant][1], rtol=1e-4, atol=1e-5,
                       what="reentrant %s (seed %d)" % (reentrant, seed))


def test_llama_with_tied_embeddings_has_the_one_process_losses(got, want, seed):
    assert got["llama_losses"] == pytest.approx(want["llama_losses"], rel=1e-5), seed


def test_save_pretrained_from_rfsdp_loads_into_an_unsharded_model(got):
    torch.testing.assert_close(got["plain_logits"], got["llama_logits"], rtol=1e-5, atol=1e-5)


def test_save_pretrained_from_rfsdp_loads_into_rfsdp_at_another_world_size(got):
    torch.testing.assert_close(got["one_rank_logits"], got["llama_logits"], rtol=1e-5, atol=1e-5)


def test_generate_on_the_sharded_model_gives_the_unsharded_models_tokens(got, seed):
    assert torch.equal(got["generated"], got["plain_generated"]), seed


def test_generate_on_the_sharded_model_makes_the_tokens_asked(got):
    assert got["generated"].shape[1] == 10  # the prompt's 4, 6 new
