"""RaggedFSDP beside the real anchors, in one run, on this machine (CPU, Gloo):

 1. rfsdp.fully_shard vs torch FSDP2 (torch.distributed.fsdp.fully_shard) vs
    DistributedDataParallel, torch-style AdamW, on the main job's GPT at each
    width: 2 ranks, each variant its own torchrun job (so each peak RSS is its
    own), same seed, same data. Median step time (ratio to FSDP2), per-rank
    parameter + gradient + optimizer-state bytes, peak RSS, bytes copied per step.
 2. rfsdp.optim.Muon vs torch.optim.Muon on 2-D matrices in one process, with
    the knobs that make them one algorithm (below): largest parameter difference
    over the steps, step time ratio; then rfsdp Muon sharded over 2 ranks.
 3. rfsdp.optim.AdamW8bit vs bitsandbytes' and torchao's 8-bit AdamW (and fp32
    AdamW: torch's and rfsdp's) on the GPT in one process: optimizer-state bytes
    per parameter, optimizer step time, loss after the same steps.
 4. rfsdp.optim.Shampoo vs DistributedShampoo (and DistributedShampoo in float64,
    the truth) on the GPT in one process, the same gradient to each every step:
    update differences, step time with and without roots, factor memory.
 5. The 8-bit kernels alone, rfsdp vs bitsandbytes vs torchao on the same tensors
    (1 thread): GB/s of block-wise quantise and dequantise (block 256, dynamic
    map) and of one AdamW8bit step on one tensor (fp32 AdamW beside it), state
    bytes per parameter.
 6. rfsdp's optimizers on a model sharded by torch FSDP2 (its torch.chunk rows
    cut 8-bit blocks) vs the same model under rfsdp.fully_shard with a
    whole-block plan, torch AdamW on FSDP2 beside them, 2 ranks: median
    optimizer step time, bytes the optimizer sends per step, blocks shared.
 8. rfsdp.optim.SOAP vs the reference SOAP (nikhilvyas/SOAP, a checkout given by
    --soap or $RFSDP_SOAP; measured: a1e5535) in one process, on square
    matrices (full-rank first factors) no larger than max_preconditioner_dim (there the two are one algorithm: the
    reference leaves larger dimensions unpreconditioned, rfsdp tiles them), the
    same gradients: update differences, step time with and without basis
    refreshes, optimizer-state bytes; beside them DistributedShampoo's
    eigenvalue-corrected Shampoo (--distributed-shampoo), which differs in the
    details listed there: the direction (cosine) and size of its update from
    the same parameters, step times, state bytes.
 7. Muon on FSDP2's parameters: rfsdp.optim.Muon vs dion's Muon
    (microsoft/dion, a checkout given by --dion or $RFSDP_DION; measured:
    0a059a4), 2 ranks, the same gradients: step time, bytes sent per step,
    largest distance from a float64 one-device Muon of the same algorithm.
 9. Communication: rfsdp.fully_shard with its comm policies (int8 / float8
    weight codes, bf16 gradients summed in fp32) and bf16 compute beside
    FSDP2's fp32 and bf16 all-gathers, on the GPT at the first width, 2 ranks:
    median step time and bytes leaving each rank per step.

    python bench/compare_anchors.py [--widths 256,512] [--steps 20]
        [--only fsdp,muon,8bit,shampoo,kernels8,fsdp2opt,dion,soap,comm] [--distributed-shampoo DIR]
        [--dion DIR] [--soap DIR]

bitsandbytes and torchao are the bench's optional set-up, not project
dependencies: `--install-anchors` puts them (no dependencies: they use the
project's torch) into ~/.cache/rfsdp/anchors, which only this bench reads.
Without them their rows say "not installed". DistributedShampoo is not on PyPI:
--distributed-shampoo (or $RFSDP_DISTRIBUTED_SHAMPOO) names a checkout of
facebookresearch/optimizers (measured: f606606), else section 4 says so."""
import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from train_gpt import GPT, batches, load_text  # noqa: E402

import rfsdp  # noqa: E402

ANCHORS_DIR = os.path.expanduser(os.environ.get("RFSDP_ANCHORS", "~/.cache/rfsdp/anchors"))
ANCHOR_PINS = ["bitsandbytes==0.50.2", "torchao==0.18.0"]
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.1
FSDP2_SHAMPOO_DIM = 64  # section 6's max_preconditioner_dim
MIB = 2 ** 20


def tensor_bytes(t):
    """Bytes a tensor holds: a DTensor's local shard; a tensor subclass's inner
    tensors (torchao's 8-bit states are codes + scales behind a float32 face)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor \
            and not isinstance(t, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(opt):
    return sum(tensor_bytes(v) for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def median_ms(times):
    return statistics.median(times) * 1e3


# ---- 1. FSDP: rfsdp vs FSDP2 vs DDP -------------------------------------------------

# Section 9's rfsdp runs: fully_shard's arguments for each.
COMM_VARIANTS = {
    "rfsdp": {},
    "rfsdp-bf16": dict(mp_policy=rfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    "rfsdp-int8": dict(comm_policy=rfsdp.CommPolicy(weights="int8")),
    "rfsdp-float8": dict(comm_policy=rfsdp.CommPolicy(weights="float8_e4m3fn")),
    "rfsdp-int8-bf16grad": dict(comm_policy=rfsdp.CommPolicy(weights="int8", gradients=torch.bfloat16)),
}


def fsdp2_units(model, world):
    """FSDP2's units of the GPT as fully_shard wraps it (each block, then the root
    with what the blocks leave): (elements of a rank's padded Shard(0) chunks,
    elements of the full parameters, gathers per step: 2 for blocks, forward and
    backward; 1 for the root)."""
    for mod in list(model.blocks) + [model]:
        own = [p for n, p in mod.named_parameters(recurse=True)
               if mod is not model or not n.startswith("blocks.")]
        local = sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in own)
        yield local, sum(p.numel() for p in own), 2 if mod is not model else 1


def fsdp2_sent_bytes(model, world, param_bytes):
    """Bytes leaving each rank per step in FSDP2 (its padded Shard(0) chunk to
    each of the m-1 others): every gather in the param dtype; one reduce-scatter
    of fp32 gradients per unit."""
    return sum((world - 1) * local * (gathers * param_bytes + 4)
               for local, _, gathers in fsdp2_units(model, world))


def fsdp2_copied_bytes(model, world):
    """FSDP2's own copies per step, from its design (torch 2.11,
    _fsdp_collectives): an all-gather copies each rank's padded Shard(0) chunks
    into a send buffer and every parameter out of the gathered buffer; a
    reduce-scatter copies the full gradients into the rank-major input
    (chunk_cat). Gloo's native ops stage both: (m + 1) x the per-rank bytes each.
    Blocks are gathered twice a step (forward, backward), the root once."""
    total = 0
    for local, full, gathers in fsdp2_units(model, world):
        local, full = 4 * local, 4 * full
        gather = local + full + (world + 1) * local
        reduce = world * local + (world + 1) * local
        total += gathers * gather + reduce
    return total


def fsdp_worker(args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(args.dim, args.layers, args.heads, args.ctx)
    n_params = sum(p.numel() for p in model.parameters())
    copied, sent, gathered_peak = None, None, [0]
    if args.variant == "ddp":
        copied = 2 * n_params * 4  # gradients into the buckets and back
        model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    elif args.variant.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard as fsdp2_fully_shard
        copied = fsdp2_copied_bytes(model, world)
        sent = fsdp2_sent_bytes(model, world, 2 if args.variant == "fsdp2-bf16" else 4)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if args.variant == "fsdp2-bf16" else MixedPrecisionPolicy()
        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fsdp2_fully_shard(b, mesh=mesh, mp_policy=mp)
        fsdp2_fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    else:
        kw = COMM_VARIANTS[args.variant]
        for b in model.blocks:
            rfsdp.fully_shard(b, **kw)
        rfsdp.fully_shard(model, **kw)
        opt = rfsdp.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        units = rfsdp.fsdp.units(model)

        def sample(*_):  # gathered parameter and gradient buffers live now
            gathered_peak[0] = max(gathered_peak[0], sum(u.unit.gathered_bytes() for u in units))

        for u_mod in model.modules():
            if getattr(u_mod, "_rfsdp_unit", None):
                u_mod.register_forward_pre_hook(sample)
                u_mod.register_forward_hook(lambda m, a, out: out.register_hook(sample) and None)
    data = batches(load_text(), args.batch, args.ctx, torch.Generator().manual_seed(rank))
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        x, y = next(data)
        if args.variant.startswith("rfsdp"):
            for u in units:
                u.comm.reset_stats()
                u.unit.reset_bytes_sent()
        dist.barrier()
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x).view(-1, 256), y.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if args.variant.startswith("rfsdp"):
            copied = sum(u.comm.stats()["bytes_copied"] for u in units)
            sent = sum(u.unit.bytes_sent() for u in units)
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    mem = sum(tensor_bytes(p) for p in params) + sum(tensor_bytes(g) for g in grads) + state_bytes(opt)
    if args.variant == "ddp":  # DDP's gradient buckets hold another copy of the gradients
        mem += sum(tensor_bytes(g) for g in grads)
    out = dict(variant=args.variant, dim=args.dim, params=n_params,
               step_ms=median_ms(times[args.warmup:]), mem=mem, gathered=gathered_peak[0],
               copied=copied, sent=sent, loss=losses[-1],
               rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    rows = [None] * world
    dist.all_gather_object(rows, out)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()
    leave()


def leave():
    """Ends a worker. torch 2.11 can abort a process at exit when a Gloo worker
    thread frees a finished collective's Python tensor while the interpreter
    finalises (plain torch: 2 exits in 40; rfsdp guards its own groups, see
    rfsdp._comm, but the FSDP2 and DDP workers have none): leave at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun(nproc, argv):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), os.path.abspath(__file__)] + argv
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit("torchrun %s failed:\n%s" % (" ".join(argv), proc.stdout[-4000:]))


