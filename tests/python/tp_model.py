"""A transformer block parallelised as torchtitan does (torch's parallelize_module
with ColwiseParallel / RowwiseParallel over mesh["tp"], then torch FSDP2's
fully_shard over mesh["dp"]), its data, and the one-process reference loop: what
the tensor-parallel tests share.

The fused QKV is stored head-major ([head][q, k, v][head_dim] rows), so
ColwiseParallel's row chunks give each tp rank whole heads (HEADS divides by tp)
and the same forward runs on one process and on a tp rank's heads."""
import torch
import torch.distributed as dist
from torch import nn

DIM, HEADS, FFN = 8, 2, 16
BATCH, SEQ = 4, 3


class Block(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS, ffn=FFN):
        super().__init__()
        self.head_dim = dim // heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # (a k bias has no gradient but rounding: Adam would amplify it)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, -1, 3, self.head_dim)  # (local heads under tp)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


MATRICES = ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight")


def data(seed, steps):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(steps, BATCH, SEQ, DIM, generator=g),
            torch.randn(steps, BATCH, SEQ, DIM, generator=g))


def mesh_2d(dp=2, tp=2):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def mesh_3d(replicate=2, shard=2, tp=2):
    """HSDP x TP, as torchtitan builds it: (dp_replicate, dp_shard, tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (replicate, shard, tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


DP_3D = ("dp_replicate", "dp_shard")  # the 3-D mesh's data-parallel dims (FSDP2's HSDP mesh)


def dp_of(mesh, dims="dp"):
    """(this rank's data-parallel rank, the data-parallel ranks) over mesh[dims]."""
    sub = mesh[dims]
    if sub.ndim == 1:
        return sub.get_local_rank(), sub.size()
    c = sub.get_coordinate()
    return c[0] * sub.size(1) + c[1], sub.size()


def tensor_parallel(model, mesh, dp="dp"):
    """model with torch's tensor parallelism over mesh["tp"] (the block's columns
    and rows as torchtitan splits a layer's), then torch FSDP2 over mesh[dp] (a
    name, or DP_3D: HSDP over (dp_replicate, dp_shard); None: none)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    parallelize_module(model, mesh["tp"], {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                           "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if dp is not None:  # (None: tensor parallelism alone, for another data-parallel wrapper)
        fully_shard(model, mesh=mesh[dp])
    return model


def train(model, opt, xs, ys, dp_rank=0, dp=1, before_step=None, output=None):
    """Each step: this dp rank's slice of the batch (tp ranks share it), mse_loss,
    backward, before_step(), opt.step(). Returns each step's loss of the whole batch.
    output: the dtype the model's output is cast to first (bfloat16 compute)."""
    per = xs.shape[1] // dp
    losses = []
    for x, y in zip(xs, ys):
        sl = slice(dp_rank * per, (dp_rank + 1) * per)
        out = model(x[sl])
        loss = nn.functional.mse_loss(out if output is None else out.to(output), y[sl])
        opt.zero_grad()
        loss.backward()
        if before_step:
            before_step()
        opt.step()
        t = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(t)
            t /= dist.get_world_size()
        losses.append(t.item())
    return losses


def gradients(seed, steps, module=Block):
    """Each step's full gradient of every parameter of module() (seeded: the same
    on every rank)."""
    torch.manual_seed(seed)
    shapes = {n: p.shape for n, p in module().named_parameters()}
    g = torch.Generator().manual_seed(seed + 1)
    return [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(steps)]


def one_process(module, opt_of, seed, steps):
    """The one-process run the meshes are held to: module() seeded with seed,
    opt_of(model), train on data(seed, steps). Returns (each step's loss,
    {name: parameter})."""
    xs, ys = data(seed, steps)
    torch.manual_seed(seed)
    model = module()
    losses = train(model, opt_of(model), xs, ys)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def muon_float64(module, muon_names, seed, steps, **hyper):
    """The float64 one-device Muon the meshes' Muon is held to: module() seeded with
    seed, muon_reference.train on data(seed, steps), Muon on muon_names and its
    AdamW (lr 3e-4) on the rest. Returns (each step's loss, {name: float64 tensor})."""
    import muon_reference
    xs, ys = data(seed, steps)
    torch.manual_seed(seed)
    return muon_reference.train(module(), list(muon_names), xs, ys, aux_lr=3e-4, **hyper)


def resumed_in_one_process(module, opt_of, path, seed, steps):
    """module() seeded with seed and opt_of(model) loaded from an rfsdp.checkpoint
    saved after 2 steps, then the steps from the third of data(seed, steps):
    {name: parameter}."""
    import rfsdp
    xs, ys = data(seed, steps)
    torch.manual_seed(seed)
    model = module()
    opt = opt_of(model)
    rfsdp.checkpoint.load(path, model, opt)
    train(model, opt, xs[2:], ys[2:])
    return {n: p.detach() for n, p in model.named_parameters()}


def one_process_fixed(module, opt_of, seed, steps):
    """module() seeded with seed, stepped by opt_of(model) on gradients(seed,
    steps, module) in one process: (the model, the optimizer)."""
    torch.manual_seed(seed)
    model = module()
    opt = opt_of(model)
    for g in gradients(seed, steps, module):
        for n, p in model.named_parameters():
            p.grad = g[n].clone()
        opt.step()
    return model, opt


def assert_close_all(got, want, what, tol=1e-6):
    """Every element of every tensor in want ({name: tensor}) equals got[name]'s
    within tol (absolute and relative), in float64."""
    for n, w in want.items():
        torch.testing.assert_close(got[n].double(), w.double(), rtol=tol, atol=tol,
                                   msg=lambda m: "%s %s: %s" % (what, n, m))


def full_of(model):
    """{name: the whole tensor} of every parameter (DTensors and rfsdp.fully_shard's
    shards gathered: collective)."""
    import rfsdp
    from torch.distributed.tensor import DTensor
    if any(rfsdp.shard_info(p) is not None for p in model.parameters()):
        return rfsdp.full_parameters(model)
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


# A mixture-of-experts block with expert parallelism as torchtitan builds it: ep
# borrows from the data-parallel ranks (mesh (dp, ep): every rank its own tokens),
# the expert stacks distribute_tensor'd Shard(0) over mesh["ep"] then torch FSDP2
# over mesh["dp"] inside each ep group, everything else FSDP2 over the (dp, ep)
# ranks; a "tp" dim cuts each expert's hidden columns too (ExpertTensorParallel).
# Dense gating keeps it small: each ep rank runs its experts on its ep group's
# tokens (all-gathered), the partial outputs reduce-scattered back (the all-to-all
# a routed MoE does, for every token).
EXPERTS, EXPERT_FFN = 4, 6
EXPERT_STACKS = ("experts.w1", "experts.w2")


class _GradScaled(torch.autograd.Function):
    """x, whose gradient is scaled by s (exactly: forward is the identity)."""
    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


class Experts(nn.Module):
    def __init__(self, experts=EXPERTS, dim=DIM, ffn=EXPERT_FFN):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, ffn) * dim ** -0.5)  # [E, H, I]
        self.w2 = nn.Parameter(torch.randn(experts, ffn, dim) * ffn ** -0.5)  # [E, I, H]

    def forward(self, h, gates):
        """sum over experts e of gates[..., e] * gelu(h w1[e]) w2[e]; under expert
        parallelism this ep rank's experts on its ep group's tokens."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        w1, w2 = self.w1, self.w2
        if not isinstance(w1, DTensor):
            y = torch.einsum("bti,eif->btef", h, w1)
            y = torch.einsum("btef,efo->bteo", nn.functional.gelu(y), w2)
            return (gates.unsqueeze(-1) * y).sum(-2)
        # mesh["ep"], or mesh["ep", "tp"] (each expert's hidden columns cut over tp:
        # partial sums there), FSDP2 having gathered dp.
        mesh = w1.device_mesh
        n = mesh.ndim
        first = mesh.get_local_rank(0) * w1.to_local().shape[0]
        rows, rep, part = [Shard(0)] + [Replicate()] * (n - 1), [Replicate()] * n, [Partial()] * n
        hs, gs = (DTensor.from_local(t, mesh, rows).redistribute(mesh, rep)
                  .to_local(grad_placements=part) for t in (h, gates))
        # Each expert's gradient sums its ep group's tokens, and FSDP2 averages it over
        # dp alone: 1/ep makes it the mean over every rank (torchtitan's gradient
        # divide factor, whose PREMUL_SUM Gloo lacks).
        w1l, w2l = (_GradScaled.apply(w.to_local(), 1.0 / mesh.size(0)) for w in (w1, w2))
        y = torch.einsum("bti,eif->btef", hs, w1l)
        y = torch.einsum("btef,efo->bteo", nn.functional.gelu(y), w2l)
        out = (gs[..., first:first + w1l.shape[0]].unsqueeze(-1) * y).sum(-2)
        return DTensor.from_local(out, mesh, part).redistribute(mesh, rows).to_local()


class MoE(nn.Module):
    def __init__(self, dim=DIM, experts=EXPERTS, ffn=EXPERT_FFN):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts, dim, ffn)

    def forward(self, x):
        h = self.norm(x)
        return x + self.experts(h, nn.functional.softmax(self.router(h), dim=-1))


def expert_parallel(model, mesh, expert_dim=0):
    """model (an MoE) with its expert stacks Shard(0) over mesh["ep"] (torchtitan's
    ExpertParallel; where mesh has a "tp" dim, ExpertTensorParallel: each expert's
    hidden columns Shard over it too, w1's dim 2 and w2's dim 1), then torch FSDP2:
    the experts over mesh["dp"] (their dim expert_dim: torchtitan shards dim 1
    where dp x ep exceeds the experts), the rest over the (dp, ep) ranks flattened."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    tp = "tp" in mesh.mesh_dim_names
    sub = mesh["ep", "tp"] if tp else mesh["ep"]
    for name, cut in (("w1", 2), ("w2", 1)):
        w = getattr(model.experts, name)
        placements = [Shard(0), Shard(cut)] if tp else [Shard(0)]
        setattr(model.experts, name, nn.Parameter(distribute_tensor(w.data, sub, placements)))
    fully_shard(model.experts, mesh=mesh["dp"],
                shard_placement_fn=lambda p: Shard(expert_dim))
    fully_shard(model, mesh=mesh["dp", "ep"]._flatten())
    return model


def mesh_ep(dp=2, ep=2, tp=0):
    """(dp, ep), or (dp, ep, tp) where tp is given."""
    from torch.distributed.device_mesh import init_device_mesh
    if tp:
        return init_device_mesh("cpu", (dp, ep, tp), mesh_dim_names=("dp", "ep", "tp"))
    return init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))


def muon_groups(model, names=MATRICES):
    """Muon's groups: the parameters named (its matrices), the rest AdamW's part."""
    named = list(model.named_parameters())
    return [dict(params=[p for n, p in named if n in names]),
            dict(params=[p for n, p in named if n not in names], use_muon=False, lr=3e-4)]


def resumed_through_dcp(model, opt, xs, ys, dp, ndp, path):
    """opt's state saved by DCP (torch's optimizer path), every state tensor zeroed,
    loaded again; then the steps from the third: the parameters after them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    with torch.no_grad():
        for st in opt.state.values():  # (what the load must bring back)
            for name, t in st.items():
                if name != "step":
                    t.zero_()
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, state["optim"])
    train(model, opt, xs[2:], ys[2:], dp, ndp)
    return full_of(model)
