"""What rfsdp.optim's requantized_state methods share: a checkpoint's full state
cut to this rank's tiles and rows, low-bit codes decoded and encoded, and the
low-bit format check of the tiled optimizers' settings. (To move to C++: the
optimizers' state describing itself, issue 37.)"""
import torch

from .. import _C
from ..fsdp.dtensor import info_of


def _tiles_here(p, max_dim):
    """p's tiles for the whole tensor, [(first element, rows, cols, row stride)] in
    tile order, and the range [a, b) of them this rank keeps."""
    info = info_of("param", p)
    tiles = _C.shampoo_tile_list(list(info.global_shape if info is not None else p.shape), max_dim)
    _, row_len, begin, end = _row_span(p)
    e0, e1 = begin * row_len, end * row_len
    here = [k for k, t in enumerate(tiles) if e0 <= t[0] < e1]
    return (tiles, here[0], here[-1] + 1) if here else (tiles, 0, 0)


def _offsets(tiles, size):
    """Where each tile's entry starts in a sequence of size(tile) elements per tile."""
    out = [0]
    for t in tiles:
        out.append(out[-1] + size(t))
    return out


def _side(t, left):
    return t[1] if left else t[2]


def _row_span(p):
    """(rows, row_len, begin, end): p's row geometry as the optimizers see it
    (row_dims included) and this rank's rows [begin, end) (all of them unsharded)."""
    info = info_of("param", p)
    if info is None:
        rows, row_len = _C.row_geometry(list(p.shape), 1)
        return rows, row_len, 0, rows
    return info.full_rows, info.row_len, info.row_begin, info.row_end


def _like_rows(p, full, live, names):
    """This rank's rows of p's saved states shaped like the parameter."""
    rows, row_len, begin, end = _row_span(p)
    return {k: full[k].reshape(rows, row_len)[begin:end].reshape(live[k].shape).clone()
            for k in names if k in live}


def _pieces(full, live, tiles, a, b, sizes):
    """This rank's piece of each saved per-tile sequence named in sizes ({name: size(tile)})."""
    out = {}
    for name, size in sizes.items():
        if name in live:
            off = _offsets(tiles, size)
            out[name] = full[name].reshape(-1)[off[a]:off[b]].clone()
    return out


def _tile_view(flat, t, first=None):
    """Tile t of a flat tensor laid out as the whole tensor (first: t's first
    element there; default t's own)."""
    return flat.as_strided((t[1], t[2]), (t[3], 1),
                           flat.storage_offset() + (t[0] if first is None else first))


def _recoded_moments(p, full, live, tiles, a, b):
    """SOAP's m and v of p moved between fp32 and 8-bit codes (one block per tile
    row; dynamic maps, signed for m, unsigned for v): saved codes decoded whole
    and this rank's rows taken, or this rank's tiles of the saved fp32 moments
    encoded."""
    rows, row_len, begin, _ = _row_span(p)
    numel, e0 = rows * row_len, begin * row_len
    out = {}
    for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        code = _C.dynamic_map(signed)
        if name + "_codes" in full:
            whole = torch.empty(numel)
            ao = _offsets(tiles, lambda t: t[1])
            codes, absmax = full[name + "_codes"].reshape(-1), full[name + "_absmax"].reshape(-1)
            for k, t in enumerate(tiles):
                _tile_view(whole, t).copy_(code[_tile_view(codes, t).long()]
                                           * absmax[ao[k]:ao[k + 1]].unsqueeze(1))
            out.update(_like_rows(p, {name: whole}, live, (name,)))
            continue
        whole = full[name].reshape(-1).float()
        codes = torch.zeros(live[name + "_codes"].numel(), dtype=torch.uint8)
        scales = []
        for t in tiles[a:b]:
            q, am = _C.quantize_blockwise(_tile_view(whole, t).contiguous(), code, t[2],
                                          keep_nonzero=not signed)
            _tile_view(codes, t, t[0] - e0).copy_(q.reshape(t[1], t[2]))
            scales.append(am.reshape(-1))
        out[name + "_codes"] = codes.reshape(live[name + "_codes"].shape)
        out[name + "_absmax"] = torch.cat(scales) if scales else torch.zeros(0)
    return out


def _lowbit_format(dtype, block, cmap):
    """(bits, block, map) of basis_dtype "int8" / "int4", else None."""
    return ({"int8": 8, "int4": 4}[dtype], block, cmap) if dtype in ("int8", "int4") else None


def _decode_squares(full, name, tiles, left, fmt, iterations, a, b):
    """Tiles a..b-1's n x n matrices on one side of a saved sequence: fp32 / bf16
    entries, or (fmt) low-bit codes dequantised and Björck-rectified as the saved
    optimizer used them."""
    sizes = [_side(t, left) for t in tiles]
    if fmt is None:
        off = _offsets(tiles, lambda t: _side(t, left) ** 2)
        return [full[name].reshape(-1)[off[k]:off[k + 1]].float().view(sizes[k], sizes[k])
                for k in range(a, b)]
    bits, block, cmap = fmt
    co = _offsets(tiles, lambda t: (_side(t, left) ** 2 * bits + 7) // 8)
    ao = _offsets(tiles, lambda t: -(-_side(t, left) ** 2 // block))
    codes, absmax = full[name + "_codes"].reshape(-1), full[name + "_absmax"].reshape(-1)
    return [_C.bjorck(_C.lowbit_dequantize(codes[co[k]:co[k + 1]], absmax[ao[k]:ao[k + 1]], cmap,
                                           bits, block, sizes[k] ** 2).view(sizes[k], sizes[k]),
                      iterations) for k in range(a, b)]


def _encode_squares(qs, name, fmt, dtype):
    """This rank's entries of a sequence of n x n matrices qs: dtype entries, or
    (fmt) low-bit codes and scales."""
    if fmt is None:
        return {name: torch.cat([q.reshape(-1) for q in qs]).to(dtype) if qs
                else torch.zeros(0, dtype=dtype)}
    bits, block, cmap = fmt
    pairs = [_C.lowbit_quantize(q.contiguous(), cmap, bits, block) for q in qs]
    return {name + "_codes": torch.cat([c for c, _ in pairs]) if pairs else torch.zeros(0, dtype=torch.uint8),
            name + "_absmax": torch.cat([a for _, a in pairs]) if pairs else torch.zeros(0)}


def _check_quantised_bases(who, basis_dtype, basis_map, basis_block, bjorck_iterations):
    """The low-bit basis settings SOAP and Shampoo share (basis_dtype "int8" or "int4")."""
    if basis_map not in ("linear_square", "linear", "dynamic") or \
            (basis_map == "dynamic" and basis_dtype != "int8"):
        raise ValueError("%s: basis_map must be \"linear_square\", \"linear\" or "
                         "\"dynamic\" (int8 only), got %r" % (who, basis_map))
    for name, v, least in (("basis_block", basis_block, 1),
                           ("bjorck_iterations", bjorck_iterations, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError("%s: %s must be an integer >= %d, got %r" % (who, name, least, v))
