"""Low-bit optimizer states from Python. Muon's 8-bit momentum: on fully_shard's
shards (2 ranks, planned with policy.combine(muon, blockwise_8bit)) its codes and
scales equal one process's bit for bit, and a checkpoint saved on 2 ranks
resumes on 1; state_dict round trips exactly; on a small model the 8-bit and
bf16 runs stay within a stated distance of the fp32 one. policy.combine plans in
the row_dims its policies agree on. Shampoo's 8- and 4-bit root bases: the same
(codes bit for bit on fully_shard and one process, a checkpoint from 2 ranks
resumed on 1, state_dict, near the fp32-root run)."""
import functools
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Net, data  # noqa: E402
from slice_training import save_on_two_resume_on_one, set_grads  # noqa: E402
from ranks import run_ranks  # noqa: E402

STEPS = 6
BLOCK = 64


class Mats(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(24, 40) * 0.2)
        self.b = nn.Parameter(torch.randn(30, 16) * 0.2)
        self.experts = nn.Parameter(torch.randn(3, 8, 12) * 0.2)


def grads(seed):
    g = torch.Generator().manual_seed(seed + 7)
    shapes = [(n, p.shape) for n, p in Mats().named_parameters()]
    return [{n: torch.randn(s, generator=g) for n, s in shapes} for _ in range(STEPS)]


def muon(model, dtype="int8"):
    return rfsdp.optim.Muon(model.parameters(), lr=0.02, momentum=0.9, weight_decay=0.01,
                            momentum_dtype=dtype, momentum_block=BLOCK)


def full_codes(model, opt):
    """Every parameter's momentum codes and scales, gathered (rank order is row order)."""
    out = {}
    for n, p in model.named_parameters():
        st = opt.state[p]
        q, a = st["momentum_codes"].reshape(-1), st["momentum_absmax"]
        if dist.is_initialized() and dist.get_world_size() > 1:
            qs = [None] * dist.get_world_size()
            dist.all_gather_object(qs, (q, a))
            q, a = torch.cat([x[0] for x in qs]), torch.cat([x[1] for x in qs])
        out[n] = (q.clone(), a.clone())
    return out


def sharded(kind):
    """A fully_shard'ed Mats, its optimizer and the function gathering its codes:
    kind "muon" (8-bit momentum) or "shampoo:<basis_dtype>"."""
    model = Mats()
    if kind == "muon":
        rfsdp.fully_shard(model, policy=rfsdp.policy.combine(rfsdp.policy.muon(),
                                                            rfsdp.policy.blockwise_8bit(BLOCK)))
        return model, muon(model), full_codes
    rfsdp.fully_shard(model, policy=rfsdp.policy.shampoo(8))
    return model, shampoo(model.parameters(), kind.partition(":")[2]), full_root_codes


def worker(rank, world, seed, ckpt, kind="muon"):
    """STEPS steps of kind on `world` ranks: 2 save after 3, 1 loads and takes the rest."""
    torch.manual_seed(seed)
    model, opt, codes_of = sharded(kind)
    gs = grads(seed)
    first = 0
    if world == 1:
        rfsdp.checkpoint.load(ckpt, model, opt)
        first = 3
    for k, g in enumerate(gs[first:], start=first):
        if world == 2 and k == 3:
            rfsdp.checkpoint.save(ckpt, model, opt)
        set_grads(model, g)
        opt.step()
    return rfsdp.full_parameters(model), codes_of(model, opt)


def requantize_worker(rank, world, seed, ckpt, kind):
    """kind on `world` ranks loads ckpt with requantize=True: its codes."""
    torch.manual_seed(seed)
    model, opt, codes_of = sharded(kind)
    rfsdp.checkpoint.load(ckpt, model, opt, requantize=True)
    return codes_of(model, opt)


def one_process(seed, dtype="int8"):
    torch.manual_seed(seed)
    model = Mats()
    opt = muon(model, dtype)
    for g in grads(seed):
        set_grads(model, g)
        opt.step()
    return model, opt


