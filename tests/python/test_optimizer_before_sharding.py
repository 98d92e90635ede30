"""An optimizer built before rfsdp.fully_shard (FSDP2's docs say after; people
write it before) follows the parameters fully_shard replaced to their shards at
its next step, and trains exactly as one built after, on 1 and 2 ranks; one that
stepped the whole parameters before is refused, naming the parameter. The
replaced parameters are never stepped."""
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Net, data, optimizer  # noqa: E402
from ranks import run_ranks  # noqa: E402
from slice_training import assert_trains_like, train_on_slices, train_reference  # noqa: E402

NAMES = ("AdamW", "AdamW8bit", "Muon", "Shampoo", "SOAP")


def train(name, seed, before):
    """Net trained by `name` built before (or after) fully_shard, every rank on the
    whole batch: what the claims below read."""
    torch.manual_seed(seed)
    model = Net()
    originals = [p.detach().clone() for p in model.parameters()]
    old = list(model.parameters())
    opt = optimizer(name, model.parameters()) if before else None
    for b in model.blocks:
        rfsdp.fully_shard(b)
    rfsdp.fully_shard(model)
    if not before:
        opt = optimizer(name, model.parameters())
    losses = train_on_slices(model, opt, *data(seed), 0, 1)
    full = rfsdp.full_parameters(model)
    return {"losses": losses, "params": full,
            "orphans unchanged": all(torch.equal(a, b.detach()) for a, b in zip(originals, old)),
            "bound": all(any(p is q for g in opt.param_groups for q in g["params"])
                         for p in model.parameters()),
            "moved": all(not torch.equal(full[n], a) for n, a in zip(full, originals))}


def _ranks(rank, world, seed):
    return {(name, before): train(name, seed, before) for name in NAMES
            for before in (False, True)}


@pytest.fixture(scope="module", params=[1, 2], ids=["1 rank", "2 ranks"])
def ranks(request):
    """Every rank's runs, on 1 and on 2 ranks: once for the module."""
    return run_ranks(_ranks, request.param, 3, timeout=300)


# (train()'s key: the claim about an optimizer built before fully_shard)
CLAIMS = {"bound": "it steps the model's shards",
          "orphans unchanged": "the parameters fully_shard replaced are not stepped",
          "moved": "it moves every parameter"}


@pytest.mark.parametrize("claim", CLAIMS)
@pytest.mark.parametrize("name", NAMES)
def test_an_optimizer_built_before_sharding_binds_the_shards(ranks, name, claim):
    for results in ranks:
        assert results[name, True][claim], "%s: %s" % (name, CLAIMS[claim])


@pytest.mark.parametrize("name", NAMES)
def test_an_optimizer_built_before_sharding_has_the_losses_of_one_built_after(ranks, name):
    for results in ranks:
        assert results[name, True]["losses"] == results[name, False]["losses"]


@pytest.mark.parametrize("name", NAMES)
def test_an_optimizer_built_before_sharding_trains_as_one_built_after(ranks, name):
    for rank, results in enumerate(ranks):
        assert_trains_like(results[name, False]["params"], results[name, True]["params"],
                           what="%s, rank %d" % (name, rank))


def test_an_optimizer_that_stepped_before_sharding_is_refused_naming_the_parameter(one_rank):
    model = Net()
    opt = optimizer("AdamW", model.parameters())
    x, y = data(0)
    nn.functional.mse_loss(model(x[0]), y[0]).backward()
    opt.step()
    rfsdp.fully_shard(model)
    with pytest.raises(ValueError, match="'embed.weight' was sharded by fully_shard after this "
                                         "optimizer stepped it"):
        opt.step()


def test_a_list_of_parameters_made_before_sharding_is_followed_too(one_rank):
    """params = list(model.parameters()) before fully_shard, the optimizer after."""
    model = Net()
    params = list(model.parameters())
    rfsdp.fully_shard(model)
    opt = optimizer("AdamW", params)
    bound = [p for g in opt.param_groups for p in g["params"]]
    assert len(bound) == len(params) and all(a is b for a, b in zip(bound, model.parameters()))


def _hsdp_before(rank, world):
    """Built before fully_shard over a (replicate 2, shard 1) mesh: its group follows
    the shards' (the shard group, as one built after takes), and it trains as one
    process."""
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(2)
    model = Net()
    opt = optimizer("Muon", model.parameters())
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    for b in model.blocks:
        rfsdp.fully_shard(b, mesh=mesh)
    rfsdp.fully_shard(model, mesh=mesh)
    train_on_slices(model, opt, *data(2), 0, 1)  # (every rank the whole batch)
    return opt.comm.size(), rfsdp.full_parameters(model)


def test_under_hsdp_its_group_follows_the_shards():
    torch.manual_seed(2)
    model = Net()
    train_reference(model, optimizer("Muon", model.parameters()), *data(2))
    for size, full in run_ranks(_hsdp_before, 2, timeout=300):
        assert size == 1
        assert_trains_like({n: p.detach() for n, p in model.named_parameters()}, full, 0, 1e-5)


def test_a_split_typo_is_refused_when_an_optimizer_built_before_binds_the_shards(one_rank):
    model = Net()
    opt = optimizer("Muon", model.parameters())
    pol = rfsdp.policy.muon(split={"blocks.0.fc.weigth": [12, 12]})
    for b in model.blocks:
        rfsdp.fully_shard(b, policy=pol)
    rfsdp.fully_shard(model, policy=pol)
    x, y = data(0)
    nn.functional.mse_loss(model(x[0]), y[0]).backward()
    with pytest.raises(ValueError, match="'blocks.0.fc.weigth' \\(nearest: 'blocks.0.fc.weight'"):
        opt.step()
