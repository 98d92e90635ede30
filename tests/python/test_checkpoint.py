"""rfsdp.checkpoint: exact resume at the same world size (bit for bit, parameters
and optimizer states) and resume at another world size (fp32 tolerance; AdamW8bit's
8-bit codes may flip where the ranks sum gradients in another order) for
AdamW, AdamW8bit, Muon and Shampoo, each in fresh processes (Gloo); the model
part read by torch's own tools into a plain module, and a plain model's and a
torch FSDP2 model's DCP checkpoints read into an rfsdp model; atomic saves and
keep_last; bad checkpoints refused with the model and optimizer untouched."""
import json
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import rfsdp
import rfsdp.checkpoint as ckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hsdp import close_but_for_code_flips  # noqa: E402
from ranks import run_ranks  # noqa: E402

STEPS_BEFORE, STEPS_AFTER, BATCH = 4, 4, 12


class Net(nn.Module):
    """A matrix larger than the tiles both ways, a bias, and an [E, H, I] stack
    (Muon's ragged policy cuts it inside an expert: several chunks per rank)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 20)
        self.experts = nn.Parameter(torch.randn(3, 5, 20) / 5)
        self.out = nn.Linear(5, 2, bias=False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(torch.einsum("bd,ehd->bh", h, self.experts) / 3)


def policy(name):
    return {"adamw": None, "adamw8bit": rfsdp.policy.blockwise_8bit(16),
            "muon": rfsdp.policy.muon(), "shampoo": rfsdp.policy.shampoo(8)}[name]


def optimizer(name, model):
    ps = list(model.parameters())
    if name == "adamw":
        return rfsdp.optim.AdamW(ps, lr=1e-2, weight_decay=0.05)
    if name == "adamw8bit":
        return rfsdp.optim.AdamW8bit(ps, lr=1e-2, block=16, min_8bit_size=32)
    if name == "muon":
        mats = [p for p in ps if p.dim() >= 2]
        rest = [p for p in ps if p.dim() < 2]
        return rfsdp.optim.Muon([dict(params=mats), dict(params=rest, use_muon=False, lr=1e-2)],
                                lr=0.02, weight_decay=0.01)
    return rfsdp.optim.Shampoo(ps, lr=1e-2, epsilon=1e-6, max_preconditioner_dim=8,
                               precondition_frequency=2, start_preconditioning_step=2)


def batch(seed, step):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 2, generator=g)


def build(name, seed, pol=None):
    torch.manual_seed(seed)
    model = Net()
    rfsdp.fully_shard(model, policy=pol or policy(name))
    opt = optimizer(name, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, seed, steps, rank, world):
    per = BATCH // world
    for s in steps:
        x, y = batch(seed, s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]),
                               y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        sched.step()


def snapshot(model, opt):
    """This rank's parameters and optimizer states, and the full parameters."""
    return {"local": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in opt.state[p].items()}
                      for k, p in enumerate(q for g in opt.param_groups for q in g["params"])
                      if opt.state.get(p)},
            "lr": [g["lr"] for g in opt.param_groups],
            "full": rfsdp.full_parameters(model)}


def worker(rank, world, name, seed, d, phase):
    # at another world size, AdamW8bit also takes another plan (the Shampoo granule too)
    other = world != SAVE_WORLD[name] and name == "adamw8bit"
    model, opt, sched = build(name, seed, rfsdp.policy.combine(policy(name), rfsdp.policy.shampoo(8))
                              if other else None)
    if phase == "train":
        train(model, opt, sched, seed, range(STEPS_BEFORE), rank, world)
        ckpt.save(os.path.join(d, "ck"), model, opt,
                  extra={"step": STEPS_BEFORE, "sched": sched.state_dict()})
        train(model, opt, sched, seed, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank, world)
    else:
        extra = ckpt.load(os.path.join(d, "ck"), model, opt)
        sched.load_state_dict(extra["sched"])
        train(model, opt, sched, seed, range(extra["step"], STEPS_BEFORE + STEPS_AFTER), rank, world)
    return snapshot(model, opt)


