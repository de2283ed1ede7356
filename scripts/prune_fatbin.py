#!/usr/bin/env python3
"""Prune the CUDA device code of shared libraries down to one GPU architecture, in place.

Used by scripts/pack_fbgemm_gpu_slim.sh to shrink the fbgemm_gpu wheel for an H200 (sm_90).

Where device code lives: nvcc puts one *fatbin* per translation unit into the ELF section
`.nv_fatbin`; the fatbins sit back to back (8-byte aligned). Each one is registered at load
time through a 24-byte wrapper in `.nvFatBinSegment` (magic 0x466243B1, version, pointer to
the fatbin, pointer to a file name), which the host code hands to __cudaRegisterFatBinary.
The CUDA driver then reads that fatbin, picks the entry that matches the device's SM
(SASS for exactly that SM family, else PTX it can JIT) and ignores every other entry.

Fatbin layout (little endian; learned from public re-implementations of the format, e.g.
n-eiling/cuda-fatbin-decompression and jiegec/fatbinary, and checked against these files):
    header, 16 bytes:   u32 magic 0xBA55ED50, u16 version (1), u16 header size (16),
                        u64 size of all entries that follow the header
    entry, repeated:    u16 kind (1 = PTX, 2 = ELF/SASS), u16 version (0x0101),
                        u32 entry header size (64; 112 for sm_100a here), u64 payload size,
                        u32 compressed size, u32 options offset, u16 minor, u16 major,
                        u32 arch (80, 90, 100 ...), u32 name offset, u32 name length,
                        u64 flags (0x1 64-bit, 0x10 linux, 0x2000 LZ4-compressed,
                        0x8000 zstd-compressed [CUDA 12.8+], 0x100000 arch-specific "a"),
                        u64 reserved, u64 decompressed size, [rest of entry header]
                        then the payload (padded size given above).
Compressed entries (CUDA 12.8+ zstd for large cubins) need no special handling: an entry
is kept or dropped as a whole (header + payload bytes copied verbatim), never decoded.

What the rewrite does, per fatbin: the entries to keep (ELF with arch == --sm, plus PTX
of that arch only with --keep-ptx) are moved to the front, right after the fatbin header,
the header's size field is set to just those entries, and every byte from there to the
old end of the fatbin is zeroed. Why this is safe:
  * Nothing in the ELF file moves or changes size: the section, its file offset and
    address, every other fatbin and every wrapper pointer (and the R_X86_64_RELATIVE
    relocations that fill them) stay exactly where they were. Only bytes inside the
    fatbin change.
  * Each wrapper still points at a valid fatbin header; the driver reads `size` bytes
    of entries from there, so it sees an ordinary single-architecture fatbin, the same
    thing `nvcc -gencode arch=compute_90a,code=sm_90a` would have produced. The kept
    entry starts at the same offset (16) the first entry had, so its alignment is what
    nvcc gave it. The zeroed tail is never read by anyone.
  * The SASS that is removed could never run on an sm_90 GPU anyway: cubins only run on
    their own major SM version (sm_80 SASS does not run on sm_90, sm_100a not either),
    and the wheel carries no PTX, so there was no JIT fallback to lose.
  * A fatbin without an entry for --sm is left untouched (and reported), so nothing that
    worked before can stop working.
Zeroed bytes compress to almost nothing under xz, which is the point of the exercise.

Usage:
    prune_fatbin.py [--sm 90] [--keep-ptx] [--dry-run] FILE.so ...   # rewrite in place
    prune_fatbin.py --sm 90 --verify FILE.so ...                      # check a pruned file
"""
from __future__ import annotations

import argparse
import collections
import mmap
import re
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
WRAPPER_MAGIC = 0x466243B1
KIND_PTX, KIND_ELF = 1, 2
FLAG_LZ4, FLAG_ZSTD = 0x2000, 0x8000
FATBIN_HDR = struct.Struct("<IHHQ")
# kind, version, hdr size, payload size, compressed size, options off, minor, major, arch,
# name off, name len, flags, reserved, decompressed size
ENTRY_HDR = struct.Struct("<HHIQIIHHIIIQQQ")
R_X86_64_RELATIVE = 8
NONZERO = re.compile(rb"[^\x00]")


class FormatError(Exception):
    pass


