"""The GPU path, on a CUDA device: skipped where none is visible (these run on the
GPU machine through scripts/gpu_check.sh). References, each independent of the
code under test: the CPU kernels (bit for bit), plain PyTorch on the same GPU,
a float64 single-device Muon, the unsharded model on one device."""
import copy
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import rfsdp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
from muon_reference import ReferenceMuon  # noqa: E402
from slice_training import train_on_slices  # noqa: E402

# The device these tests run on: the GPU where one is visible. Without one, and with
# RFSDP_GPU_TESTS_ON_CPU=1, the CPU stands in for it: a rehearsal that runs every line
# of these tests (the API they call, shapes, paths, the processes) so that they do not
# rot between GPU loans (test_gpu_rehearsal.py runs it in the suite). It says nothing
# of a GPU: its "GPU" side is the CPU's kernels or the device-generic path on the CPU.
if torch.cuda.is_available():
    GPU = torch.device("cuda")
elif os.environ.get("RFSDP_GPU_TESTS_ON_CPU") == "1":
    GPU = torch.device("cpu")
else:
    GPU = None
REHEARSAL = GPU is not None and GPU.type == "cpu"

pytestmark = pytest.mark.skipif(GPU is None,
                                reason="needs a CUDA device (scripts/gpu_check.sh on a GPU machine)")
needs_nccl = pytest.mark.skipif(REHEARSAL, reason="NCCL: on a GPU only (the rehearsal has none)")


def is_on_gpu(t):
    return t.device.type == GPU.type

BLOCKS = [256, 512, 2048, 4096, (32, 32), (64, 64), (5, 7)]  # 1 to 16 elements a thread


def fresh_seed():
    return int(torch.randint(0, 2 ** 30, ()).item())


# -- 8-bit kernels ------------------------------------------------------------

@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_quantise_and_dequantise_equal_the_cpu_kernels_bit_for_bit(block):
    assert REHEARSAL or rfsdp._C.cuda_kernels_built(), "this build has no CUDA kernels (nvcc was not found)"
    g = torch.Generator().manual_seed(fresh_seed())
    # values over 12 decades, zeros and a whole zero row: every code is hit
    x = torch.randn(333, 77, generator=g) * torch.logspace(-6, 6, 77)
    x[7] = 0
    for signed in (True, False):
        xs = x if signed else x.abs()
        q_cpu, a_cpu = rfsdp.quant.quantize_blockwise(xs, block, signed=signed)
        q_gpu, a_gpu = rfsdp.quant.quantize_blockwise(xs.to(GPU), block, signed=signed)
        assert torch.equal(q_gpu.cpu(), q_cpu), "codes differ (%s, signed=%s)" % (block, signed)
        assert torch.equal(a_gpu.cpu(), a_cpu), "absmax differs (%s, signed=%s)" % (block, signed)
        d_cpu = rfsdp.quant.dequantize_blockwise(q_cpu, a_cpu, block, signed=signed)
        d_gpu = rfsdp.quant.dequantize_blockwise(q_gpu, a_gpu, block, signed=signed)
        assert torch.equal(d_gpu.cpu(), d_cpu), "dequantised values differ (%s)" % (block,)
    with pytest.raises(ValueError, match="NaN"):
        rfsdp.quant.quantize_blockwise(torch.full((512,), float("nan"), device=GPU))


def on_path(path, fn):
    """fn() on the GPU path `path`: "kernels" (the CUDA kernels where one exists) or
    "generic" (the device-generic ATen path)."""
    rfsdp.quant.use_device_generic_path(path == "generic")
    try:
        return fn()
    finally:
        rfsdp.quant.use_device_generic_path(False)