def run_variants(worker, variants, dim, args):
    """{variant: every rank's row}: each variant of `worker` its own 2-rank
    torchrun job (so each peak RSS is its own) at GPT width `dim`."""
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for v in variants:
            out = os.path.join(d, "%s.json" % v)
            torchrun(2, ["--worker", worker, "--variant", v, "--dim", str(dim), "--out", out,
                         "--steps", str(args.steps), "--warmup", str(args.warmup),
                         "--batch", str(args.batch)])
            with open(out) as f:
                results[v] = json.load(f)
    return results


def section_fsdp(args):
    results = {}
    variants = ("fsdp2", "rfsdp", "ddp")
    for dim in args.widths:
        results.update({(v, dim): rows for v, rows in run_variants("fsdp", variants, dim, args).items()})
    print("\n## 1. Sharded data parallelism: 2 ranks (Gloo, 1 thread each), GPT %d layers, "
          "batch %d x %d tokens per rank, AdamW, median of %d steps"
          % (args.layers, args.batch, args.ctx, args.steps))
    print("%-6s %-6s %7s %9s %9s %12s %10s %12s %9s %12s %10s" % (
        "width", "", "params", "step ms", "/ FSDP2", "p+g+s MiB", "/ FSDP2", "+gath. MiB",
        "RSS MiB", "copied MiB", "last loss"))
    for dim in args.widths:
        base = results["fsdp2", dim]
        base_ms = max(r["step_ms"] for r in base)
        base_mem = max(r["mem"] for r in base)
        for v in variants:
            rows = results[v, dim]
            ms = max(r["step_ms"] for r in rows)  # the slowest rank sets the pace
            mem = max(r["mem"] for r in rows)
            gath = max(r["mem"] + r["gathered"] for r in rows)
            print("%-6d %-6s %6.2fM %9.1f %8.2fx %12.2f %9.0f%% %12s %9.0f %12.2f %10.4f" % (
                dim, v, rows[0]["params"] / 1e6, ms, ms / base_ms, mem / MIB, 100 * mem / base_mem,
                "%.2f" % (gath / MIB) if v == "rfsdp" else "-", max(r["rss_mib"] for r in rows),
                max(r["copied"] for r in rows) / MIB, rows[0]["loss"]))
    print("copied: rfsdp counted by its Comm (the per-rank Gloo collectives copy the local slice in "
          "and the reduced slice out); FSDP2 and DDP computed from their designs (FSDP2: "
          "all-gather copy-in/copy-out and reduce-scatter chunk-cat, plus Gloo's staging; DDP: "
          "gradient buckets in and out). +gath.: with the most gathered-unit bytes live at once.")


def section_comm(args):
    """9. Quantised collectives: rfsdp's comm policies beside FSDP2's bf16 all-gather."""
    variants = ("fsdp2", "fsdp2-bf16") + tuple(COMM_VARIANTS)
    dim = args.widths[0]
    results = run_variants("fsdp", variants, dim, args)
    print("\n## 9. Communication: 2 ranks (Gloo), GPT width %d, %d layers, batch %d x %d, AdamW, "
          "median of %d steps; bytes leaving each rank per step (gathers + reduce-scatters)"
          % (dim, args.layers, args.batch, args.ctx, args.steps))
    print("%-22s %9s %9s %12s %10s %10s" % ("", "step ms", "/ FSDP2", "sent MiB", "/ FSDP2",
                                          "last loss"))
    base = results["fsdp2"]
    for v in variants:
        rows = results[v]
        ms = max(r["step_ms"] for r in rows)
        sent = max(r["sent"] for r in rows)
        print("%-22s %9.1f %8.2fx %12.2f %9.2fx %10.4f" % (
            v, ms, ms / max(r["step_ms"] for r in base), sent / MIB,
            sent / max(r["sent"] for r in base), rows[0]["loss"]))
    print("rfsdp: counted by its units (FSDPUnit::bytes_sent); FSDP2: from its design (padded "
          "Shard(0) chunks, blocks gathered twice, fp32 reduce-scatter). int8/float8: 1-byte codes "
          "and an fp32 scale per 256 elements; bf16grad: gradients sent in bf16, summed in fp32.")


# ---- 6. rfsdp's optimizers on FSDP2's parameters ------------------------------------