# saved at one world size, resumed exactly there and at another: 2 -> 1, 4 -> 2 (AdamW8bit,
# also under another granule policy), 2 -> 3, 1 -> 4
SAVE_WORLD = {"adamw": 2, "adamw8bit": 4, "muon": 2, "shampoo": 1}
OTHER_WORLD = {"adamw": 1, "adamw8bit": 2, "muon": 3, "shampoo": 4}


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon", "shampoo"])
def test_resume_is_exact_and_reshards(name):
    seed = int(torch.randint(0, 2 ** 20, ()).item())
    with tempfile.TemporaryDirectory() as d:
        ws = SAVE_WORLD[name]
        trained = run_ranks(worker, ws, name, seed, d, "train")
        resumed = run_ranks(worker, ws, name, seed, d, "resume")
        for rank, (a, b) in enumerate(zip(trained, resumed)):
            assert a["lr"] == b["lr"]
            for n in a["local"]:
                assert torch.equal(a["local"][n], b["local"][n]), "%s rank %d (seed %d)" % (n, rank, seed)
            assert a["state"].keys() == b["state"].keys()
            for k in a["state"]:
                assert a["state"][k].keys() == b["state"][k].keys()
                for s, t in a["state"][k].items():
                    assert torch.equal(t, b["state"][k][s]), "state %s/%s (seed %d)" % (k, s, seed)
        w = OTHER_WORLD[name]
        want = trained[0]["full"]
        got = run_ranks(worker, w, name, seed, d, "resume")[0]["full"]
        if name == "adamw8bit":  # another world size sums gradients in another order
            close_but_for_code_flips(got, want, "at %d ranks, seed %d" % (w, seed))
            return
        for n, t in want.items():
            torch.testing.assert_close(got[n], t, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: "%s at %d ranks (seed %d): %s" % (n, w, seed, m))


# ---- with torch's own tools ---------------------------------------------------------------

def interop_worker(rank, world, d, kind):
    torch.manual_seed(7)
    if kind == "fsdp2_save":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as fsdp2
        model = Net()
        fsdp2(model, mesh=init_device_mesh("cpu", (world,)))
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(d, "fsdp2"))
    elif kind == "rfsdp_save":
        model = Net()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        rfsdp.fully_shard(model, policy=rfsdp.policy.muon())
        ckpt.save(os.path.join(d, "ours"), model)
    else:  # load a plain or FSDP2 checkpoint into an rfsdp model
        torch.manual_seed(8)  # other initial values, so a no-op load would show
        model = Net()
        rfsdp.fully_shard(model, policy=rfsdp.policy.muon())
        with pytest.raises(ckpt.CheckpointError, match="no rfsdp.json, so its files cannot be checked"):
            ckpt.load(os.path.join(d, kind), model)  # torch writes no marker: asked for by name
        ckpt.load(os.path.join(d, kind), model, check_files=False)
        return rfsdp.full_parameters(model)


def test_torch_tools_read_ours_and_we_read_plain_and_fsdp2_checkpoints():
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as d:
        # ours (2 ranks, an expert stack in several chunks) -> torch.save -> a plain module
        run_ranks(interop_worker, 2, d, "rfsdp_save")
        dcp_to_torch_save(os.path.join(d, "ours"), os.path.join(d, "ours.pt"))
        torch.manual_seed(7)
        plain = Net()
        want = {n: p.detach() + 1.0 for n, p in plain.named_parameters()}
        plain.load_state_dict(torch.load(os.path.join(d, "ours.pt"))["model"])
        for n, p in plain.named_parameters():
            assert torch.equal(p.detach(), want[n]), n
        # ... and dcp.load into a plain module's full state_dict
        fresh = Net()
        sd = {"model": fresh.state_dict()}
        dcp.load(sd, checkpoint_id=os.path.join(d, "ours"))
        fresh.load_state_dict(sd["model"])
        for n, p in fresh.named_parameters():
            assert torch.equal(p.detach(), want[n]), n
        # a plain model's DCP checkpoint -> rfsdp at 3 ranks
        torch.manual_seed(7)
        plain = Net()
        dcp.save({"model": plain.state_dict()}, checkpoint_id=os.path.join(d, "plain"))
        got = run_ranks(interop_worker, 3, d, "plain")[0]
        for n, p in plain.named_parameters():
            assert torch.equal(got[n], p.detach()), n
        # a torch FSDP2 model's DCP checkpoint (2 ranks) -> rfsdp at 3 ranks
        run_ranks(interop_worker, 2, d, "fsdp2_save")
        got = run_ranks(interop_worker, 3, d, "fsdp2")[0]
        for n, p in plain.named_parameters():  # FSDP2 kept the same initial values (seed 7)
            assert torch.equal(got[n], p.detach()), n