@pytest.mark.parametrize("path", ["kernels", "generic"])
@pytest.mark.parametrize("block", [256, (32, 32), 7], ids=str)
def test_8bit_state_steps_on_the_gpu_equal_the_cpu_kernels_bit_for_bit(block, path):
    # The AdamW8bit step (CUDA kernel or generic path) and Muon's 8-bit momentum step
    # (generic path: no CUDA kernel) against the CPU kernels: every parameter, code,
    # scale and update bit for bit (all run adamw_update's IEEE operations, no FMA).
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    rows, row_len = 67, 131
    n = rows * row_len
    nb = rfsdp._C.num_blocks(block, rows, row_len)
    c1, c2 = rfsdp._C.dynamic_map(True), rfsdp._C.dynamic_map(False)
    p0, gr = torch.randn(n, generator=g), 1e-2 * torch.randn(n, generator=g)
    q10 = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    q20 = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    a10, a20 = 0.01 * torch.rand(nb, generator=g), 1e-4 * torch.rand(nb, generator=g)

    def adam(dev):
        t = [x.clone().to(dev) for x in (p0, gr, q10, a10, q20, a20)]
        rfsdp._C.adamw8bit_step(*t, block, row_len, c1, c2, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3)
        return [x.cpu() for x in t]

    want = adam("cpu")
    got = on_path(path, lambda: adam(GPU))
    for name, x, y in zip(["param", "grad", "q1", "absmax1", "q2", "absmax2"], got, want):
        assert torch.equal(x, y), "AdamW8bit %s differs (%s, %s, seed %d)" % (name, block, path, seed)
    if isinstance(block, tuple):
        return
    for beta, nesterov in [(0.95, True), (0.3, False)]:
        def momentum(dev):
            t = [x.clone().to(dev) for x in (gr, q10, a10)]
            out = [torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(nb, device=dev),
                   torch.empty(n, device=dev)]
            rfsdp._C.momentum8bit_step(*t, block, c1, beta, nesterov, *out)
            return [x.cpu() for x in out]
        want = momentum("cpu")
        got = on_path(path, lambda: momentum(GPU))
        for name, x, y in zip(["codes", "absmax", "update"], got, want):
            assert torch.equal(x, y), "momentum %s differs (%s, %s, seed %d)" % (name, block, path, seed)


@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("path", ["kernels", "generic"])
@pytest.mark.parametrize("block", [256, (32, 32)], ids=str)
def test_adamw8bit_on_the_gpu_equals_the_cpu_bit_for_bit(block, path, fmt):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    shapes = [(96, 64), (64, 160), (40,)]  # the 1-D one keeps fp32 moments (small)
    init = [torch.randn(s, generator=g) for s in shapes]
    p_cpu = [nn.Parameter(t.clone()) for t in init]
    p_gpu = [nn.Parameter(t.to(GPU)) for t in init]
    o_cpu = rfsdp.optim.AdamW8bit(p_cpu, lr=1e-3, block=block, min_8bit_size=1000, state_format=fmt)
    o_gpu = rfsdp.optim.AdamW8bit(p_gpu, lr=1e-3, block=block, min_8bit_size=1000, state_format=fmt)
    for _ in range(10):
        grads = [1e-2 * torch.randn(s, generator=g) for s in shapes]
        for a, b, gr in zip(p_cpu, p_gpu, grads):
            a.grad, b.grad = gr.clone(), gr.to(GPU)
        o_cpu.step()
        on_path(path, o_gpu.step)
    for k, (a, b) in enumerate(zip(p_cpu[:2], p_gpu[:2])):  # (the fp32 one: torch's fused AdamW)
        assert torch.equal(b.detach().cpu(), a.detach()), "param %d (%s, seed %d)" % (k, path, seed)
        for name, x in o_cpu.state[a].items():
            if name != "step":
                assert torch.equal(o_gpu.state[b][name].cpu(), x), "%s of param %d (%s)" % (name, k, path)