def fsdp2opt_worker(args):
    """One sharding (args.variant: fsdp2 or rfsdp) of the GPT, each optimizer in
    turn on fresh copies, the same batches: median opt.step() time, bytes its
    Comm sent per step, shared 8-bit blocks."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = {}
    names = ["adamw8bit", "muon", "shampoo"] + (["torch_adamw"] if args.variant == "fsdp2" else [])
    for name in names:
        torch.manual_seed(0)
        model = GPT(args.dim, args.layers, args.heads, args.ctx)
        if args.variant == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
            mesh = init_device_mesh("cpu", (world,))
            for b in model.blocks:
                fsdp2_fully_shard(b, mesh=mesh)
            fsdp2_fully_shard(model, mesh=mesh)
        else:
            pol = rfsdp.policy.combine(rfsdp.policy.blockwise_8bit(256), rfsdp.policy.muon(),
                                       rfsdp.policy.shampoo(FSDP2_SHAMPOO_DIM))
            for b in model.blocks:
                rfsdp.fully_shard(b, policy=pol)
            rfsdp.fully_shard(model, policy=pol)
        if name == "muon":
            matrices = [p for b in model.blocks for p in b.parameters() if p.dim() == 2]
            ids = {id(p) for p in matrices}
            opt = rfsdp.optim.Muon([dict(params=matrices),
                                    dict(params=[p for p in model.parameters() if id(p) not in ids],
                                         use_muon=False, lr=LR)], lr=0.02)
        elif name == "adamw8bit":
            opt = rfsdp.optim.AdamW8bit(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                        weight_decay=WD)
        elif name == "shampoo":  # roots every 5 steps: the median step is a step without them
            opt = rfsdp.optim.Shampoo(model.parameters(), lr=LR, betas=BETAS, epsilon=1e-10,
                                      weight_decay=WD, max_preconditioner_dim=FSDP2_SHAMPOO_DIM,
                                      precondition_frequency=5, start_preconditioning_step=5)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                    weight_decay=WD)
        comm = getattr(opt, "comm", None)
        data = batches(load_text(), args.batch, args.ctx, torch.Generator().manual_seed(rank))
        times, sent = [], []
        for step in range(args.warmup + args.steps):
            x, y = next(data)
            loss = nn.functional.cross_entropy(model(x).view(-1, 256), y.view(-1))
            opt.zero_grad()
            loss.backward()
            if comm is not None:
                comm.reset_stats()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
            sent.append(comm.stats()["bytes_sent"] if comm is not None else 0)
        rows[name] = dict(step_ms=median_ms(times[args.warmup:]),
                          sent=statistics.median(sent[args.warmup:]),
                          shared=opt.shared_blocks() if name == "adamw8bit" else
                          opt.shared_tile_rows() if name == "shampoo" else 0,
                          loss=loss.item())
    every = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()
    leave()


def section_fsdp2opt(args):
    dim = args.fsdp2_width
    results = run_variants("fsdp2opt", ("fsdp2", "rfsdp"), dim, args)
    print("\n## 6. rfsdp's optimizers on torch FSDP2's parameters vs rfsdp.fully_shard "
          "(whole-block plan): 2 ranks, GPT width %d, %d layers, median optimizer step of %d"
          % (dim, args.layers, args.steps))
    print("%-12s %-14s %9s %12s %14s %10s" % ("optimizer", "sharded by", "step ms",
                                             "/ fully_shard", "sent B/step", "shared"))
    for name in ("adamw8bit", "muon", "shampoo", "torch_adamw"):
        for v in ("fsdp2", "rfsdp"):
            rows = [r[name] for r in results[v] if name in r]
            if not rows:
                continue
            ms = max(r["step_ms"] for r in rows)
            base = results["rfsdp"][0].get(name)
            base_ms = max(r[name]["step_ms"] for r in results["rfsdp"]) if base else None
            print("%-12s %-14s %9.2f %12s %14d %10d" % (
                name, "FSDP2" if v == "fsdp2" else "fully_shard", ms,
                "%.2fx" % (ms / base_ms) if base_ms else "-",
                max(r["sent"] for r in rows),
                (sum if name == "adamw8bit" else max)(r["shared"] for r in rows)))
    print("sent: what the optimizer's Comm sent in its step (the NaN gate, Muon's gathers and "
          "scatters, AdamW8bit's shared-block scales, Shampoo's shared tile rows); shared: "
          "AdamW8bit: 8-bit blocks a chunk boundary cuts, summed over ranks (their scales agreed "
          "in one all-reduce a step); Shampoo: rows of %d-row tiles cut (all ranks; each "
          "gathered to its owner, three all-to-alls a step)." % FSDP2_SHAMPOO_DIM)


# ---- 8. SOAP: rfsdp vs the reference SOAP -------------------------------------------

def reference_soap_class(args):
    """The reference SOAP class from a checkout of nikhilvyas/SOAP, or None."""
    for d in (args.soap, os.environ.get("RFSDP_SOAP"), os.path.join(ANCHORS_DIR, "SOAP")):
        if d and os.path.isfile(os.path.join(d, "soap.py")):
            import importlib.util
            spec = importlib.util.spec_from_file_location("reference_soap", os.path.join(d, "soap.py"))
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod.SOAP
    return None


def section_soap(args):
    print("\n## 8. SOAP: rfsdp.optim.SOAP vs the reference SOAP (nikhilvyas/SOAP), one process, "
          "square matrices of sizes %d, %d, %d and a bias, the same gradients"
          % (args.soap_dim, 2 * args.soap_dim, 4 * args.soap_dim))
    ref_cls = reference_soap_class(args)
    if ref_cls is None:
        print("reference SOAP not found: give a checkout of nikhilvyas/SOAP with --soap DIR "
              "(or $RFSDP_SOAP)")
        return
    steps, freq, lr, wd = args.soap_steps, 5, 3e-3, 0.01
    # Square matrices: a first factor G G^T of a rectangular G has a null space
    # whose basis is arbitrary (eigh's choice, which moves with the last bit of
    # its input), so two correct SOAPs differ there; square ones are full rank.
    g = torch.Generator().manual_seed(1)
    d = args.soap_dim
    init = [torch.randn(n, n, generator=g) / math.sqrt(n) for n in (d, d, d, 2 * d, 4 * d)]
    init.append(torch.zeros(4 * d))
    B = max(max(w.shape) for w in init)
    grads = [[torch.randn(w.shape, generator=g) for w in init] for _ in range(steps)]
    pr = [nn.Parameter(w.clone()) for w in init]
    pt = [nn.Parameter(w.clone()) for w in init]
    ours = rfsdp.optim.SOAP(pr, lr=lr, betas=(0.95, 0.95), weight_decay=wd,
                            precondition_frequency=freq, max_preconditioner_dim=B)
    ref = ref_cls(pt, lr=lr, betas=(0.95, 0.95), weight_decay=wd, precondition_frequency=freq,
                  max_precond_dim=B)
    t_ours, t_ref, worst_rel = {True: [], False: []}, {True: [], False: []}, 0.0
    for s in range(steps):
        refresh = s >= 1 and s % freq == 0  # s updates taken after this step
        before = [p.detach().clone() for p in pt]
        for ps, opt, times in ((pr, ours, t_ours), (pt, ref, t_ref)):
            for p, g in zip(ps, grads[s]):
                p.grad = g.clone()
            t0 = time.perf_counter()
            opt.step()
            times[refresh].append(time.perf_counter() - t0)
        for a, b, w0 in zip(pr, pt, before):
            du = (b.detach() - w0).abs().max().item()
            if du > 0:
                worst_rel = max(worst_rel, ((a.detach() - w0) - (b.detach() - w0)).abs().max().item() / du)
    final = max((a - b).abs().max().item() for a, b in zip(pr, pt))
    ref_bytes = sum(t.numel() * t.element_size() for st in ref.state.values() for v in st.values()
                    for t in (v if isinstance(v, list) else [v]) if torch.is_tensor(t))
    n = sum(w.numel() for w in init)
    print("max_preconditioner_dim %d (every matrix one tile), precondition_frequency %d, %d steps, "
          "%.2fM parameters" % (B, freq, steps, n / 1e6))
    print("%-40s %12s" % ("", "value"))
    print("%-40s %12.3g" % ("max update difference / update size", worst_rel))
    print("%-40s %12.3g" % ("max |p_rfsdp - p_reference| at the end", final))
    for refresh in (False, True):
        print("%-40s %12.2f" % ("reference step ms%s (median)" % (" with refresh" if refresh else ""),
                                median_ms(t_ref[refresh][1:] or t_ref[refresh])))
        print("%-40s %12.2f" % ("rfsdp step ms%s (median)" % (" with refresh" if refresh else ""),
                                median_ms(t_ours[refresh][1:] or t_ours[refresh])))
    print("%-40s %12.2f" % ("reference state MiB", ref_bytes / MIB))
    print("%-40s %12.2f" % ("rfsdp state MiB", ours.state_bytes() / MIB))
    print("The reference keeps m in the eigenbasis and re-projects it at a refresh; rfsdp keeps it "
          "in the original basis and rotates it each step (the same values, in exact arithmetic).")
    soap_vs_distributed_shampoo(args, init, grads, B, freq, lr, wd)


def all_tensors(x, out):
    """Every tensor in x (dicts, lists, tuples, dataclasses), appended to out."""
    import dataclasses
    if torch.is_tensor(x):
        out.append(x)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            all_tensors(getattr(x, f.name), out)
    elif isinstance(x, dict):
        for v in x.values():
            all_tensors(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            all_tensors(v, out)
    return out


def soap_vs_distributed_shampoo(args, init, grads, B, freq, lr, wd):
    # DistributedShampoo's eigenvalue-corrected preconditioner is SOAP's algorithm
    # up to: no first-step skip, and no basis before start_preconditioning_step
    # (which must be >= precondition_frequency: until then the identity, i.e.
    # Adam), bases recomputed (eigh, or QR iterations from the last basis) at
    # steps freq, 2 freq, ... before v's update, no v permutation, m bias-
    # corrected on its own and eps added to sqrt(v^) (rfsdp: to sqrt(v), with the
    # correction in the step size). So the updates are compared by direction
    # (cosine) and size, each step from rfsdp's parameters; 1-D tensors take Adam
    # on both (ignored_basis_change_dims).
    rev = import_distributed_shampoo(args)
    if rev is None:
        return
    from distributed_shampoo import (DistributedShampoo, EigenvalueCorrectedShampooPreconditionerConfig,
                                     QREigendecompositionConfig)
    steps = len(grads)
    print("\nSOAP vs DistributedShampoo's eigenvalue-corrected Shampoo (facebookresearch/optimizers "
          "@ %s), the same gradients, each step from rfsdp's parameters:" % rev)
    pr = [nn.Parameter(w.clone()) for w in init]
    ours = rfsdp.optim.SOAP(pr, lr=lr, betas=(0.95, 0.95), weight_decay=wd,
                            precondition_frequency=freq, max_preconditioner_dim=B)
    variants = {}
    for label, amortized in (("eigh", None), ("QR x1", QREigendecompositionConfig(max_iterations=1))):
        cfg = dict(ignored_basis_change_dims={1: [0]})
        if amortized is not None:
            cfg["amortized_computation_config"] = amortized
        ps = [nn.Parameter(w.clone()) for w in init]
        opt = DistributedShampoo(ps, lr=lr, betas=(0.95, 0.95), epsilon=1e-8, weight_decay=wd,
                                 max_preconditioner_dim=B, precondition_frequency=freq,
                                 start_preconditioning_step=freq, use_bias_correction=True,
                                 preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(**cfg))
        variants[label] = (ps, opt, {True: [], False: []}, [])
    t_ours = {True: [], False: []}
    for s in range(steps):
        start = [p.detach().clone() for p in pr]
        for p, g in zip(pr, grads[s]):
            p.grad = g.clone()
        t0 = time.perf_counter()
        ours.step()
        t_ours[s >= 1 and s % freq == 0].append(time.perf_counter() - t0)
        u = torch.cat([(p.detach() - w).reshape(-1) for p, w in zip(pr, start)])
        for label, (ps, opt, times, rows) in variants.items():
            with torch.no_grad():
                for p, w in zip(ps, start):
                    p.copy_(w)
            for p, g in zip(ps, grads[s]):
                p.grad = g.clone()
            t0 = time.perf_counter()
            opt.step()
            times[(s + 1) % freq == 0].append(time.perf_counter() - t0)
            d = torch.cat([(p.detach() - w).reshape(-1) for p, w in zip(ps, start)])
            if s >= 1:  # rfsdp's SOAP takes no update at its first step
                rows.append((s + 1, float(torch.dot(u, d) / (u.norm() * d.norm())),
                             float(u.norm() / d.norm())))
    print("%5s %s" % ("step", "".join("%16s %12s" % ("cos(" + k + ")", "|u|/|u_DS|") for k in variants)))
    for k in range(len(variants["eigh"][3])):
        step = variants["eigh"][3][k][0]
        if step <= 3 or step % freq in (0, 1) or k == len(variants["eigh"][3]) - 1:
            print("%5d %s" % (step, "".join("%16.4f %12.3f" % v[3][k][1:] for v in variants.values())))
    print("%-40s %12s %12s %12s" % ("", "rfsdp", "DS eigh", "DS QR x1"))
    for refresh in (False, True):
        row = [median_ms(t_ours[refresh][1:] or t_ours[refresh])]
        row += [median_ms(v[2][refresh][1:] or v[2][refresh]) for v in variants.values()]
        print("%-40s %12.2f %12.2f %12.2f" % ("step ms%s (median)" % (" with refresh" if refresh else ""),
                                              *row))
    ds_bytes = [unique_bytes(all_tensors(dict(v[1].state), [])) for v in variants.values()]
    print("%-40s %12.2f %12.2f %12.2f" % ("state MiB", ours.state_bytes() / MIB, *(b / MIB for b in ds_bytes)))
    print("cos: the cosine of rfsdp's update and DistributedShampoo's from the same parameters; "
          "DS eigh recomputes the bases by eigh at every refresh, DS QR x1 by one QR iteration "
          "from the last basis (SOAP's refresh, without the reordering). State: DS's whole "
          "optimizer state (its tensors, counted once).")


# ---- 7. Muon on FSDP2's parameters: rfsdp vs dion -----------------------------------

NS_ABC = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, what rfsdp's Muon runs


def newton_schulz(g, epsilon=1e-7, steps=5):
    """The quintic Newton-Schulz, 2-D or a batch of matrices (dion's
    newton_schulz_func signature), in float64 for float64 input and float32
    otherwise (dion hands it bf16 matrices: bf16 matmuls are slow on CPUs
    without AMX), returned in g's dtype."""
    a, b, c = NS_ABC
    eps = float(epsilon)
    dtype = g.dtype
    g = g.double() if dtype == torch.float64 else g.float()
    x = g / (g.norm(dim=(-2, -1), keepdim=True) + eps)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    for _ in range(steps):
        A = x @ x.mT
        x = a * x + (b * A + c * (A @ A)) @ x
    return (x.mT if tall else x).to(dtype)