# ---- one process: folders, atomicity, bad checkpoints --------------------------------------

def one_model(seed=0, out=2):
    torch.manual_seed(seed)
    m = Net()
    if out != 2:
        m.out = nn.Linear(5, out, bias=False)
    return m


def params_of(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def stepped(m, opt):
    x, _ = batch(0, 0)
    opt.zero_grad()
    (m(x) - 1).square().mean().backward()
    opt.step()


def test_save_step_keep_last_and_a_save_that_dies(monkeypatch, tmp_path):
    m = one_model()
    opt = rfsdp.optim.AdamW(m.parameters(), lr=1e-2)
    for s in range(1, 5):
        stepped(m, opt)
        ckpt.save_step(tmp_path, s, m, opt, keep_last=2, extra=s)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004"]
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_00000004")
    kept = params_of(m)
    stepped(m, opt)

    def dies(*a, **k):  # a save that dies after writing part of its files
        with open(str(tmp_path / "step_00000005") + ".partial/__0_0.distcp", "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")
    monkeypatch.setattr(ckpt.dcp, "save", dies)
    with pytest.raises(ckpt.CheckpointError, match="OSError: disk full.*Nothing was replaced"):
        ckpt.save_step(tmp_path, 5, m, opt, keep_last=2)
    monkeypatch.undo()
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_00000004")  # the partial one is not
    assert sorted(os.listdir(tmp_path))[:2] == ["step_00000003", "step_00000004"]
    m2 = one_model(seed=1)
    opt2 = rfsdp.optim.AdamW(m2.parameters(), lr=1e-2)
    assert ckpt.load(ckpt.latest(tmp_path), m2, opt2) == 4
    for n, p in params_of(m2).items():
        assert torch.equal(p, kept[n]), n
    # the next save clears the dead one's folder
    ckpt.save_step(tmp_path, 5, m, opt, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000004", "step_00000005"]


def bad_case(tmp_path, how):
    m = one_model()
    opt = rfsdp.optim.AdamW8bit(m.parameters(), lr=1e-2, block=16, min_8bit_size=32)
    stepped(m, opt)
    path = ckpt.save(tmp_path / "ck", m, opt)
    data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    target_model, target_opt = one_model(seed=3), None
    if how == "other model":
        target_model = one_model(seed=3, out=4)
    target_opt = rfsdp.optim.AdamW8bit(target_model.parameters(), lr=1e-2,
                                       block=32 if how == "other blocks" else 16, min_8bit_size=32)
    stepped(target_model, target_opt)
    if how == "damaged":
        with open(os.path.join(path, data), "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))
    elif how == "truncated":
        with open(os.path.join(path, data), "r+b") as f:
            f.truncate(50)
    elif how == "missing":
        os.remove(os.path.join(path, data))
    elif how == "no marker":
        os.remove(os.path.join(path, ckpt.MARKER))
    return path, data, target_model, target_opt


@pytest.mark.parametrize("how,message", [
    ("other model", r"'model\.out\.weight' has shape \[2, 5\] there, \[4, 5\] here"),
    ("other blocks", r"the optimizer was .*'block': 16.*'block': 32"),
    ("damaged", r"file __0_0\.distcp is damaged"),
    ("truncated", r"file __0_0\.distcp is damaged"),
    ("missing", r"file __0_0\.distcp is missing"),
    ("no marker", r"no rfsdp\.json"),
])
def test_bad_checkpoint_is_refused_and_nothing_changes(tmp_path, how, message):
    path, data, m, opt = bad_case(tmp_path, how)
    before = params_of(m)
    state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load(path, m, opt)
    for n, p in params_of(m).items():
        assert torch.equal(p, before[n]), n
    for k, v in opt.state_dict()["state"].items():
        for n, t in v.items():
            assert torch.equal(t, state[k][n]), (k, n)


def test_model_only_and_missing_tensor(tmp_path):
    m = one_model()
    ckpt.save(tmp_path / "ck", m)
    other = one_model(seed=2)
    other.extra_head = nn.Linear(2, 2)
    with pytest.raises(ckpt.CheckpointError, match=r"no tensor 'model\.extra_head\.weight'"):
        ckpt.load(tmp_path / "ck", other)
    m2 = one_model(seed=2)
    with pytest.raises(ckpt.CheckpointError, match="holds no optimizer state"):
        ckpt.load(tmp_path / "ck", m2, rfsdp.optim.AdamW(m2.parameters()))
    ckpt.load(tmp_path / "ck", m2)
    for n, p in params_of(m2).items():
        assert torch.equal(p, dict(m.named_parameters())[n].detach()), n


def flip_a_weight_byte(path, weight):
    """Flips an exponent bit of weight's first float32 where a .distcp file holds
    it, as damage on disk would."""
    want = weight.detach().contiguous().numpy().tobytes()
    for name in sorted(f for f in os.listdir(path) if f.endswith(".distcp")):
        with open(os.path.join(path, name), "r+b") as f:
            data = f.read()
            at = data.find(want)
            if at >= 0:
                f.seek(at + 3)  # the high byte (little-endian)
                f.write(bytes([data[at + 3] ^ 0x40]))
                return
    raise AssertionError("the weight's bytes are in no .distcp file")


def test_model_only_load_checks_the_files_unless_asked_by_name(tmp_path):
    """Without its marker a model-only load read damaged files without a word (a
    flipped byte loaded as a weight of ~1e37): now the folder is refused, naming it
    and the way out, unless the caller asks for an unchecked load by name."""
    m = one_model()
    path = ckpt.save(tmp_path / "ck", m)
    flip_a_weight_byte(path, m.inp.weight)
    target = one_model(seed=3)
    before = params_of(target)
    with pytest.raises(ckpt.CheckpointError, match=r"file __0_0\.distcp is damaged"):
        ckpt.load(path, target)  # the marker's sums catch it
    os.remove(os.path.join(path, ckpt.MARKER))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path, target)
    assert str(e.value).startswith("checkpoint %s: no rfsdp.json, so its files cannot be checked"
                                   % path), str(e.value)
    assert "load(..., check_files=False)" in str(e.value) and "latest(root)" in str(e.value)
    for n, p in params_of(target).items():
        assert torch.equal(p, before[n]), n
    ckpt.load(path, target, check_files=False)  # asked by name: read as it is, damage included
    got, want = target.inp.weight.detach(), m.inp.weight.detach()
    assert torch.equal(got.flatten()[1:], want.flatten()[1:])
    assert got.flatten()[0] != want.flatten()[0]
    with open(os.path.join(path, ckpt.MARKER), "w") as f:  # a damaged marker
        f.write('{"format": 2, "files": ')
    with pytest.raises(ckpt.CheckpointError, match=r"rfsdp\.json is unreadable .*, so its files "
                                                   r"cannot be checked; nothing was loaded"):
        ckpt.load(path, target)


def test_a_missing_key_is_named(tmp_path):
    """A checkpoint without a key the model has (here torch's own, unchecked, and
    rfsdp's): the load names it."""
    saved = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False))
    dcp.save({"model": saved.state_dict()}, checkpoint_id=str(tmp_path / "torch"))
    ckpt.save(tmp_path / "ours", saved)
    for folder, unchecked in (("torch", True), ("ours", False)):
        target = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        with pytest.raises(ckpt.CheckpointError, match=r"has no tensor 'model\.1\.bias'"):
            ckpt.load(tmp_path / folder, target, check_files=not unchecked)