@pytest.mark.parametrize("momentum_map", ["dynamic", "float8_e4m3fn"])
@pytest.mark.parametrize("path", ["kernels", "generic"])
def test_8bit_muon_momentum_on_the_gpu_equals_the_cpu(path, momentum_map):
    # The momentum depends on the gradients alone: its codes and scales equal the
    # CPU's bit for bit; the parameters (Newton–Schulz in fp32 by cuBLAS) within 1e-5.
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 48), (32, 96)]
    init = [torch.randn(s, generator=g) for s in shapes]
    p_cpu = [nn.Parameter(t.clone()) for t in init]
    p_gpu = [nn.Parameter(t.to(GPU)) for t in init]
    kw = dict(lr=0.02, momentum_dtype="int8", momentum_block=64, ns_dtype=torch.float32,
              momentum_map=momentum_map)
    o_cpu, o_gpu = rfsdp.optim.Muon(p_cpu, **kw), rfsdp.optim.Muon(p_gpu, **kw)
    for _ in range(5):
        for a, b in zip(p_cpu, p_gpu):
            gr = torch.randn(a.shape, generator=g)
            a.grad, b.grad = gr.clone(), gr.to(GPU)
        o_cpu.step()
        on_path(path, o_gpu.step)
    for k, (a, b) in enumerate(zip(p_cpu, p_gpu)):
        for name, x in o_cpu.state[a].items():
            if torch.is_tensor(x) and x.dim() > 0:
                assert torch.equal(o_gpu.state[b][name].cpu(), x), "%s of param %d (seed %d)" % (name, k, seed)
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["kernels", "generic"])
def test_soap_8bit_moments_and_quantised_bases_on_the_gpu_equal_the_cpu(path):
    import test_soap as ts
    seed = fresh_seed()
    torch.manual_seed(seed)
    cpu = ts.Net()
    gpu = copy.deepcopy(cpu).to(GPU)
    start = {n: p.detach().clone() for n, p in cpu.named_parameters()}
    on_cpu, on_gpu = ts.soap(cpu, "int8", state="int8"), ts.soap(gpu, "int8", state="int8")
    for gs in ts.grads(seed):
        ts.set_grads(cpu, gs)
        on_cpu.step()
        ts.set_grads(gpu, {n: v.to(GPU) for n, v in gs.items()})
        on_path(path, on_gpu.step)
    for (n, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        moved = (a.detach() - start[n]).abs().max().item()
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=0, atol=2e-2 * moved,
                                   msg=lambda m: "%s (seed %d): %s" % (n, seed, m))


def test_shampoo_quantised_roots_on_the_gpu_equal_the_cpu():
    import test_shampoo_py as ts
    seed = fresh_seed()
    torch.manual_seed(seed)
    cpu_model = ts.Net()
    gpu_model = copy.deepcopy(cpu_model).to(GPU)
    def quantised(model):  # ts.make's Shampoo, with int8 roots
        mats = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("head")]
        ids = {id(p) for p in mats}
        rest = [p for p in model.parameters() if id(p) not in ids]
        return rfsdp.optim.Shampoo([dict(params=mats), dict(params=rest, use_shampoo=False, lr=3e-3)],
                                   lr=1e-2, betas=(0.9, 0.95), epsilon=1e-6, weight_decay=0.01,
                                   max_preconditioner_dim=ts.B, precondition_frequency=3,
                                   start_preconditioning_step=3, basis_dtype="int8", basis_block=16)
    xs, ys = ts.data(seed)
    cpu_losses = train_on_slices(cpu_model, quantised(cpu_model), xs, ys, 0, 1)
    gpu_losses = train_on_slices(gpu_model, quantised(gpu_model), xs.to(GPU), ys.to(GPU), 0, 1)
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-3, abs=1e-5), "seed %d" % seed


# AdamW8bit, Shampoo and SOAP's 8-bit moments on FSDP2 chunk rows that cut blocks and
# tiles: two processes on one GPU over Gloo (the shared blocks' scales agreed, the cut
# tile rows sent to their owners, which code SOAP's), against one CPU process.
def chunk_row_cases():
    """(name, shapes, optimizer factory): shapes whose torch.chunk rows cut the blocks / tiles."""
    import test_fsdp2_params as tf
    return [("AdamW8bit", tf.CUT[256],
             lambda ps: rfsdp.optim.AdamW8bit(ps, lr=1e-2, block=256, min_8bit_size=256)),
            ("Shampoo", tf.CUT_SHAMPOO, tf.shampoo_of),
            ("SOAP 8-bit moments", tf.CUT_SHAMPOO, tf.soap_8bit_of)]


def train_cut(make, shapes, seed, place):
    """The parameters after test_fsdp2_params' cut gradients' steps; place: a full tensor ->
    the parameter's (or gradient's) tensor here."""
    import test_fsdp2_params as tf
    ps = [nn.Parameter(place(torch.zeros(s))) for s in shapes]
    opt = make(ps)
    for gs in tf.cut_grads(seed, shapes):
        for p, gr in zip(ps, gs):
            p.grad = place(gr)
        opt.step()
    return ps