def dion_path(args):
    for d in (args.dion, os.environ.get("RFSDP_DION"), os.path.join(ANCHORS_DIR, "dion")):
        if d and os.path.isfile(os.path.join(d, "dion", "muon.py")):
            return d
    return None


def muon_float64(init, grads, lr, wd, mu=0.95, splits=None):
    """One-device Muon in float64: momentum, Nesterov, the quintic, lr scaled by
    0.2 sqrt(max(rows, cols)) (rfsdp's match_rms_adamw, dion's rms_norm),
    p *= 1 - lr wd; splits {index: row counts}: those matrices per row block."""
    ps = [w.double().clone() for w in init]
    bufs = [torch.zeros_like(p) for p in ps]
    for step in grads:
        for i, (p, b, g) in enumerate(zip(ps, bufs, step)):
            g = g.double()
            b.mul_(mu).add_(g)
            p.mul_(1 - lr * wd)
            rows = (splits or {}).get(i, [p.shape[0]])
            for pb, ub in zip(p.split(rows), (g + mu * b).split(rows)):
                pb.add_(newton_schulz(ub), alpha=-lr * 0.2 * math.sqrt(max(pb.shape)))
    return ps


def dion_worker(args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    sys.path.insert(0, args.dion)
    import dion
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    lr, wd, steps, warm = 0.02, 0.01, 12, 3
    init = muon_matrices(args.dim, 2, 1)
    torch.manual_seed(2)  # the same gradients on every rank
    grads = [[torch.randn_like(w) for w in init] for _ in range(steps)]
    # Per-block: every (3d, d) fused QKV as its q, k and v (rfsdp's and dion's split_sizes).
    qkv = [i for i, w in enumerate(init) if w.shape[0] == 3 * w.shape[1]]
    split = [args.dim] * 3
    want = {False: muon_float64(init, grads, lr, wd),
            True: muon_float64(init, grads, lr, wd, splits={i: split for i in qkv})}
    sent = [0]  # bytes dion's collectives send (their inputs), per step
    single, gather = dist.all_to_all_single, dist.all_gather

    class _Done:
        def wait(self):
            return True

    def all_to_all(outputs, inputs, group=None, async_op=False):
        # Gloo has no list all_to_all (dion's): the same exchange as one
        # all_to_all_single over the concatenated chunks, the same bytes.
        sent[0] += sum(t.numel() * t.element_size() for t in inputs)
        out = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype)
        single(out, torch.cat([t.reshape(-1) for t in inputs]),
               output_split_sizes=[o.numel() for o in outputs],
               input_split_sizes=[t.numel() for t in inputs], group=group)
        for o, piece in zip(outputs, out.split([o.numel() for o in outputs])):
            o.copy_(piece.view(o.shape))
        return _Done() if async_op else None

    def all_gather(outputs, tensor, group=None, async_op=False):
        sent[0] += tensor.numel() * tensor.element_size()
        return gather(outputs, tensor, group=group, async_op=async_op)
    dist.all_to_all, dist.all_gather = all_to_all, all_gather
    variants = {
        "rfsdp": lambda ps: rfsdp.optim.Muon(ps, lr=lr, weight_decay=wd, momentum=0.95,
                                             nesterov=True, adjust_lr="match_rms_adamw",
                                             ns_dtype=torch.float32),
        "dion (quintic fp32)": lambda ps: dion.Muon(
            ps, distributed_mesh=mesh, lr=lr, mu=0.95, weight_decay=wd, nesterov=True,
            adjust_lr="rms_norm", use_polar_express=False, newton_schulz_func=newton_schulz),
        "dion (defaults)": lambda ps: dion.Muon(ps, distributed_mesh=mesh, lr=lr, mu=0.95,
                                                weight_decay=wd, nesterov=True,
                                                adjust_lr="rms_norm"),
        "rfsdp per-block": lambda ps: rfsdp.optim.Muon(
            by_block(ps, tuple(split)), lr=lr, weight_decay=wd, momentum=0.95, nesterov=True,
            adjust_lr="match_rms_adamw", ns_dtype=torch.float32),
        "dion per-block (quintic fp32)": lambda ps: dion.Muon(
            by_block(ps, tuple(split)), distributed_mesh=mesh, lr=lr, mu=0.95, weight_decay=wd,
            nesterov=True, adjust_lr="rms_norm", use_polar_express=False,
            newton_schulz_func=newton_schulz),
    }

    def by_block(ps, sizes):  # the QKV matrices in a group with split_sizes, the rest in one
        return [dict(params=[ps[i] for i in qkv], split_sizes=sizes),
                dict(params=[p for i, p in enumerate(ps) if i not in qkv])]
    out = {}
    for name, make in variants.items():
        model = _Matrices(init)
        fsdp2_fully_shard(model, mesh=mesh)
        ps = list(model.parameters())
        opt = make(ps)
        times, bytes_per = [], []
        for s in range(steps):
            for p, g in zip(ps, grads[s]):
                p.grad = distribute_tensor(g, mesh, [Shard(0)])
            if name.startswith("rfsdp"):
                opt.comm.reset_stats()
            sent[0] = 0
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
            bytes_per.append(opt.comm.stats()["bytes_sent"] if name.startswith("rfsdp") else sent[0])
        worst = max((p.full_tensor().double() - w).abs().max().item()
                    for p, w in zip(ps, want["per-block" in name]))
        out[name] = dict(step_ms=median_ms(times[warm:]), sent=statistics.median(bytes_per[warm:]),
                         worst=worst, times_ms=[round(t * 1e3, 1) for t in times])
    rows = [None] * world
    dist.all_gather_object(rows, out)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()
    leave()