def test_8bit_muon_momentum_on_fully_shard_is_one_process_bit_for_bit_and_resumes_on_one_rank():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = save_on_two_resume_on_one(worker, seed)  # 2 ranks save after 3 steps; 1 finishes
    model, opt = one_process(seed)
    want = full_codes(model, opt)
    for world, (full, codes) in zip((2, 1), got):
        for n, p in model.named_parameters():
            assert torch.equal(codes[n][0], want[n][0]), (n, world, seed)
            assert torch.equal(codes[n][1], want[n][1]), (n, world, seed)
            torch.testing.assert_close(full[n], p.detach(), rtol=0, atol=1e-6,
                                       msg=lambda m: "%s, %d rank(s) (seed %d): %s"
                                       % (n, world, seed, m))


@pytest.mark.parametrize("dtype", [torch.bfloat16, "int8"], ids=["bf16", "int8"])
def test_low_bit_muon_state_dict_round_trip_resumes_exactly(dtype):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)
    model = Mats()
    opt = muon(model, dtype)
    gs = grads(seed)
    for g in gs[:3]:
        set_grads(model, g)
        opt.step()
    saved = opt.state_dict()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    m2 = Mats()
    with torch.no_grad():
        for n, p in m2.named_parameters():
            p.copy_(params[n])
    o2 = muon(m2, dtype)
    o2.load_state_dict(saved)
    for g in gs[3:]:
        for mod, o in ((model, opt), (m2, o2)):
            set_grads(mod, g)
            o.step()
    for (n, p), p2 in zip(model.named_parameters(), m2.parameters()):
        assert torch.equal(p, p2), (n, seed)
    names = {"int8": {"momentum_codes", "momentum_absmax"}}.get(dtype, {"momentum_buffer"})
    assert set(opt.state[model.a]) == names
    if dtype == "int8":
        assert opt.state[model.a]["momentum_codes"].dtype == torch.uint8
        assert opt.state[model.a]["momentum_absmax"].numel() == 24 * 40 // BLOCK
    else:
        assert opt.state[model.a]["momentum_buffer"].dtype == torch.bfloat16


def train(dtype, momentum_map, seed, steps=40):
    """A small regression model trained by Muon (matrices) and AdamW (the rest);
    its losses and final parameters."""
    torch.manual_seed(seed)
    model = Net()
    mats = [p for n, p in model.named_parameters() if p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = rfsdp.optim.Muon([dict(params=mats), dict(params=rest, use_muon=False, lr=1e-2)],
                           lr=0.02, momentum_dtype=dtype, momentum_block=BLOCK,
                           momentum_map=momentum_map)
    xs, ys = data(seed)
    losses = []
    for k in range(steps):
        x, y = xs[k % len(xs)], ys[k % len(ys)]
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in mats], opt.state_bytes()


def test_low_bit_muon_stays_near_the_fp32_run():
    # 40 steps of Muon on a small regression model diverge from any perturbation
    # (Newton-Schulz lifts small singular directions): measured (AMD EPYC, 8
    # seeds), the final matrices' distance from the fp32 run's, relative to the
    # fp32 run's displacement (Frobenius): bf16 0.11-0.24, int8 dynamic 0.27-0.32,
    # int8 linear 0.25-0.38; the mean of the last 10 losses within 0.8 % of fp32's
    # for all three. Bounds: about 1.5x the distances, 2.5x the losses.
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)
    start = [p.detach().clone() for p in Net().parameters() if p.dim() == 2]
    base, w32, bytes32 = train(torch.float32, "dynamic", seed)

    def norm(ts):
        return sum((t ** 2).sum() for t in ts).sqrt().item()
    moved = norm([a - b for a, b in zip(w32, start)])
    for dtype, cmap, bound, state_ratio in ((torch.bfloat16, "dynamic", 0.35, 0.6),
                                            ("int8", "dynamic", 0.5, 0.42),
                                            ("int8", "linear", 0.55, 0.42)):
        losses, w, nbytes = train(dtype, cmap, seed)
        far = norm([a - b for a, b in zip(w, w32)]) / moved
        assert far <= bound, (dtype, cmap, far, seed)
        late, late32 = sum(losses[-10:]), sum(base[-10:])
        assert abs(late - late32) <= 0.02 * late32, (dtype, cmap, late / late32, seed)
        # Muon's momenta shrink to 1/2 (bf16) or ~1/4 (8-bit); the AdamW part is unchanged.
        assert nbytes <= state_ratio * bytes32, (dtype, nbytes, bytes32)