def fsdp2_chunk_rows_worker(rank, world, seed, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    if GPU.type == "cuda":
        torch.cuda.set_device(0)
    rfsdp.quant.use_device_generic_path(path == "generic")
    mesh = init_device_mesh(GPU.type, (world,))

    def local(t):  # torch.chunk's rows of this rank
        return DTensor.from_local(t.chunk(world)[rank].clone().to(GPU), mesh, [Shard(0)],
                                  shape=t.shape, stride=t.stride())
    return {name: [p.to_local().cpu() for p in train_cut(make, shapes, seed, local)]
            for name, shapes, make in chunk_row_cases()}


@pytest.mark.parametrize("path", ["kernels", "generic"])
def test_adamw8bit_shampoo_and_soap_8bit_on_fsdp2_chunk_rows_on_one_gpu_equal_one_cpu_process(path):
    from ranks import run_ranks
    seed = fresh_seed()
    got = run_ranks(fsdp2_chunk_rows_worker, 2, seed, path, timeout=300)
    for name, shapes, make in chunk_row_cases():
        for i, p in enumerate(train_cut(make, shapes, seed, lambda t: t)):
            want = torch.cat([got[r][name][i] for r in range(2)])
            if name == "AdamW8bit":  # bit for bit, as on the CPU ranks
                assert torch.equal(want, p.detach()), (name, shapes[i], path, seed)
            else:
                torch.testing.assert_close(want, p.detach(), rtol=1e-4, atol=1e-5)


def test_adamw_on_the_gpu_equals_a_float64_reference_in_one_launch_per_group():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 48), (48,), (3, 5, 7), (17,)]
    init = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    mine = [nn.Parameter(t.float().to(GPU)) for t in init]
    settings = [dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01),
                dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)]
    group_of = [0, 0, 1, 1]
    opt = rfsdp.optim.AdamW([dict(params=mine[:2], **settings[0]),
                             dict(params=mine[2:], **settings[1])])
    ref = [t.float().double() for t in init]  # float64, torch.optim.AdamW's formula
    m = [torch.zeros_like(t) for t in ref]
    v = [torch.zeros_like(t) for t in ref]
    for step in range(1, 11):
        for i, a in enumerate(mine):
            gr = torch.randn(a.shape, generator=g)
            a.grad = gr.to(GPU)
            c = settings[group_of[i]]
            b1, b2 = c["betas"]
            gd = gr.double()
            ref[i].mul_(1 - c["lr"] * c["weight_decay"])
            m[i].mul_(b1).add_(gd, alpha=1 - b1)
            v[i].mul_(b2).addcmul_(gd, gd, value=1 - b2)
            denom = (v[i] / (1 - b2 ** step)).sqrt() + c["eps"]
            ref[i].addcdiv_(m[i], denom, value=-c["lr"] / (1 - b1 ** step))
        before = opt._impl.fused_launches()
        opt.step()
        # (on the CPU rfsdp's own kernel steps fp32 AdamW: no fused launch)
        assert opt._impl.fused_launches() - before == (0 if REHEARSAL else 2), \
            "one fused launch per group and step"
    for i, a in enumerate(mine):
        torch.testing.assert_close(a.detach().cpu().double(), ref[i], rtol=1e-5, atol=2e-6,
                                   msg=lambda msg: "seed %d, param %d: %s" % (seed, i, msg))


@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "Muon", "Shampoo"])
def test_an_optimizer_built_on_the_cpu_follows_its_model_to_the_gpu(name):
    """accelerate's order: the optimizer before model.cuda(), two steps on the CPU
    first (state present): the state moves with the parameters, and the run equals
    the same run with the model moved by hand between the steps."""
    from models import Net, optimizer
    seed = fresh_seed()
    kw = {"ns_dtype": torch.float32} if name == "Muon" else {}  # (its default follows the device)

    def make_optimizer(name, params):
        return optimizer(name, params, **kw)
    out = []
    for follow in (True, False):
        torch.manual_seed(seed)
        model = Net()
        opt = make_optimizer(name, model.parameters())
        g = torch.Generator().manual_seed(seed)
        for step in range(4):
            if step == 2:
                if follow:
                    model.to(GPU)
                else:  # by hand: a new optimizer on the GPU loading the CPU one's state
                    sd = opt.state_dict()
                    model.to(GPU)
                    opt = make_optimizer(name, model.parameters())
                    opt.load_state_dict(sd)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(p.device)
            opt.step()
        out.append([p.detach().cpu() for p in model.parameters()])
    assert all(is_on_gpu(p) for p in model.parameters())
    for a, b in zip(*out):
        assert torch.equal(a, b), seed