def section_dion(args):
    path = dion_path(args)
    print("\n## 7. Muon on torch FSDP2's parameters: rfsdp.optim.Muon vs dion's Muon, 2 ranks, "
          "%d matrices of a width-%d GPT, the same gradients" % (8, args.muon_dim))
    if path is None:
        print("dion not found: give a checkout of microsoft/dion with --dion DIR (or $RFSDP_DION)")
        return
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "dion.json")
        torchrun(2, ["--worker", "dion", "--dim", str(args.muon_dim), "--out", out,
                     "--dion", path])
        with open(out) as f:
            rows = json.load(f)
    print("%-30s %9s %9s %14s %18s" % ("", "step ms", "/ rfsdp", "sent MiB/step",
                                       "max |p - f64 Muon|"))
    base = max(r["rfsdp"]["step_ms"] for r in rows)
    for name in rows[0]:
        ms = max(r[name]["step_ms"] for r in rows)
        print("%-30s %9.1f %8.2fx %14.2f %18.3g" % (
            name, ms, ms / base, max(r[name]["sent"] for r in rows) / MIB, rows[0][name]["worst"]))
    print("f64 Muon: momentum 0.95 with Nesterov, the quintic %s, lr x 0.2 sqrt(max(rows, cols)), "
          "decoupled weight decay (per-block rows: against the f64 Muon that splits every fused "
          "QKV into its q, k and v, each scaled by its own rows). dion (quintic fp32): its Muon with that Newton-Schulz passed "
          "in (computing in fp32); it sends its updates in bf16 (its design). dion (defaults): Polar Express "
          "coefficients in bf16 (bf16 matmuls: slow on this CPU), a different algorithm. Sent: rfsdp's Comm; dion's collectives' "
          "inputs, counted in the worker (Gloo has no list all_to_all: the worker runs dion's as "
          "one all_to_all_single of the same bytes)." % (NS_ABC,))


# ---- 2. Muon: rfsdp vs torch.optim.Muon ----------------------------------------------

def muon_matrices(dim, layers, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3 * dim, dim), (dim, dim), (4 * dim, dim), (dim, 4 * dim)] * layers
    return [torch.randn(s, generator=g) / math.sqrt(s[1]) for s in shapes]


def section_muon(args):
    # The same algorithm: torch.optim.Muon runs Newton-Schulz in bfloat16, so
    # rfsdp's ns_dtype=torch.bfloat16; adjust_lr "original" (torch's default None);
    # momentum 0.95 with Nesterov; 5 steps of the quintic (3.4445, -4.7750, 2.0315);
    # decoupled weight decay p *= 1 - lr wd on both.
    lr, wd, steps = 0.02, 0.01, 20
    init = muon_matrices(args.muon_dim, 2, 1)
    grads = [[torch.randn_like(w) for w in init] for _ in range(steps)]
    pt = [nn.Parameter(w.clone()) for w in init]
    pr = [nn.Parameter(w.clone()) for w in init]
    ref = torch.optim.Muon(pt, lr=lr, weight_decay=wd, momentum=0.95, nesterov=True,
                           ns_steps=5, adjust_lr_fn="original")
    ours = rfsdp.optim.Muon(pr, lr=lr, weight_decay=wd, momentum=0.95, nesterov=True, ns_steps=5,
                            adjust_lr="original", ns_dtype=torch.bfloat16)
    t_ref, t_ours, worst, worst_update = [], [], 0.0, 0.0
    for s in range(steps):
        before = [p.detach().clone() for p in pt]
        for ps, opt, times in ((pt, ref, t_ref), (pr, ours, t_ours)):
            for p, g in zip(ps, grads[s]):
                p.grad = g.clone()
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        for a, b, w0 in zip(pt, pr, before):
            worst = max(worst, (a - b).abs().max().item())
            worst_update = max(worst_update, ((a - w0) - (b - w0)).abs().max().item())
    n = sum(w.numel() for w in init)
    print("\n## 2. Muon: rfsdp.optim.Muon vs torch.optim.Muon, one process, %d matrices of a "
          "width-%d GPT (%.2fM parameters), %d steps" % (len(init), args.muon_dim, n / 1e6, steps))
    print("knobs that make them one algorithm: ns_dtype=torch.bfloat16 (torch's Newton-Schulz is "
          "bf16), adjust_lr='original' (torch: adjust_lr_fn None/'original'), momentum 0.95, "
          "nesterov, ns_steps 5, lr %.3g, weight_decay %.3g" % (lr, wd))
    print("%-28s %12s" % ("", "value"))
    print("%-28s %12.3g" % ("max |p_torch - p_rfsdp|", worst))
    print("%-28s %12.3g" % ("max |update difference|", worst_update))
    print("%-28s %12.2f" % ("torch step ms (median)", median_ms(t_ref[2:])))
    print("%-28s %12.2f" % ("rfsdp step ms (median)", median_ms(t_ours[2:])))
    print("%-28s %11.2fx" % ("rfsdp / torch", median_ms(t_ours[2:]) / median_ms(t_ref[2:])))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "muon.json")
        torchrun(2, ["--worker", "muon", "--dim", str(args.muon_dim), "--out", out])
        with open(out) as f:
            rows = json.load(f)
    r = rows[0]
    print("rfsdp Muon sharded over 2 ranks (fully_shard, ragged roots): step %.2f ms (slowest rank, "
          "median; %.2fx the one-process rfsdp step), %.2f MiB gathered per rank per step, "
          "Newton-Schulz flop imbalance %.3f, max |p - one-process torch.optim.Muon| %.3g"
          % (max(x["step_ms"] for x in rows), max(x["step_ms"] for x in rows) / median_ms(t_ours[2:]),
             max(x["moved"] for x in rows) * 4 / MIB, r["imbalance"], r["worst"]))


class _Matrices(nn.Module):
    def __init__(self, mats):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(m.clone()) for m in mats)