def test_8bit_momentum_refuses_cut_blocks_and_bad_settings():
    w = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="momentum_dtype"):
        rfsdp.optim.Muon([w], momentum_dtype=torch.float16)
    with pytest.raises(ValueError, match="momentum_map"):
        rfsdp.optim.Muon([w], momentum_dtype="int8", momentum_map="cubic")
    with pytest.raises(ValueError, match="momentum_block"):
        rfsdp.optim.Muon([w], momentum_dtype="int8", momentum_block=0)


def test_combine_plans_in_the_row_dims_its_policies_agree_on():
    stack = nn.Parameter(torch.zeros(4, 8, 12))  # [E, H, I]: rows of E x H under ragged Muon
    pol = rfsdp.policy.combine(rfsdp.policy.muon(), rfsdp.policy.blockwise_8bit(BLOCK))
    assert pol.row_dims("x", stack) == 2
    assert pol.granule("x", stack) == BLOCK // 4  # 64 / gcd(64, 12) rows of 12
    pol = rfsdp.policy.combine(rfsdp.policy.blockwise_8bit(BLOCK), rfsdp.policy.shampoo(8))
    assert pol.row_dims("x", stack) == 2 and pol.granule("x", stack) == 16  # lcm(16, 8)
    with pytest.raises(ValueError, match="rows of 1 and 2 leading dims"):
        rfsdp.policy.combine(rfsdp.policy.muon(whole=True),
                             rfsdp.policy.shampoo(8)).row_dims("x", stack)


# --- Shampoo's quantised root bases ---------------------------------------------------

ROOT_STATES = ("root_left_basis_codes", "root_left_basis_absmax", "root_left_eigenvalues",
               "root_right_basis_codes", "root_right_basis_absmax", "root_right_eigenvalues")


def shampoo(params, basis="int4", **kw):
    kw = dict(dict(lr=1e-2, betas=(0.9, 0.95), epsilon=1e-6, weight_decay=0.01,
                   max_preconditioner_dim=8, precondition_frequency=2,
                   start_preconditioning_step=2, basis_dtype=basis, basis_block=16), **kw)
    return rfsdp.optim.Shampoo(params, **kw)


def full_root_codes(model, opt):
    """Every parameter's root codes, scales and s, gathered (each rank's tiles in
    row order: the ranks' sequences joined in rank order are one process's)."""
    out = {}
    for n, p in model.named_parameters():
        mine = [opt.state[p][k].clone() for k in ROOT_STATES]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            mine = [torch.cat([r[k] for r in every]) for k in range(len(ROOT_STATES))]
        out[n] = mine
    return out


@pytest.mark.parametrize("basis", ["int8", "int4"])
def test_quantised_shampoo_roots_on_fully_shard_are_one_process_bit_for_bit_and_resume(basis):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = save_on_two_resume_on_one(functools.partial(worker, kind="shampoo:" + basis), seed)
    torch.manual_seed(seed)
    model = Mats()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = shampoo(model.parameters(), basis)
    for g in grads(seed):
        set_grads(model, g)
        opt.step()
    want = full_root_codes(model, opt)
    assert want["a"][0].dtype == torch.uint8
    assert want["a"][0].numel() == 3 * 5 * (64 if basis == "int8" else 32)  # 24 x 40: 3 x 5 tiles
    for world, (full, codes) in zip((2, 1), got):
        for n, p in model.named_parameters():
            for k, name in enumerate(ROOT_STATES):
                assert torch.equal(codes[n][k], want[n][k]), (n, name, world, seed)
            moved = (p.detach() - start[n]).abs().max().item()
            torch.testing.assert_close(full[n], p.detach(), rtol=0, atol=1e-5 * moved,
                                       msg=lambda m: "%s, %d rank(s) (seed %d): %s"
                                       % (n, world, seed, m))