OPTIMIZERS = {
    "adamw": lambda ps: rfsdp.optim.AdamW(ps),
    "adamw8bit": lambda ps: rfsdp.optim.AdamW8bit(ps, min_8bit_size=1),
    "muon": lambda ps: rfsdp.optim.Muon(ps),
    "shampoo": lambda ps: rfsdp.optim.Shampoo(ps, precondition_frequency=1,
                                              start_preconditioning_step=1),
    "soap": lambda ps: rfsdp.optim.SOAP(ps, precondition_frequency=1),  # a refresh at the NaN step
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_gradient_on_the_gpu_stops_the_step(name, bad):
    # The device-side check (one flag for all tensors) must see one bad element anywhere.
    g = torch.Generator().manual_seed(fresh_seed())
    ps = [nn.Parameter(torch.randn(64, 48, generator=g).to(GPU)) for _ in range(3)]
    opt = OPTIMIZERS[name](ps)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(GPU)
    opt.step()
    before = [p.detach().clone() for p in ps]
    state = {(id(p), k): v.clone() for p, st in opt.state.items() for k, v in st.items()
             if torch.is_tensor(v)}
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(GPU)
    ps[2].grad[63, 47] = bad  # the last element of the last tensor
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        opt.step()
    for a, b in zip(ps, before):
        assert torch.equal(a.detach(), b), "%s changed a parameter" % name
    after = {(id(p), k): v for p, st in opt.state.items() for k, v in st.items()
             if torch.is_tensor(v)}
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k], v) for k, v in state.items()), "%s changed its state" % name


# -- Muon and Shampoo ----------------------------------------------------------

MUON_SHAPES = {"a": (32, 24), "b": (32, 24), "c": (32, 24), "tall": (40, 12), "experts": (4, 16, 8),
               "bias": (24,)}


@pytest.mark.parametrize("ns_dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_muon_on_the_gpu_equals_float64_muon(ns_dtype, tol):
    # Three equal-shape matrices and an expert stack: the batched Newton–Schulz path.
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    init = {n: torch.randn(s, generator=g) for n, s in MUON_SHAPES.items()}
    params = {n: nn.Parameter(t.to(GPU)) for n, t in init.items()}
    muon_names = [n for n in MUON_SHAPES if n != "bias"]
    opt = rfsdp.optim.Muon([dict(params=[params[n] for n in muon_names]),
                            dict(params=[params["bias"]], use_muon=False, lr=1e-2)],
                           lr=0.02, momentum=0.9, weight_decay=0.01, ns_dtype=ns_dtype)
    ref = ReferenceMuon({n: t.double().clone() for n, t in init.items()}, muon_names, lr=0.02,
                        momentum=0.9, weight_decay=0.01, aux_lr=1e-2)
    for _ in range(5):
        grads = {n: torch.randn(s, generator=g) for n, s in MUON_SHAPES.items()}
        for n, p in params.items():
            p.grad = grads[n].to(GPU)
        opt.step()
        ref.step(grads)
    for n, p in params.items():
        # bf16 Newton–Schulz: each update is orthogonal to ~1e-2; 5 steps of lr 0.02
        torch.testing.assert_close(p.detach().cpu().double(), ref.p[n], rtol=tol, atol=tol,
                                   msg=lambda m: "%s (%s, seed %d): %s" % (n, ns_dtype, seed, m))


def test_batched_newton_schulz_equals_one_matrix_at_a_time_on_the_gpu():
    x = torch.randn(6, 48, 80, device=GPU)
    batched = rfsdp._C.newton_schulz(x, 5, "float32")
    for k in range(6):
        one = rfsdp._C.newton_schulz(x[k], 5, "float32")
        torch.testing.assert_close(batched[k], one, rtol=1e-4, atol=1e-5)


def test_shampoo_on_the_gpu_equals_shampoo_on_the_cpu():
    # The CPU Shampoo is checked against the float64 reference in the C++ suite;
    # here the same steps on the GPU (eigh by cuSOLVER, packing by index) agree.
    import test_shampoo_py as ts
    seed = fresh_seed()
    torch.manual_seed(seed)
    cpu_model = ts.Net()
    gpu_model = copy.deepcopy(cpu_model).to(GPU)
    xs, ys = ts.data(seed)
    cpu_losses = train_on_slices(cpu_model, ts.make(cpu_model), xs, ys, 0, 1)
    gpu_losses = train_on_slices(gpu_model, ts.make(gpu_model), xs.to(GPU), ys.to(GPU), 0, 1)
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4, abs=1e-6), "seed %d" % seed
    for (n, a), b in zip(cpu_model.named_parameters(), gpu_model.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: "%s (seed %d): %s" % (n, seed, m))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])