def read_sections(m):
    """Return {name: (type, addr, offset, size)} of a little-endian ELF64 file."""
    if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
        raise FormatError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", m, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", m, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize) for i in range(shnum)]
    str_off, str_size = hdrs[shstrndx][4], hdrs[shstrndx][5]
    out = {}
    for name_off, typ, _flags, addr, off, size, *_ in hdrs:
        start = str_off + name_off
        name = bytes(m[start:m.find(b"\0", start, str_off + str_size)]).decode()
        out.setdefault(name, []).append((typ, addr, off, size))
    return out


def parse_fatbin(m, pos, end):
    """Parse the fatbin at file offset pos; return (entries, end offset).

    Each entry is a dict with its file offset, total length (header + payload) and fields."""
    magic, version, hsize, size = FATBIN_HDR.unpack_from(m, pos)
    if magic != FATBIN_MAGIC or version != 1 or hsize != FATBIN_HDR.size:
        raise FormatError(f"bad fatbin header at {pos:#x}: {magic:#x} v{version} h{hsize}")
    e, fend = pos + hsize, pos + hsize + size
    if fend > end:
        raise FormatError(f"fatbin at {pos:#x} runs past its section")
    entries = []
    while e < fend:
        (kind, _ver, ehs, psize, csize, _oo, _minor, _major, arch, _no, _nl, flags, _r,
         dsize) = ENTRY_HDR.unpack_from(m, e)
        if kind not in (KIND_PTX, KIND_ELF) or ehs < ENTRY_HDR.size or e + ehs + psize > fend:
            raise FormatError(f"bad fatbin entry at {e:#x} (kind {kind}, header {ehs})")
        entries.append(dict(off=e, length=ehs + psize, kind=kind, arch=arch, flags=flags,
                            compressed=bool(flags & (FLAG_LZ4 | FLAG_ZSTD)),
                            stored=psize, unpacked=dsize if flags & (FLAG_LZ4 | FLAG_ZSTD) else psize))
        e += ehs + psize
    if e != fend:
        raise FormatError(f"fatbin at {pos:#x}: entries do not add up to its size")
    return entries, fend


def walk_section(m, off, size):
    """Yield (fatbin offset, entries) for the fatbins laid back to back in a section.

    Gaps between fatbins (alignment padding) must be zero bytes; zeroed tails left by an
    earlier pruning run are gaps too, so a pruned file walks the same way."""
    pos, end = off, off + size
    while pos < end:
        if end - pos < 4 or struct.unpack_from("<I", m, pos)[0] != FATBIN_MAGIC:
            hit = NONZERO.search(m, pos, end)  # skip a run of zero bytes
            if hit is None:
                return
            nxt = hit.start()
            if nxt == pos or end - nxt < 4 or struct.unpack_from("<I", m, nxt)[0] != FATBIN_MAGIC:
                raise FormatError(f"unexpected non-zero bytes at {nxt:#x} between fatbins")
            pos = nxt
            continue
        entries, fend = parse_fatbin(m, pos, end)
        yield pos, entries
        pos = fend


def wrapper_targets(m, secs):
    """File offsets of the fatbins the runtime registers (pointers in .nvFatBinSegment)."""
    if ".nvFatBinSegment" not in secs:
        return None
    relative = {}  # vaddr -> addend of R_X86_64_RELATIVE relocations (what ld.so writes there)
    for typ, _addr, off, size in secs.get(".rela.dyn", []):
        for i in range(off, off + size, 24):
            r_off, r_info, r_add = struct.unpack_from("<QQq", m, i)
            if r_info & 0xFFFFFFFF == R_X86_64_RELATIVE:
                relative[r_off] = r_add
    fatbin_secs = secs.get(".nv_fatbin", [])
    targets = []
    for _typ, addr, off, size in secs[".nvFatBinSegment"]:
        for i in range(0, size, 24):
            magic, _version, ptr = struct.unpack_from("<IIQ", m, off + i)
            if magic != WRAPPER_MAGIC:
                raise FormatError(f"bad fatbin wrapper at {off + i:#x}")
            ptr = relative.get(addr + i + 8, ptr)
            for _t, saddr, soff, ssize in fatbin_secs:
                if saddr <= ptr < saddr + ssize:
                    targets.append(ptr - saddr + soff)
                    break
            else:
                raise FormatError(f"wrapper at {off + i:#x} points outside .nv_fatbin ({ptr:#x})")
    return targets