def test_quantised_shampoo_state_dict_round_trip_resumes_exactly_and_bad_settings_are_errors():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)
    model = Mats()
    opt = shampoo(model.parameters(), "int8")
    gs = grads(seed)
    for g in gs[:3]:
        set_grads(model, g)
        opt.step()
    saved = opt.state_dict()
    m2 = Mats()
    with torch.no_grad():
        for p2, p in zip(m2.parameters(), model.parameters()):
            p2.copy_(p)
    o2 = shampoo(m2.parameters(), "int8")
    o2.load_state_dict(saved)
    for g in gs[3:]:
        for mod, o in ((model, opt), (m2, o2)):
            set_grads(mod, g)
            o.step()
    for (n, p), p2 in zip(model.named_parameters(), m2.parameters()):
        assert torch.equal(p, p2), (n, seed)
    assert set(opt.state[model.a]) == {"step", "exp_avg", "exp_avg_sq", "factor_left",
                                       "factor_right", "root_failures"} | set(ROOT_STATES)
    w = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="basis_dtype"):
        rfsdp.optim.Shampoo([w], basis_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="basis_map"):
        rfsdp.optim.Shampoo([w], basis_dtype="int4", basis_map="dynamic")
    with pytest.raises(ValueError, match="bjorck_iterations"):
        rfsdp.optim.Shampoo([w], basis_dtype="int4", bjorck_iterations=-1)


def train_shampoo(basis, seed, steps=40):
    """The small regression model trained by Shampoo (matrices; the rest grafted
    Adam): its losses, final matrices and state bytes."""
    torch.manual_seed(seed)
    model = Net()
    mats = [p for n, p in model.named_parameters() if p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = shampoo([dict(params=mats), dict(params=rest, use_shampoo=False)], basis, lr=3e-3,
                  epsilon=1e-8, weight_decay=0.0, max_preconditioner_dim=16,
                  precondition_frequency=5, start_preconditioning_step=5, basis_block=64)
    xs, ys = data(seed)
    losses = []
    for k in range(steps):
        loss = nn.functional.mse_loss(model(xs[k % len(xs)]), ys[k % len(ys)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    nbytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0)
    return losses, [p.detach().clone() for p in mats], nbytes


def test_quantised_shampoo_roots_stay_near_the_fp32_run():
    # Measured (AMD EPYC, 6 seeds): the final matrices' distance from the fp32-root
    # run's, relative to its displacement (Frobenius), int8 0.014-0.058, int4
    # 0.111-0.150; the mean of the last 10 losses within 0.5 % of fp32's. State
    # 0.91 / 0.84 of fp32's (m, v and the factors stay fp32). Bounds about 1.7x.
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)
    start = [p.detach().clone() for p in Net().parameters() if p.dim() == 2]
    base, w32, bytes32 = train_shampoo(None, seed)

    def norm(ts):
        return sum((t ** 2).sum() for t in ts).sqrt().item()
    moved = norm([a - b for a, b in zip(w32, start)])
    for basis, bound, state_ratio in (("int8", 0.1, 0.93), ("int4", 0.25, 0.86)):
        losses, w, nbytes = train_shampoo(basis, seed)
        far = norm([a - b for a, b in zip(w, w32)]) / moved
        assert far <= bound, (basis, far, seed)
        late, late32 = sum(losses[-10:]), sum(base[-10:])
        assert abs(late - late32) <= 0.01 * late32, (basis, late / late32, seed)
        assert nbytes <= state_ratio * bytes32, (basis, nbytes, bytes32)


def decoded_momentum(st, settings):
    """A Muon parameter's momentum in float64 from its state (codes decoded in
    float64 with the blocks and map of settings)."""
    if "momentum_buffer" in st:
        return st["momentum_buffer"].double().reshape(-1)
    code = rfsdp._C.code_map(settings["momentum_map"], True).double()
    block = settings["momentum_block"]
    q = st["momentum_codes"].reshape(-1).long()
    return code[q] * st["momentum_absmax"].double().repeat_interleave(block)[:q.numel()]


@pytest.mark.parametrize("src,dst", [
    (dict(momentum_dtype=torch.float32), dict(momentum_dtype="int8", momentum_block=64)),
    (dict(momentum_dtype="int8", momentum_block=64),
     dict(momentum_dtype="int8", momentum_block=128, momentum_map="linear")),
    (dict(momentum_dtype="int8", momentum_block=128), dict(momentum_dtype=torch.bfloat16))],
    ids=["fp32-to-int8", "int8-to-int8-other-blocks-and-map", "int8-to-bf16"])
def test_muon_checkpoint_requantizes_into_another_momentum_storage(src, dst, tmp_path):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)
    model = Mats()
    opt = rfsdp.optim.Muon(model.parameters(), lr=0.02, **src)
    for g in grads(seed)[:3]:
        set_grads(model, g)
        opt.step()
    rfsdp.checkpoint.save(str(tmp_path / "ckpt"), model, opt)
    m2 = Mats()
    o2 = rfsdp.optim.Muon(m2.parameters(), lr=0.02, **dst)
    with pytest.raises(rfsdp.checkpoint.CheckpointError, match="requantize=True"):
        rfsdp.checkpoint.load(str(tmp_path / "ckpt"), m2, o2)
    rfsdp.checkpoint.load(str(tmp_path / "ckpt"), m2, o2, requantize=True)
    s1, s2 = opt.settings(), o2.settings()
    checked = 0
    for (n, p), p2 in zip(model.named_parameters(), m2.parameters()):
        assert torch.equal(p, p2), n
        want = decoded_momentum(opt.state[p], s1)
        st = o2.state[p2]
        if dst["momentum_dtype"] == torch.bfloat16:
            assert torch.equal(st["momentum_buffer"].reshape(-1), want.float().to(torch.bfloat16)), n
            continue
        # codes and scales as the float64 quantisation of the saved momentum
        checked += assert_nearest_codes(st["momentum_codes"].reshape(-1).long(),
                                        st["momentum_absmax"].double(), want, s2["momentum_block"],
                                        rfsdp._C.code_map(s2["momentum_map"], True).double(),
                                        1e-6 * want.abs().max().item(), n)
    assert dst["momentum_dtype"] == torch.bfloat16 or checked > 1000
    for g in grads(seed)[3:]:  # and it steps on
        set_grads(m2, g)
        o2.step()
    assert all(torch.isfinite(p).all() for p in m2.parameters())