def test_soap_on_the_gpu_equals_soap_on_the_cpu(dtype, tol):
    # The CPU SOAP is checked against the float64 reference in the C++ suite; here
    # the same gradients on the GPU (eigh by cuSOLVER, batched QR) agree within
    # what the C++ test allows the shards (fp32 states: 1e-4 of the displacement);
    # bf16 bases may round a different way (one bf16 unit, 2^-7, of an element).
    import test_soap as ts
    seed = fresh_seed()
    torch.manual_seed(seed)
    cpu = ts.Net()
    gpu = copy.deepcopy(cpu).to(GPU)
    start = {n: p.detach().clone() for n, p in cpu.named_parameters()}
    on_cpu, on_gpu = ts.soap(cpu, dtype), ts.soap(gpu, dtype)
    for g in ts.grads(seed):
        ts.set_grads(cpu, g)
        on_cpu.step()
        ts.set_grads(gpu, {n: v.to(GPU) for n, v in g.items()})
        on_gpu.step()
    assert all(is_on_gpu(v) for st in on_gpu.state.values() for v in st.values() if torch.is_tensor(v)
               and v.dim() > 0)
    for (n, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        moved = (a.detach() - start[n]).abs().max().item()
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=0, atol=tol * moved,
                                   msg=lambda m: "%s (seed %d): %s" % (n, seed, m))


# -- fully_shard on the GPU ----------------------------------------------------

GPT_DIM, GPT_STEPS, GPT_LR = 64, 10, 1e-3
# Not AdamW's 1e-8: where an element's gradient is near rounding noise (a unit the
# batch barely uses), m / (sqrt(v) + eps) turns a difference in the order of the
# sums (2 ranks against 1) into one of up to lr a step (the CPU rehearsal: 1 element
# in 16,384 at 1.3e-5 after 10 steps, 2 seeds in 20). 1e-6 bounds that; the
# comparison is of the algorithm, not of rounding (as test_soap's eps).
GPT_EPS = 1e-6


def gpt(seed, device):
    from train_gpt import GPT
    torch.manual_seed(seed)
    return GPT(GPT_DIM, 3, 4, 32).to(device)


def assert_gpt_params_close(got, want, rtol, atol, seed):
    """Every parameter within rtol, atol, but the attention's key bias: softmax does not
    see it (it adds one value to a query's every score), so its gradient is rounding
    noise whose sign follows the order of the sums (sharded or not, GPU or CPU), and
    AdamW moves it by about lr a step on that noise (found by the CPU rehearsal: 2.5e-5
    apart after 10 steps on 2 ranks). Two runs are held to 2 lr a step apart there."""
    for n, p in want.items():
        g = got[n]
        if n.endswith("qkv.bias"):
            key = slice(GPT_DIM, 2 * GPT_DIM)
            torch.testing.assert_close(g[key], p[key], rtol=0, atol=2 * GPT_LR * GPT_STEPS)
            g, p = torch.cat([g[:GPT_DIM], g[2 * GPT_DIM:]]), torch.cat([p[:GPT_DIM], p[2 * GPT_DIM:]])
        torch.testing.assert_close(g, p, rtol=rtol, atol=atol,
                                   msg=lambda m: "%s (seed %d): %s" % (n, seed, m))


def gpt_batches(seed, steps=GPT_STEPS, batch=8, ctx=32):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, 256, (steps, batch, ctx + 1), generator=g)


def lm_loss(model, idx):
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, 256), idx[:, 1:].reshape(-1))


def reference_gpt(seed, param_dtype):
    """Plain PyTorch on the GPU: float32 master weights and torch's fused AdamW;
    forward and backward on a copy in param_dtype, gradients taken back in float32
    (what FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype=float32) computes)."""
    dev = GPU
    master = gpt(seed, dev)
    work = copy.deepcopy(master).to(param_dtype)
    opt = torch.optim.AdamW(master.parameters(), lr=GPT_LR, eps=GPT_EPS, fused=True)
    losses = []
    for idx in gpt_batches(seed).to(dev):
        with torch.no_grad():
            for w, m in zip(work.parameters(), master.parameters()):
                w.copy_(m)
        work.zero_grad()
        loss = lm_loss(work, idx)
        loss.backward()
        for w, m in zip(work.parameters(), master.parameters()):
            m.grad = w.grad.float()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().cpu() for n, p in master.named_parameters()}