def muon_worker(args):
    """The section's matrices as one sharded unit on 2 ranks, stepped with the
    same gradients as the one-process run; compared with torch.optim.Muon there."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    lr, wd, steps = 0.02, 0.01, 20
    init = muon_matrices(args.dim, 2, 1)
    torch.manual_seed(2)  # the same gradients on every rank
    grads = [[torch.randn_like(w) for w in init] for _ in range(steps)]
    model = _Matrices(init)
    rfsdp.fully_shard(model, policy=rfsdp.policy.muon())
    opt = rfsdp.optim.Muon(list(model.parameters()), lr=lr, weight_decay=wd,
                           ns_dtype=torch.bfloat16)
    pt = [nn.Parameter(w.clone()) for w in init]
    ref = torch.optim.Muon(pt, lr=lr, weight_decay=wd, adjust_lr_fn="original")
    times, worst = [], 0.0
    for s in range(steps):
        for p, g in zip(model.parameters(), grads[s]):
            info = rfsdp.shard_info(p)
            p.grad = g.reshape(info.full_rows, -1)[info.row_begin:info.row_end].reshape(p.shape).clone()
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        for p, g in zip(pt, grads[s]):
            p.grad = g.clone()
        ref.step()
    full = rfsdp.full_parameters(model)
    for i, p in enumerate(pt):
        worst = max(worst, (full["w.%d" % i] - p.detach()).abs().max().item())
    out = dict(step_ms=median_ms(times[2:]), moved=opt._impl.gather_send_elems(),
               imbalance=opt._impl.flop_imbalance(), worst=worst)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, out)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


# ---- 3. 8-bit AdamW: rfsdp vs bitsandbytes vs torchao ---------------------------------

def anchors_on_path():
    if os.path.isdir(ANCHORS_DIR) and ANCHORS_DIR not in sys.path:
        sys.path.append(ANCHORS_DIR)


def eight_bit_optimizers(lr=LR, min_8bit_size=4096):
    """name -> (factory or None, note). Block size 256 and 8-bit moments from
    min_8bit_size elements everywhere (4096: bitsandbytes' and torchao's defaults,
    rfsdp's settings)."""
    anchors_on_path()
    opts = {
        "torch AdamW (fp32)": (lambda ps: torch.optim.AdamW(ps, lr=lr, betas=BETAS, eps=EPS,
                                                            weight_decay=WD), ""),
        "rfsdp AdamW (fp32)": (lambda ps: rfsdp.optim.AdamW(ps, lr=lr, betas=BETAS, eps=EPS,
                                                            weight_decay=WD), ""),
        "rfsdp AdamW8bit": (lambda ps: rfsdp.optim.AdamW8bit(ps, lr=lr, betas=BETAS, eps=EPS,
                                                             weight_decay=WD, block=256,
                                                             min_8bit_size=min_8bit_size), ""),
        "rfsdp AdamW8bit fp8": (lambda ps: rfsdp.optim.AdamW8bit(
            ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, block=256,
            min_8bit_size=min_8bit_size, state_format="float8_e4m3fn"), "float8_e4m3fn codes"),
    }
    try:
        import bitsandbytes as bnb
        opts["bitsandbytes AdamW8bit"] = (
            lambda ps: bnb.optim.AdamW8bit(ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD,
                                           min_8bit_size=min_8bit_size),
            "bitsandbytes " + bnb.__version__)
    except Exception as e:  # noqa: BLE001  (any import failure: say it in the table)
        opts["bitsandbytes AdamW8bit"] = (None, "not available: %s" % str(e).split("\n")[0][:60])
    try:
        import torchao
        from torchao.optim import AdamW8bit as AoAdamW8bit
        opts["torchao AdamW8bit"] = (
            lambda ps: AoAdamW8bit(ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, block_size=256),
            "torchao " + torchao.__version__)
    except Exception as e:  # noqa: BLE001
        opts["torchao AdamW8bit"] = (None, "not available: %s" % str(e).split("\n")[0][:60])
    try:
        import torchao
        from torchao.optim import AdamWFp8 as AoAdamWFp8
        opts["torchao AdamWFp8"] = (
            lambda ps: AoAdamWFp8(ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, block_size=256),
            "torchao " + torchao.__version__)
    except Exception as e:  # noqa: BLE001
        opts["torchao AdamWFp8"] = (None, "not available: %s" % str(e).split("\n")[0][:60])
    return opts


def largest_move(model, before):
    """The largest |change| of any parameter element since `before`."""
    return max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))


def section_8bit(args):
    torch.set_num_threads(1)
    text = load_text()
    print("\n## 3. 8-bit AdamW, one process (1 thread), GPT width %d, %d layers, batch %d x %d, "
          "%d steps, same seed and data (block 256; 8-bit from 4096 elements)"
          % (args.dim8, args.layers, args.batch, args.ctx, args.steps8))
    print("%-24s %12s %14s %12s %10s %12s  %s" % ("optimizer", "state B/param", "step ms (opt)",
                                                  "/ rfsdp 8bit", "loss", "max move/lr", "note"))
    rows = []
    for name, (make, note) in eight_bit_optimizers().items():
        if make is None:
            rows.append((name, None, None, None, None, note))
            continue
        torch.manual_seed(0)
        model = GPT(args.dim8, args.layers, args.heads, args.ctx)
        n = sum(p.numel() for p in model.parameters())
        opt = make(list(model.parameters()))
        data = batches(text, args.batch, args.ctx, torch.Generator().manual_seed(0))
        times, loss, move = [], None, 0.0
        for _ in range(args.steps8):
            x, y = next(data)
            loss = nn.functional.cross_entropy(model(x).view(-1, 256), y.view(-1))
            opt.zero_grad()
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
            move = max(move, largest_move(model, before))
        rows.append((name, state_bytes(opt) / n, median_ms(times[3:]), loss.item(), move / LR, note))
    base = next(r[2] for r in rows if r[0] == "rfsdp AdamW8bit")
    for name, bpp, ms, loss, move, note in rows:
        if bpp is None:
            print("%-24s %12s %14s %12s %10s %12s  %s" % (name, "-", "-", "-", "-", "-", note))
        else:
            print("%-24s %12.2f %14.2f %11.2fx %10.5f %12.3f  %s" % (name, bpp, ms, ms / base, loss,
                                                                   move, note))
    print("step ms: the optimizer step alone, median after 3 warm-up steps (torchao compiles its "
          "step on the first call). max move/lr: the largest change of any element in any step, "
          "over lr (exact AdamW's is about 1: its update is bounded by lr)")
    section_8bit_sparse(args)


