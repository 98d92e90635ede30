"""The one gatherer of pieces: every rank's pieces of global tensors put
together, on every rank (a full state dict, a sharded model's full parameters,
a unit planned again)."""
import torch
import torch.distributed as dist

from .pieces import rows_entry

_ALIGN = 8  # every piece starts at a multiple of this many bytes: any dtype views it


def _padded(n):
    return -(-n // _ALIGN) * _ALIGN


def gather(entries, pg):
    """{key: global tensor} of every entry (layout.Entry), on every rank of pg:
    each rank's written pieces (disjoint over the ranks, or the same values where
    two write one) travel as their bytes, after a header of where they lie, in
    one all-gather padded to the longest rank's (after one of the lengths): exact
    for every dtype. Every rank passes the same keys in the same order.
    Collective where pg has several ranks."""
    out = {e.key: e.tensor for e in entries if e.pieces is None}
    placed = [e for e in entries if e.pieces is not None]
    if not placed:
        return out
    device = placed[0].device
    header, data = [], []
    for j, e in enumerate(placed):
        for o, s, t in e.written():
            header += [j, *o, *s]
            b = t.detach().to(device).contiguous().view(-1).view(torch.uint8)
            data.append(torch.nn.functional.pad(b, (0, _padded(b.numel()) - b.numel())))
    mine = torch.cat([torch.tensor(header, dtype=torch.int64).view(torch.uint8).to(device)] + data) \
        if header else torch.zeros(0, dtype=torch.uint8, device=device)
    world = pg.size() if pg is not None else 1
    lengths = [(len(header), mine.numel())]
    if world > 1:
        mine_len = torch.tensor([len(header), mine.numel()], dtype=torch.int64, device=device)
        every_len = torch.empty(2 * world, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(every_len, mine_len, group=pg)
        flat = every_len.tolist()
        lengths = list(zip(flat[0::2], flat[1::2]))
        longest = max(n for _, n in lengths)
        every = torch.empty(world * longest, dtype=torch.uint8, device=device)
        dist.all_gather_into_tensor(
            every, torch.nn.functional.pad(mine, (0, longest - mine.numel())), group=pg)
        segments = [every[r * longest:r * longest + n] for r, (_, n) in enumerate(lengths)]
    else:
        segments = [mine]
    full = [torch.zeros(e.shape, dtype=e.dtype, device=device) for e in placed]
    for (n_header, _), seg in zip(lengths, segments):
        head = seg[:8 * n_header].cpu().clone().view(torch.int64).tolist()
        at, h = 8 * n_header, 0
        while h < len(head):
            j = head[h]
            d = len(placed[j].shape)
            o, s = head[h + 1:h + 1 + d], head[h + 1 + d:h + 1 + 2 * d]
            h += 1 + 2 * d
            n = placed[j].dtype.itemsize
            for x in s:
                n *= x
            piece = seg[at:at + n].view(placed[j].dtype).view(s)
            full[j][tuple(slice(a, a + k) for a, k in zip(o, s))] = piece
            at += _padded(n)
    out.update((e.key, t) for e, t in zip(placed, full))
    return out


def full_rows(items, pg):
    """The global tensors of [(local rows, ShardInfo)] of one shard group, on every
    rank of it (gather's)."""
    world = pg.size() if pg is not None else 1
    entries = []
    for k, (t, info) in enumerate(items):
        if len(info.rank_rows) != world:
            raise ValueError("rfsdp: '%s' does not know every rank's rows (%d of %d ranks); "
                             "only shards made by fully_shard or FSDP2 can be gathered"
                             % (info.name, len(info.rank_rows), world))
        entries.append(rows_entry(str(k), t, info))
    got = gather(entries, pg)
    return [got[str(k)] for k in range(len(items))]