def test_damaged_marker_is_a_clear_error_never_another_exception(tmp_path):
    """A random-property test of the marker reader: rfsdp.json mutated hundreds of
    ways (bytes replaced by JSON's characters, slices dropped or repeated, cut
    short) either still verifies or raises CheckpointError."""
    m = one_model()
    path = ckpt.save(tmp_path / "ck", m)
    marker = os.path.join(path, ckpt.MARKER)
    valid = open(marker, "rb").read()
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    g = torch.Generator().manual_seed(seed)

    def pick(n):
        return int(torch.randint(0, max(n, 1), (), generator=g))
    alphabet = b'{}[]:,"0123456789-.e tfnlru'
    refused = 0
    for _ in range(400):
        text = bytearray(valid)
        for _ in range(1 + pick(3)):
            at = pick(len(text))
            kind = pick(4)
            if kind == 0 and text:
                text[at] = alphabet[pick(len(alphabet))]
            elif kind == 1:
                del text[at:at + 1 + pick(10)]
            elif kind == 2:
                start = pick(len(text))
                text[at:at] = text[start:start + 1 + pick(20)]
            else:
                del text[at:]
        with open(marker, "wb") as f:
            f.write(bytes(text))
        try:
            ckpt.verify(path)
        except ckpt.CheckpointError:
            refused += 1
        except Exception as e:  # noqa: BLE001
            pytest.fail("seed %d: %r for marker %r" % (seed, e, bytes(text)))
    assert refused > 300, "seed %d" % seed