def section_8bit_sparse(args):
    """Rare tokens: a tiny random Llama (transformers) whose embedding rows get a
    gradient now and then, inside blocks that busy rows scale."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print("\n(3b: transformers not available: %s)" % e)
        return
    lr = 1e-3
    print("\n### 3b. Sparse rows: a tiny random Llama (vocab 128, hidden 64, 2 layers), Zipf(1.2) "
          "tokens, batch 4 x 32, lr %g, 8-bit from 1024 elements, %d steps" % (lr, args.steps8))
    print("%-24s %12s %12s  %s" % ("optimizer", "max move/lr", "final loss", "note"))
    for name, (make, note) in eight_bit_optimizers(lr=lr, min_8bit_size=1024).items():
        if make is None:
            print("%-24s %12s %12s  %s" % (name, "-", "-", note))
            continue
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2))
        opt = make(list(model.parameters()))
        g = torch.Generator().manual_seed(1)
        zipf = 1.0 / torch.arange(1, 129).float() ** 1.2
        move, loss = 0.0, None
        for _ in range(args.steps8):
            ids = torch.multinomial(zipf, 4 * 32, replacement=True, generator=g).view(4, 32)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            move = max(move, largest_move(model, before))
        print("%-24s %12.3f %12.5f  %s" % (name, move / lr, loss.item(), note))


# ---- 5. 8-bit kernels: rfsdp vs bitsandbytes vs torchao --------------------------------

def quantizers():
    """name -> (quantise(x) -> state, dequantise(state, out) -> x) or None, note.
    out=None: a new output each call (all three); a tensor: written into it, where
    the API takes one on the CPU (rfsdp only: bitsandbytes' CPU backend has no
    dequantize_blockwise.out, torchao takes none)."""
    anchors_on_path()
    out = {"rfsdp": ((lambda x: rfsdp.quant.quantize_blockwise(x, block=256)),
                     (lambda st, o: rfsdp.quant.dequantize_blockwise(*st, block=256, out=o))),
           "rfsdp fp8": ((lambda x: rfsdp.quant.quantize_blockwise(x, block=256, code="float8_e4m3fn")),
                         (lambda st, o: rfsdp.quant.dequantize_blockwise(*st, block=256, out=o,
                                                                         code="float8_e4m3fn")))}
    notes = {"rfsdp": "", "rfsdp fp8": "float8_e4m3fn codes"}
    try:
        import bitsandbytes.functional as bnbf
        import bitsandbytes as bnb
        out["bitsandbytes"] = ((lambda x: bnbf.quantize_blockwise(x, blocksize=256)),
                               (lambda st, o: None if o is not None else bnbf.dequantize_blockwise(*st)))
        notes["bitsandbytes"] = "bitsandbytes " + bnb.__version__
    except Exception as e:  # noqa: BLE001
        out["bitsandbytes"], notes["bitsandbytes"] = None, "not available: %s" % str(e)[:60]
    try:
        import torchao
        from torchao.optim.subclass_8bit import OptimState8bit

        def ao_quantize(x):
            st = OptimState8bit.zeros(x.shape, signed=True, block_size=256)
            st.copy_(x)
            return st
        out["torchao"] = (ao_quantize, lambda st, o: None if o is not None else st.dequantize())
        notes["torchao"] = "torchao " + torchao.__version__
    except Exception as e:  # noqa: BLE001
        out["torchao"], notes["torchao"] = None, "not available: %s" % str(e)[:60]
    return out, notes


def timed(fn, reps):
    fn()  # warm-up (torchao compiles nothing here, but first calls allocate)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def section_kernels8(args):
    torch.set_num_threads(1)
    sizes = [int(m) << 20 for m in args.kernel_mib.split(",")]
    print("\n## 5. 8-bit kernels, one thread, the same tensors: quantise / dequantise (block 256, "
          "dynamic signed map) and one AdamW8bit step on one tensor; GB/s counts the bytes each "
          "must move (quantise and dequantise 4 + 1 per element; AdamW8bit 16, fp32 AdamW 28 per "
          "parameter); median of %d; dequantise into a new output each call, and into a reused "
          "one where the API takes it on the CPU ('into out': rfsdp only)" % args.kernel_reps)
    qs, notes = quantizers()
    print("%-12s %9s | %10s %10s | %10s %10s %10s  %s" % (
        "impl", "elements", "quant GB/s", "/ rfsdp", "deq GB/s", "/ rfsdp", "into out", "note"))
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        rates = {}
        for name, q in qs.items():
            if q is None:
                print("%-12s %8dM | %10s %10s | %10s %10s %10s  %s" % (
                    name, n >> 20, "-", "-", "-", "-", "-", notes[name]))
                continue
            quant, deq = q
            st = quant(x)
            err = (deq(st, None).view(-1) - x).abs().max().item() / x.abs().max().item()
            tq = timed(lambda: quant(x), args.kernel_reps)
            td = timed(lambda: deq(st, None), args.kernel_reps)
            buf = torch.empty_like(x)
            into = "-"
            if deq(st, buf) is not None:
                into = "%.2f" % (5 * n / timed(lambda: deq(st, buf), args.kernel_reps) / 1e9)
            rates[name] = (5 * n / tq / 1e9, 5 * n / td / 1e9)
            base = rates["rfsdp"]
            print("%-12s %8dM | %10.2f %9.2fx | %10.2f %9.2fx %10s  %s, max error %.4f of absmax"
                  % (name, n >> 20, rates[name][0], rates[name][0] / base[0], rates[name][1],
                     rates[name][1] / base[1], into, notes[name] or "rfsdp", err))
    print("\n%-26s %9s | %10s %12s %10s %13s  %s" % ("optimizer step", "params", "ms/step",
                                                      "GB/s", "/ rfsdp 8bit", "state B/param", "note"))
    opts = eight_bit_optimizers()
    opts["torch AdamW (fp32, fused)"] = (lambda ps: torch.optim.AdamW(
        ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True), "")
    for n in sizes:
        rows = []
        for name, (make, note) in opts.items():
            if make is None:
                rows.append((name, None, None, note))
                continue
            p = nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.02)
            p.grad = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-3
            opt = make([p])
            ms = timed(opt.step, args.kernel_reps) * 1e3
            rows.append((name, ms, state_bytes(opt) / n, note))
        base = next(r[1] for r in rows if r[0] == "rfsdp AdamW8bit")
        for name, ms, bpp, note in rows:
            if ms is None:
                print("%-26s %8dM | %10s %12s %10s %13s  %s" % (name, n >> 20, "-", "-", "-", "-", note))
                continue
            moved = (28 if "fp32" in name else 16) * n
            print("%-26s %8dM | %10.2f %12.2f %9.2fx %13.3f  %s"
                  % (name, n >> 20, ms, moved / ms / 1e6, base / ms, bpp, note))
    print("/ rfsdp: the other's rate over rfsdp's (quant, deq), rfsdp 8-bit's step time over the "
          "other's (step): below 1 is slower than rfsdp.")


# ---- 4. Shampoo: rfsdp vs DistributedShampoo --------------------------------------------

def distributed_shampoo_path(args):
    """A checkout of facebookresearch/optimizers (DistributedShampoo is not on PyPI):
    --distributed-shampoo, else $RFSDP_DISTRIBUTED_SHAMPOO, else ANCHORS_DIR/optimizers."""
    for d in (args.distributed_shampoo, os.environ.get("RFSDP_DISTRIBUTED_SHAMPOO"),
              os.path.join(ANCHORS_DIR, "optimizers")):
        if d and os.path.isfile(os.path.join(d, "distributed_shampoo", "__init__.py")):
            return d
    return None


def import_distributed_shampoo(args):
    """Puts DistributedShampoo's checkout on sys.path; returns its revision
    ("not a git checkout" for an export), or None (said) where there is none."""
    src = distributed_shampoo_path(args)
    if src is None:
        print("DistributedShampoo: not available (not on PyPI; pass --distributed-shampoo DIR, a "
              "checkout of facebookresearch/optimizers)")
        return None
    sys.path.insert(0, src)
    rev = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    return rev or "not a git checkout"


def unique_bytes(tensors):
    seen = {}
    for t in tensors:
        seen[(t.data_ptr(), t.dtype)] = t.numel() * t.element_size()
    return sum(seen.values())


def dshampoo_factor_tensors(opt):
    """L, R and their inverse roots in DistributedShampoo's state (dataclasses per block)."""
    import dataclasses
    out = []

    def walk(x):
        if dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                if f.name in ("factor_matrices", "inv_factor_matrices"):
                    out.extend(t for t in getattr(x, f.name) if torch.is_tensor(t))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
    for st in opt.state.values():
        walk(st)
    return out