@pytest.mark.parametrize("kind", ["muon", "shampoo:int4"])
def test_checkpoint_requantized_on_two_ranks_gives_one_process_codes(kind, tmp_path):
    # fp32 Muon momentum -> 8-bit; packed Shampoo roots -> 4-bit bases
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)
    model = Mats()
    if kind == "muon":
        opt, steps = rfsdp.optim.Muon(model.parameters(), lr=0.02, momentum=0.9,
                                      weight_decay=0.01), 3
        m1 = Mats()
        o1, codes_of = muon(m1), full_codes
    else:
        opt, steps = shampoo(model.parameters(), None), 4
        m1 = Mats()
        o1, codes_of = shampoo(m1.parameters(), "int4"), full_root_codes
    for g in grads(seed)[:steps]:
        set_grads(model, g)
        opt.step()
    ckpt = str(tmp_path / "ckpt")
    rfsdp.checkpoint.save(ckpt, model, opt)
    rfsdp.checkpoint.load(ckpt, m1, o1, requantize=True)
    want = codes_of(m1, o1)
    got = run_ranks(requantize_worker, 2, seed, ckpt, kind)[0]
    for n in want:
        for k in range(len(want[n])):
            assert torch.equal(got[n][k], want[n][k]), (n, k, kind, seed)


# --- checkpoints into other basis storage (Shampoo's roots, SOAP's bases) -------------

def tile_places(shape, b=8):
    """A tensor's tiles in tile order, written out here, as (first element, rows,
    cols, row stride): E matrices H x I for [E, H, I], one matrix otherwise, cut
    into tiles of at most b x b."""
    mats, h, w = (shape[0], shape[1], shape[2]) if len(shape) == 3 else (1, shape[0], shape[1])
    return [(e * h * w + r * w + c, min(b, h - r), min(b, w - c), w) for e in range(mats)
            for r in range(0, h, b) for c in range(0, w, b)]


def tiles_of(shape, b=8):
    """(rows, cols) of a tensor's tiles in tile order."""
    return [(r, c) for _, r, c, _ in tile_places(shape, b)]