def one_rank_worker(rank, world, d, what):
    """Every rank saves; then rank 0 alone saves (or loads), as DDP code does,
    over a group of its own (its abandoned collective must not hold the harness's
    last barrier), with a short timeout."""
    import torch.distributed as dist
    model = one_model()
    ckpt.save(os.path.join(d, "ck"), model)
    alone = dist.new_group([0, 1])
    out = None
    if rank == 0:
        try:
            if what == "save":
                ckpt.save(os.path.join(d, "ck2"), model, process_group=alone, timeout_seconds=2)
            else:
                ckpt.load(os.path.join(d, "ck"), model, process_group=alone, timeout_seconds=2)
            out = "no error"
        except ckpt.CheckpointError as e:
            out = str(e)
    dist.barrier()
    return out


@pytest.mark.parametrize("what", ["save", "load"])
def test_save_or_load_on_one_rank_is_an_error(what):
    """checkpoint.save on rank 0 only (a DDP habit) waited in torch's collectives for
    their 30-minute default: now rank 0 raises after timeout_seconds (the harness
    fails the test if a rank is still waiting after 60 s)."""
    with tempfile.TemporaryDirectory() as d:
        got = run_ranks(one_rank_worker, 2, d, what, timeout=60)[0]
        assert got.startswith("checkpoint.%s of %s: %s is collective: call it on every rank"
                              % (what, os.path.join(d, "ck2" if what == "save" else "ck"), what)), got
        assert "every rank (each rank writes and reads its own shards: rank 0 alone, as DDP code " \
            "often calls it, waits for the others), and not all did within 2 s: all_reduce did " \
            "not complete on rank 0 of 2" in got, got
        assert got.endswith("; nothing was %s" % ("written" if what == "save" else "loaded")), got
        assert not os.path.exists(os.path.join(d, "ck2")), "a lonely save wrote"


def requant_worker(rank, world, d):
    torch.manual_seed(5)
    model = Net()
    if world == 2:  # block 16, 8-bit from 32 elements
        rfsdp.fully_shard(model, policy=rfsdp.policy.blockwise_8bit(16))
        opt = rfsdp.optim.AdamW8bit(model.parameters(), lr=1e-2, block=16, min_8bit_size=32)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
        train(model, opt, sched, 5, range(3), rank, world)
        ckpt.save(os.path.join(d, "ck"), model, opt)
    else:  # block 32, 8-bit from 256 elements: inp.weight (240) becomes fp32
        rfsdp.fully_shard(model, policy=rfsdp.policy.blockwise_8bit(32))
        opt = rfsdp.optim.AdamW8bit(model.parameters(), lr=1e-2, block=32, min_8bit_size=256)
        try:
            ckpt.load(os.path.join(d, "ck"), model, opt)
            raise AssertionError("other 8-bit settings loaded without requantize=True")
        except ckpt.CheckpointError as e:
            assert "load with requantize=True" in str(e), str(e)
        ckpt.load(os.path.join(d, "ck"), model, opt, requantize=True)
        return {n: (rfsdp.shard_info(p), {k: t.clone() for k, t in opt.state[p].items()})
                for n, p in model.named_parameters()}