def section_shampoo(args):
    # One algorithm (the issue's): DistributedShampoo's defaults (root-inverse by
    # eigh with epsilon I, fp64 retry) with AdamPreconditionerConfig grafting, the
    # same betas, epsilons, tiles, frequency, start, bias correction and decoupled
    # weight decay. DistributedShampoo would precondition a 1-D tensor with one
    # factor; rfsdp gives 1-D tensors Adam (the grafted direction), so there the
    # anchor's 1-D tensors take torch.optim.AdamW with the grafting settings.
    torch.set_num_threads(1)
    print("\n## 4. Shampoo: rfsdp.optim.Shampoo vs DistributedShampoo, one process (1 thread), "
          "GPT width %d, %d layers, tiles of at most %d, %d steps, frequency = start = %d, "
          "the same gradient to both each step"
          % (args.shampoo_dim, args.layers, args.shampoo_tile, args.shampoo_steps,
             args.shampoo_freq))
    rev = import_distributed_shampoo(args)
    if rev is None:
        return
    from distributed_shampoo import (AdamPreconditionerConfig, DistributedShampoo,
                                     RootInvShampooPreconditionerConfig)
    lr, wd, betas, eps, geps, b2g = 1e-3, 0.1, (0.9, 0.999), args.shampoo_epsilon, 1e-8, 0.999
    text = load_text()
    torch.manual_seed(0)
    model = GPT(args.shampoo_dim, args.layers, args.heads, args.ctx)
    names = [n for n, _ in model.named_parameters()]
    init = [p.detach().clone() for p in model.parameters()]
    mine = [nn.Parameter(w.clone()) for w in init]
    theirs = [nn.Parameter(w.clone()) for w in init]
    ours = rfsdp.optim.Shampoo(mine, lr=lr, betas=betas, epsilon=eps, grafting_beta2=b2g,
                               grafting_epsilon=geps, weight_decay=wd,
                               max_preconditioner_dim=args.shampoo_tile,
                               precondition_frequency=args.shampoo_freq,
                               start_preconditioning_step=args.shampoo_freq)

    def anchor(ps, dtype):
        cfg = RootInvShampooPreconditionerConfig(factor_matrix_dtype=dtype,
                                                 inv_factor_matrix_dtype=dtype)
        return (DistributedShampoo([p for p in ps if p.dim() >= 2], lr=lr, betas=betas,
                                   epsilon=eps, weight_decay=wd,
                                   max_preconditioner_dim=args.shampoo_tile,
                                   precondition_frequency=args.shampoo_freq,
                                   start_preconditioning_step=args.shampoo_freq,
                                   use_bias_correction=True, preconditioner_config=cfg,
                                   grafting_config=AdamPreconditionerConfig(beta2=b2g,
                                                                            epsilon=geps)),
                torch.optim.AdamW([p for p in ps if p.dim() < 2], lr=lr, betas=(betas[0], b2g),
                                  eps=geps, weight_decay=wd))
    ref, ref_1d = anchor(theirs, torch.float32)
    # The anchor in float64 (parameters, factors, roots): the truth both are held to.
    exact = [nn.Parameter(w.double()) for w in init]
    ref64, ref64_1d = anchor(exact, torch.float64)
    data = batches(text, args.batch, args.ctx, torch.Generator().manual_seed(0))
    t_ours, t_ref, rows = [], [], []
    for step in range(1, args.shampoo_steps + 1):
        # The gradient at the anchor's parameters, given to both.
        with torch.no_grad():
            for p, w in zip(model.parameters(), theirs):
                p.copy_(w)
        x, y = next(data)
        model.zero_grad()
        nn.functional.cross_entropy(model(x).view(-1, 256), y.view(-1)).backward()
        before = [w.detach().clone() for w in theirs]
        for ps in (mine, theirs, exact):
            for p, q in zip(ps, model.parameters()):
                p.grad = q.grad.to(p.dtype)
        t0 = time.perf_counter()
        ours.step()
        t_ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref.step()
        ref_1d.step()
        t_ref.append(time.perf_counter() - t0)
        ref64.step()
        ref64_1d.step()
        worst, worst_name, size, err_ours, err_ref = 0.0, "", 0.0, 0.0, 0.0
        for n, a, b, c, w0 in zip(names, mine, theirs, exact, before):
            d = (a - b).abs().max().item()
            size = max(size, (c - w0.double()).abs().max().item())
            err_ours = max(err_ours, (a.double() - c).abs().max().item())
            err_ref = max(err_ref, (b.double() - c).abs().max().item())
            if d > worst:
                worst, worst_name = d, n
        rows.append((step, worst, worst_name, size, err_ours, err_ref))
        # Parameters kept equal, so each step compares one update from one state.
        with torch.no_grad():
            for a, b, c in zip(mine, theirs, exact):
                a.copy_(b)
                c.copy_(b)
    print("DistributedShampoo from facebookresearch/optimizers @ %s; epsilon %g, grafting epsilon "
          "%g, betas %s, lr %g, weight decay %g (decoupled)" % (rev, eps, geps, betas, lr, wd))
    print("%5s %13s %13s %13s %13s  %s" % ("step", "|rfsdp-anchor|", "|update|", "|rfsdp-f64|",
                                           "|anchor-f64|", "where |rfsdp-anchor| is largest"))
    for step, worst, where, size, e_ours, e_ref in rows:
        if step <= 2 or step % args.shampoo_freq in (0, 1) or step == rows[-1][0]:
            print("%5d %13.3g %13.3g %13.3g %13.3g  %s" % (step, worst, size, e_ours, e_ref, where))
    root = [i for i in range(len(t_ours)) if (i + 1) % args.shampoo_freq == 0]
    rest = [i for i in range(2, len(t_ours)) if i not in root]
    fo, fr = ours._impl.factor_bytes(), unique_bytes(dshampoo_factor_tensors(ref))
    print("%-36s %12s %12s %10s" % ("", "rfsdp", "anchor", "rfsdp/anchor"))
    for label, a, b in (
            ("step ms, no roots (median)", median_ms([t_ours[i] for i in rest]),
             median_ms([t_ref[i] for i in rest])),
            ("step ms, with roots (median)", median_ms([t_ours[i] for i in root]),
             median_ms([t_ref[i] for i in root])),
            ("factor MiB (L, R, inverse roots)", fo / MIB, fr / MIB)):
        print("%-36s %12.2f %12.2f %9.2fx" % (label, a, b, a / b))
    print("rfsdp: %d inverse roots retried in fp64 (the anchor retries only when eigh raises); "
          "both store L, R and the roots as packed upper triangles (n(n+1)/2 of n^2 elements)"
          % ours._impl.fp64_retries())
    print("each step starts every optimizer from the same parameters (copied over) and the same "
          "gradient; columns are the largest element difference of two updates (f64: the anchor "
          "with float64 parameters, factors and roots).")


def install_anchors():
    print("installing %s into %s (no dependencies: the project's torch is used)"
          % (", ".join(ANCHOR_PINS), ANCHORS_DIR))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "--target", ANCHORS_DIR] + ANCHOR_PINS, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="256,512", help="GPT widths of section 1")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--muon-dim", type=int, default=256)
    ap.add_argument("--fsdp2-width", type=int, default=200,
                    help="GPT width of section 6 (200: FSDP2's half-row chunks cut 8-bit blocks)")
    ap.add_argument("--dim8", type=int, default=256, help="GPT width of section 3")
    ap.add_argument("--steps8", type=int, default=30)
    ap.add_argument("--shampoo-dim", type=int, default=128, help="GPT width of section 4")
    ap.add_argument("--shampoo-tile", type=int, default=64, help="max_preconditioner_dim")
    ap.add_argument("--shampoo-freq", type=int, default=5)
    ap.add_argument("--shampoo-steps", type=int, default=20)
    ap.add_argument("--shampoo-epsilon", type=float, default=1e-12)
    ap.add_argument("--distributed-shampoo", help="a checkout of facebookresearch/optimizers")
    ap.add_argument("--kernel-mib", default="1,16", help="tensor sizes of section 5, Mi elements")
    ap.add_argument("--kernel-reps", type=int, default=7)
    ap.add_argument("--only", default="fsdp,muon,8bit,shampoo,kernels8,fsdp2opt,dion,soap,comm")
    ap.add_argument("--install-anchors", action="store_true")
    ap.add_argument("--worker", choices=["fsdp", "muon", "fsdp2opt", "dion"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--dion", help="a checkout of microsoft/dion (section 7)")
    ap.add_argument("--soap", help="a checkout of nikhilvyas/SOAP (section 8)")
    ap.add_argument("--soap-dim", type=int, default=64,
                    help="section 8: its square matrices are n, n, n, 2n and 4n")
    ap.add_argument("--soap-steps", type=int, default=21)
    ap.add_argument("--variant", choices=["fsdp2", "fsdp2-bf16", "ddp"] + list(COMM_VARIANTS),
                    help=argparse.SUPPRESS)
    ap.add_argument("--dim", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "fsdp":
        return fsdp_worker(args)
    if args.worker == "muon":
        return muon_worker(args)
    if args.worker == "fsdp2opt":
        return fsdp2opt_worker(args)
    if args.worker == "dion":
        return dion_worker(args)
    if args.install_anchors:
        install_anchors()
    args.widths = [int(w) for w in args.widths.split(",")]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print("torch %s, %s, %d cores" % (torch.__version__, cpu, os.cpu_count()))
    only = set(args.only.split(","))
    if "fsdp" in only:
        section_fsdp(args)
    if "muon" in only:
        section_muon(args)
    if "8bit" in only:
        section_8bit(args)
    if "shampoo" in only:
        section_shampoo(args)
    if "kernels8" in only:
        section_kernels8(args)
    if "fsdp2opt" in only:
        section_fsdp2opt(args)
    if "dion" in only:
        section_dion(args)
    if "soap" in only:
        section_soap(args)
    if "comm" in only:
        section_comm(args)


if __name__ == "__main__":
    main()