def keep(entry, sm, keep_ptx):
    return entry["arch"] == sm and (entry["kind"] == KIND_ELF or keep_ptx)


def process(path, sm, keep_ptx, dry_run, verify, totals):
    with open(path, "rb" if (dry_run or verify) else "r+b") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ if (dry_run or verify) else mmap.ACCESS_WRITE)
        try:
            secs = read_sections(m)
            fatbin_secs = secs.get(".nv_fatbin", [])
            if not fatbin_secs:
                print(f"{path}: no device code")
                return True
            for other in ("__nv_relfatbin", ".nv_fatbin.rel"):
                if other in secs:
                    print(f"{path}: WARNING: also has {other} (relocatable device code), left as is")
            fatbins = [fb for _t, _a, off, size in fatbin_secs for fb in walk_section(m, off, size)]
            starts, ok = {pos for pos, _ in fatbins}, True
            # The runtime only ever reaches fatbins through the wrappers: check that each one
            # points at the start of a fatbin we parsed before touching anything.
            targets = wrapper_targets(m, secs)
            stray = [t for t in targets or [] if t not in starts]
            if stray:
                print(f"{path}: ERROR: wrappers point at non-fatbin offsets {stray[:4]}, not touched")
                return False
            per_file = collections.Counter()
            for pos, entries in fatbins:
                kept = [e for e in entries if keep(e, sm, keep_ptx)]
                dropped = [e for e in entries if not keep(e, sm, keep_ptx)]
                for e in entries:
                    tag = ("sm" if e["kind"] == KIND_ELF else "compute") + f"_{e['arch']}"
                    totals["compressed entries", tag] += e["compressed"]
                    totals["entries", tag] += 1
                if verify:
                    if dropped or not kept:
                        print(f"{path}: fatbin at {pos:#x} still holds "
                              f"{[(e['kind'], e['arch']) for e in dropped]} / kept {len(kept)}")
                        ok = False
                    continue
                if not kept:
                    print(f"{path}: WARNING: fatbin at {pos:#x} has no sm_{sm} entry, left as is")
                    continue
                for e in dropped:
                    tag = ("sm" if e["kind"] == KIND_ELF else "compute") + f"_{e['arch']}"
                    per_file[tag] += e["length"]
                    totals["pruned bytes", tag] += e["length"]
                if dry_run or not dropped:
                    continue
                # New fatbin = old header (size patched) + kept entries, verbatim; then zeros
                # up to the old end so nothing after this fatbin moves.
                old_end = entries[-1]["off"] + entries[-1]["length"]
                body = b"".join(bytes(m[e["off"]:e["off"] + e["length"]]) for e in kept)
                m[pos + 8:pos + 16] = struct.pack("<Q", len(body))
                w = pos + FATBIN_HDR.size
                m[w:w + len(body)] = body
                m[w + len(body):old_end] = bytes(old_end - w - len(body))
            if not (dry_run or verify):
                for t in targets or []:
                    parse_fatbin(m, t, t + (1 << 62))  # each is still a well-formed fatbin
            if verify:
                print(f"{path}: {len(starts)} fatbins, "
                      f"{'all sm_%d only' % sm if ok else 'NOT PRUNED'}; "
                      f"{len(targets or [])} wrappers point at fatbin starts")
            else:
                print(f"{path}: {len(starts)} fatbins, pruned "
                      + (", ".join(f"{k} {v:,} B" for k, v in sorted(per_file.items())) or "nothing"))
            if not dry_run and not verify:
                m.flush()
            return ok
        finally:
            m.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--sm", type=int, default=90, help="SM arch whose SASS is kept (90 = H100/H200)")
    ap.add_argument("--keep-ptx", action="store_true", help="also keep PTX of that arch")
    ap.add_argument("--dry-run", action="store_true", help="report what would be pruned")
    ap.add_argument("--verify", action="store_true", help="check files hold only --sm entries")
    a = ap.parse_args()
    totals = collections.Counter()
    ok = True
    for path in a.files:
        try:
            ok &= process(path, a.sm, a.keep_ptx, a.dry_run, a.verify, totals)
        except FormatError as exc:
            print(f"{path}: ERROR: {exc}")
            ok = False
    for (what, tag), v in sorted(totals.items()):
        print(f"  total {what:18s} {tag:12s} {v:>15,}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