def test_requantize_loads_8bit_states_under_other_blocks():
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as d:
        run_ranks(requant_worker, 2, d)
        requantized = run_ranks(requant_worker, 3, d)
        dcp_to_torch_save(os.path.join(d, "ck"), os.path.join(d, "ck.pt"))
        saved = torch.load(os.path.join(d, "ck.pt"), weights_only=False)["optim"]
        for rank in range(3):
            got = requantized[rank]
            for n, (info, st) in got.items():
                rows, row_len = info.full_rows, info.row_len
                for k, (codes, scale, moment, signed) in enumerate(
                        (("q1", "absmax1", "exp_avg", True), ("q2", "absmax2", "exp_avg_sq", False))):
                    if "%s.%s" % (n, codes) in saved:  # saved 8-bit: dequantise (block 16)
                        full = rfsdp.quant.dequantize_blockwise(
                            saved["%s.%s" % (n, codes)], saved["%s.%s" % (n, scale)], block=16,
                            signed=signed).reshape(rows, row_len)
                    else:
                        full = saved["%s.%s" % (n, moment)].reshape(rows, row_len)
                    mine = full[info.row_begin:info.row_end]
                    if codes in st:  # 8-bit now (block 32): requantised
                        q, a = rfsdp.quant.quantize_blockwise(mine.contiguous(), block=32,
                                                              signed=signed,
                                                              keep_nonzero=not signed)
                        assert torch.equal(st[codes], q.reshape(-1)), (n, codes, rank)
                        assert torch.equal(st[scale], a.reshape(-1)), (n, scale, rank)
                    else:
                        assert torch.equal(st[moment].reshape(mine.shape), mine), (n, moment, rank)
                assert st["step"].item() == 3
            assert "q1" not in got["inp.weight"][1] and "q1" in got["experts"][1]


def test_settings_keep_the_spelling_saved_checkpoints_have():
    """A checkpoint's optimizer settings are compared as JSON values: those written
    so far must stay what the optimizers give (else their checkpoints stop
    loading), and each builds its C++ config again (what requantize=True decodes with)."""
    w = nn.Parameter(torch.randn(8, 8))
    o = rfsdp.optim
    shampoo = dict(type="Shampoo", max_preconditioner_dim=1024, precondition_frequency=20,
                   start_preconditioning_step=20, use_bias_correction=True,
                   factor_dtype="float32", rank_deficient="shift", rank_rtol=-1.0)
    soap = dict(type="SOAP", max_preconditioner_dim=1024, precondition_frequency=10,
                correct_bias=True, factor_dtype="float32", basis_dtype="float32",
                state_dtype="float32", basis_block=64, basis_map="linear_square",
                bjorck_iterations=1)
    cases = [
        (o.AdamW([w]), dict(type="AdamW")),
        (o.AdamW8bit([w]), dict(type="AdamW8bit", block=256, min_8bit_size=4096)),
        (o.AdamW8bit([w], block=(32, 32), min_8bit_size=1),
         dict(type="AdamW8bit", block=[32, 32], min_8bit_size=1)),
        (o.Muon([w]), dict(type="Muon", ns_dtype="float32", momentum_dtype="float32",
                           momentum_block=256, momentum_map="dynamic")),
        (o.Muon([w], momentum_dtype="int8", momentum_block=64, momentum_map="linear",
                ns_dtype=torch.bfloat16),
         dict(type="Muon", ns_dtype="bfloat16", momentum_dtype="int8", momentum_block=64,
              momentum_map="linear")),
        (o.Shampoo([w]), shampoo),
        (o.Shampoo([w], factor_dtype=torch.bfloat16, rank_deficient="pseudo_inverse",
                   rank_rtol=0.25, basis_dtype="int4", basis_block=32, bjorck_iterations=2),
         dict(shampoo, factor_dtype="bfloat16", rank_deficient="pseudo_inverse", rank_rtol=0.25,
              basis_dtype="int4", basis_block=32, basis_map="linear_square",
              bjorck_iterations=2)),
        (o.SOAP([w]), soap),
        (o.SOAP([w], basis_dtype="int8", basis_map="dynamic", state_dtype="int8",
                factor_dtype=torch.bfloat16),
         dict(soap, basis_dtype="int8", basis_map="dynamic", state_dtype="int8",
              factor_dtype="bfloat16")),
    ]
    for opt, want in cases:
        assert json.loads(json.dumps(opt.settings())) == want, type(opt).__name__
        if opt._config_class is not None:
            again = opt._config_class(**{k: v for k, v in want.items() if k != "type"})
            assert dict(again.settings(), type=want["type"]) == want, want