def sharded_gpt_worker(rank, world, backend, seed, param_dtype, init_file, out_file, ckpt_dir):
    if GPU.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method="file://" + init_file, rank=rank, world_size=world)
    model = gpt(seed, GPU)
    mp_policy = None if param_dtype is None else rfsdp.MixedPrecisionPolicy(param_dtype=param_dtype)
    for b in model.blocks:
        rfsdp.fully_shard(b, mp_policy=mp_policy)
    rfsdp.fully_shard(model, mp_policy=mp_policy)
    opt = rfsdp.optim.AdamW(model.parameters(), lr=GPT_LR, eps=GPT_EPS)
    xs = gpt_batches(seed).to(GPU)
    losses = train_on_slices(model, opt, xs, xs, rank, world, loss_of=lambda m, x, y: lm_loss(m, x))
    params = {n: p.cpu() for n, p in rfsdp.full_parameters(model).items()}
    if ckpt_dir:  # the checkpoint round trip on the GPU: save, step, load, step again
        rfsdp.checkpoint.save(ckpt_dir, model, opt)
        before = {n: p.clone() for n, p in rfsdp.full_parameters(model).items()}
        train_on_slices(model, opt, xs[:2], xs[:2], rank, world, loss_of=lambda m, x, y: lm_loss(m, x))
        rfsdp.checkpoint.load(ckpt_dir, model, opt)
        after = rfsdp.full_parameters(model)
        for n in before:
            assert torch.equal(before[n], after[n]), "checkpoint round trip changed %s" % n
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out_file)
    dist.barrier()
    os._exit(0)  # (torch's Gloo threads may abort a normal exit: see rfsdp._comm)


def run_sharded_gpt(world, backend, seed, param_dtype, ckpt=False):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.pt")
        mp.spawn(sharded_gpt_worker, args=(world, backend, seed, param_dtype, os.path.join(d, "init"),
                                           out, os.path.join(d, "ckpt") if ckpt else ""),
                 nprocs=world)
        return torch.load(out)


@pytest.mark.parametrize("param_dtype", [torch.float32, None], ids=["fp32", "default-bf16"])
def test_fully_shard_over_nccl_equals_plain_pytorch(param_dtype):
    # World size 1 (one GPU): the streams, events, prefetch and deferred frees
    # all run; the numbers must be plain PyTorch's. param_dtype None: the GPU
    # default policy, bfloat16 compute with float32 reduction. (The rehearsal:
    # Gloo, and the CPU's default policy, float32.)
    seed = fresh_seed()
    got = run_sharded_gpt(1, "gloo" if REHEARSAL else "nccl", seed, param_dtype,
                          ckpt=param_dtype is None)
    compute = param_dtype or (torch.float32 if REHEARSAL else torch.bfloat16)
    ref_losses, ref_params = reference_gpt(seed, compute)
    tol = 1e-5 if compute == torch.float32 else 2e-3
    assert got["losses"] == pytest.approx(ref_losses, rel=tol, abs=tol), "seed %d" % seed
    assert_gpt_params_close(got["params"], ref_params, tol, tol, seed)


def test_two_processes_on_one_gpu_over_gloo_equal_the_unsharded_model():
    seed = fresh_seed()
    got = run_sharded_gpt(2, "gloo", seed, torch.float32)
    ref_losses, ref_params = reference_gpt(seed, torch.float32)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-4, abs=1e-5), "seed %d" % seed
    assert_gpt_params_close(got["params"], ref_params, 1e-4, 1e-5, seed)


@needs_nccl
def test_a_cpu_module_on_an_nccl_group_is_a_clear_error():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method="file://" + os.path.join(d, "i"), rank=0,
                                world_size=1)
        try:
            with pytest.raises((ValueError, RuntimeError), match="CUDA tensors only"):
                rfsdp.fully_shard(nn.Linear(4, 4))
        finally:
            dist.destroy_process_group()