def unpacked(x, n):
    m = torch.zeros(n, n, dtype=torch.float64)
    k = 0
    for i in range(n):
        m[i, i:] = x[k:k + n - i].double()
        m[i:, i] = x[k:k + n - i].double()
        k += n - i
    return m


def lowbit_values(name, bits):
    x = torch.linspace(-1, 1, 2 ** bits, dtype=torch.float64)
    return x.sign() * x * x if name == "linear_square" else x


def split_codes(codes, absmax, sizes, bits, block):
    """Per matrix (n x n, sizes n): code indices and absmax, from the sequences."""
    out, co, ao = [], 0, 0
    for n in sizes:
        nc, na = (n * n * bits + 7) // 8, -(-n * n // block)
        q = codes[co:co + nc].long()
        if bits == 4:
            q = torch.stack([q % 16, q // 16], 1).reshape(-1)
        out.append((q[:n * n], absmax[ao:ao + na].double()))
        co, ao = co + nc, ao + na
    return out


def decoded_square(q, a, n, bits, block, cmap, iterations):
    """A matrix's codes decoded and Björck-rectified in float64."""
    v = (lowbit_values(cmap, bits)[q] * a.repeat_interleave(block)[:n * n]).view(n, n)
    for _ in range(iterations):
        v = 1.5 * v - 0.5 * v @ v.T @ v
    return v


def assert_nearest_codes(q, a, want, block, code, tol, what, keep_nonzero=False):
    """Codes q (indices) and scales a as the float64 quantisation of want over the
    sorted values `code`: absmax each block's max |.|, each code the nearest
    (keep_nonzero: a value above 0 never the code 0, as second moments are kept);
    values within tol of a midpoint skipped. Returns the codes compared."""
    w = want.reshape(-1).double()
    mids = (code[1:] + code[:-1]) / 2
    blocks = torch.cat([w, torch.zeros(-w.numel() % block, dtype=w.dtype)]).view(-1, block)
    amax = blocks.abs().amax(1)
    torch.testing.assert_close(a, amax, rtol=0, atol=tol, msg=what)
    x = (blocks / amax.unsqueeze(1)).reshape(-1)[:w.numel()]
    clear = (x.unsqueeze(1) - mids.unsqueeze(0)).abs().amin(1) > tol / amax.min().item()
    nearest = (x.unsqueeze(1) - code.unsqueeze(0)).abs().argmin(1)
    if keep_nonzero:
        nearest = torch.where((x > 0) & (nearest == 0), torch.ones_like(nearest), nearest)
    assert torch.equal(q[clear], nearest[clear]), what
    return int(clear.sum())


def saved_roots(st, settings, shape):
    """Per tile side: the root (float64, n x n) and, where quantised, its (Q, s) as a
    Shampoo with these settings uses them."""
    out = {}
    tiles = tiles_of(shape)
    for left, side in ((True, "root_left"), (False, "root_right")):
        sizes = [t[0] if left else t[1] for t in tiles]
        if settings.get("basis_dtype") is None:
            k, rs = 0, []
            for n in sizes:
                rs.append((unpacked(st[side][k:k + n * (n + 1) // 2], n), None))
                k += n * (n + 1) // 2
            out[side] = rs
            continue
        bits = {"int8": 8, "int4": 4}[settings["basis_dtype"]]
        parts = split_codes(st[side + "_basis_codes"], st[side + "_basis_absmax"], sizes, bits,
                            settings["basis_block"])
        s_all, k, rs = st[side + "_eigenvalues"].double(), 0, []
        for n, (q, a) in zip(sizes, parts):
            v = decoded_square(q, a, n, bits, settings["basis_block"], settings["basis_map"],
                               settings["bjorck_iterations"])
            s = s_all[k:k + n]
            rs.append(((v * s) @ v.T, (v, s)))
            k += n
        out[side] = rs
    return out


@pytest.mark.parametrize("src,dst", [(None, "int8"), ("int8", "int4"), ("int4", None)],
                         ids=["packed-to-int8", "int8-to-int4-other-blocks", "int4-to-packed"])
def test_shampoo_checkpoint_requantizes_its_roots(src, dst, tmp_path):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)
    model = Mats()
    opt = shampoo(model.parameters(), src, basis_block=16)
    for g in grads(seed)[:4]:  # roots at steps 2 and 4
        set_grads(model, g)
        opt.step()
    ckpt = str(tmp_path / "ckpt")
    rfsdp.checkpoint.save(ckpt, model, opt)
    m2 = Mats()
    o2 = shampoo(m2.parameters(), dst, basis_block=64)
    with pytest.raises(rfsdp.checkpoint.CheckpointError, match="requantize=True"):
        rfsdp.checkpoint.load(ckpt, m2, o2)
    rfsdp.checkpoint.load(ckpt, m2, o2, requantize=True)
    s1, s2 = opt.settings(), o2.settings()
    checked = 0
    for (n, p), p2 in zip(model.named_parameters(), m2.parameters()):
        a, b = opt.state[p], o2.state[p2]
        for k in ("exp_avg", "exp_avg_sq", "factor_left", "factor_right", "root_failures"):
            assert torch.equal(a[k], b[k]), (n, k)
        want, got = saved_roots(a, s1, tuple(p.shape)), saved_roots(b, s2, tuple(p.shape))
        for side in want:
            sizes = [t[0] if side == "root_left" else t[1] for t in tiles_of(tuple(p.shape))]
            if dst is None:  # the packed root rebuilt from the saved Q and s (fp32)
                for (r, _), (r2, _) in zip(want[side], got[side]):
                    torch.testing.assert_close(r2, r, rtol=0, atol=1e-5 * r.abs().max().item())
                continue
            parts = split_codes(b[side + "_basis_codes"], b[side + "_basis_absmax"].double(), sizes,
                                {"int8": 8, "int4": 4}[dst], 64)
            for j, ((r, qs), (q, am)) in enumerate(zip(want[side], parts)):
                if qs is None:  # from a packed root: its float64 eigh (as the loader's)
                    lam, v = torch.linalg.eigh(r)
                    qs = (v, lam)
                tol = 1e-6 if src is None else 1e-5  # (a decode and Björck in fp32 here)
                checked += assert_nearest_codes(q, am, qs[0], 64,
                                                lowbit_values("linear_square", {"int8": 8, "int4": 4}[dst]),
                                                tol, "%s %s tile %d" % (n, side, j))
            so = torch.cat([w[1][1] if w[1] is not None else torch.linalg.eigh(w[0])[0]
                            for w in want[side]])
            torch.testing.assert_close(b[side + "_eigenvalues"].double(), so, rtol=1e-5, atol=0)
    assert dst is None or checked > 1000
    for g in grads(seed)[4:]:  # and it steps on
        set_grads(m2, g)
        o2.step()
    assert all(torch.isfinite(q).all() for q in m2.parameters())


@pytest.mark.parametrize("src,dst", [(torch.float32, "int4"), ("int8", "int4"), ("int4", torch.bfloat16)],
                         ids=["fp32-to-int4", "int8-to-int4-other-blocks", "int4-to-bf16"])
def test_soap_checkpoint_requantizes_its_bases(src, dst, tmp_path):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)

    def soap(params, basis, block):
        return rfsdp.optim.SOAP(params, lr=1e-2, betas=(0.9, 0.95), precondition_frequency=2,
                                max_preconditioner_dim=8, basis_dtype=basis, basis_block=block,
                                state_dtype="int8")
    model = Mats()
    opt = soap(model.parameters(), src, 16)
    for g in grads(seed)[:4]:
        set_grads(model, g)
        opt.step()
    ckpt = str(tmp_path / "ckpt")
    rfsdp.checkpoint.save(ckpt, model, opt)
    m2 = Mats()
    o2 = soap(m2.parameters(), dst, 64)
    rfsdp.checkpoint.load(ckpt, m2, o2, requantize=True)
    checked = 0
    for (n, p), p2 in zip(model.named_parameters(), m2.parameters()):
        a, b = opt.state[p], o2.state[p2]
        for k in ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax",
                  "factor_left", "factor_right"):
            assert torch.equal(a[k], b[k]), (n, k)
        for left, side in ((True, "basis_left"), (False, "basis_right")):
            sizes = [t[0] if left else t[1] for t in tiles_of(tuple(p.shape))]
            if isinstance(src, torch.dtype):  # the saved bases themselves
                k, want = 0, []
                for m in sizes:
                    want.append(a[side][k:k + m * m].double().view(m, m))
                    k += m * m
            else:
                bits = {"int8": 8, "int4": 4}[src]
                want = [decoded_square(q, am, m, bits, 16, "linear_square", 1)
                        for m, (q, am) in zip(sizes, split_codes(a[side + "_codes"],
                                                                 a[side + "_absmax"], sizes, bits, 16))]
            if dst == torch.bfloat16:
                got = torch.cat([w.reshape(-1) for w in want]).float().to(torch.bfloat16)
                # one bf16 step: the optimizer decodes in float32, which may put a value
                # on the other side of a bf16 midpoint than float64 does (1 run in ~6)
                torch.testing.assert_close(b[side].double(), got.double(), rtol=2 ** -7, atol=0,
                                           msg=lambda m: "seed %d: %s" % (seed, m))
                continue
            parts = split_codes(b[side + "_codes"], b[side + "_absmax"].double(), sizes, 4, 64)
            for j, (w, (q, am)) in enumerate(zip(want, parts)):
                checked += assert_nearest_codes(q, am, w, 64, lowbit_values("linear_square", 4),
                                                1e-6 if isinstance(src, torch.dtype) else 1e-5,
                                                "%s %s tile %d" % (n, side, j))
    assert dst == torch.bfloat16 or checked > 500
    for g in grads(seed)[4:]:
        set_grads(m2, g)
        o2.step()
    assert all(torch.isfinite(q).all() for q in m2.parameters())


@pytest.mark.parametrize("src,dst", [(torch.float32, "int8"), ("int8", torch.float32)],
                         ids=["fp32-to-int8", "int8-to-fp32"])
def test_soap_checkpoint_moves_m_and_v_between_fp32_and_8bit(src, dst, tmp_path):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)

    def soap(params, state):
        return rfsdp.optim.SOAP(params, lr=1e-2, betas=(0.9, 0.95), precondition_frequency=2,
                                max_preconditioner_dim=8, state_dtype=state)
    model = Mats()
    opt = soap(model.parameters(), src)
    for g in grads(seed)[:4]:
        set_grads(model, g)
        opt.step()
    ckpt = str(tmp_path / "ckpt")
    rfsdp.checkpoint.save(ckpt, model, opt)
    m2 = Mats()
    o2 = soap(m2.parameters(), dst)
    with pytest.raises(rfsdp.checkpoint.CheckpointError, match="requantize=True"):
        rfsdp.checkpoint.load(ckpt, m2, o2)
    rfsdp.checkpoint.load(ckpt, m2, o2, requantize=True)
    checked = 0
    for (n, p), p2 in zip(model.named_parameters(), m2.parameters()):
        a, b = opt.state[p], o2.state[p2]
        for k in ("factor_left", "factor_right", "basis_left", "basis_right"):
            assert torch.equal(a[k], b[k]), (n, k)
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            code = rfsdp._C.dynamic_map(signed).double()
            coded = a if src == "int8" else b
            flat = coded[name + "_codes"].reshape(-1)
            row = 0
            for first, rows, cols, stride in tile_places(tuple(p.shape)):
                q = flat.as_strided((rows, cols), (stride, 1), first).long()
                am = coded[name + "_absmax"][row:row + rows].double()
                row += rows
                if src == "int8":  # decoded: the fp32 product of code and scale
                    want = (code[q] * am.unsqueeze(1)).float()
                    got = b[name].reshape(-1).as_strided((rows, cols), (stride, 1), first)
                    assert torch.equal(got, want), (n, name)
                    continue
                want = a[name].reshape(-1).as_strided((rows, cols), (stride, 1), first).double()
                for r in range(rows):  # one block per tile row
                    checked += assert_nearest_codes(q[r], am[r:r + 1], want[r], cols, code,
                                                    1e-6 * want[r].abs().max().item(), n,
                                                    keep_nonzero=not signed)
    assert src == "int8" or checked > 1000
    for g in grads(seed)[4:]:
        set_grads(m2, g)
        o2.step()
    assert all(torch.isfinite(q).all() for q in m2.parameters())
