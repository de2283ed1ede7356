#!/usr/bin/env bash
# Packs the CUDA build of fbgemm-gpu at requirements/gpu.txt's version (cp312, CUDA 13, 465 MB wheel / 2.4 GB unpacked) for
# the H200 GPU machine (sm_90) into xz tar parts of at most 50 MB each:
#     .gpu/fbgemm_gpu_slim.tar.xz.part00, part01, ...   (.gpu/ is git-ignored; never commit them)
# Install on the GPU machine: scripts/gpu_install.sh, which unpacks them into /tmp/site once every
# part has arrived (/tmp/site/fbgemm_gpu/, list_versions/ and fbgemm_gpu-VERSION.dist-info/, the layout
# `pip install --target /tmp/site` makes). H200, 2026-12-03: 1.6.0 imported under torch 2.11, and torchrec's
# sharded tables ran their fused TBE forward and backward kernels (benchmarks/results/README.md).
#
# How it gets small: the wheel's 14 CUDA libraries carry SASS for sm_80, sm_90a and sm_100a
# (no PTX). An H200 can only run the sm_90a SASS, so scripts/prune_fatbin.py rewrites every
# fatbin inside the .so files to hold just that entry and zeroes the bytes freed (1.48 GB),
# without moving anything in the ELF files (see the docstring there for why that is safe).
# Zeroes cost nothing under xz. The host code is already stripped (no .symtab/.debug_*), so
# `strip` would gain nothing and is not run.
#     bash scripts/pack_fbgemm_gpu_slim.sh [WHEEL]   # takes ~8 min on 2 cores, needs ~3 GB in $TMPDIR
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_pins.sh
wheel=${1:-/tmp/fbg/fbgemm_gpu-$(pin fbgemm-gpu)-cp312-cp312-manylinux_2_28_x86_64.whl}
sm=90                    # H100/H200; its SASS is tagged sm_90a in this wheel (arch field 90)
part_bytes=50000000      # 50 MB (decimal), below the ~55 MB a single upload may carry
out=.gpu/fbgemm_gpu_slim.tar.xz.part
cuobjdump=${CUOBJDUMP:-.venv/lib/python3.11/site-packages/triton/backends/nvidia/bin/cuobjdump}

work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir "$work/site" && (cd "$work/site" && unzip -q "$wheel")
site=$work/site
mapfile -t libs < <(find "$site" -name '*.so' | sort)

# Remember the ELF layout (section/segment offsets, sizes, addresses) to prove it is unchanged.
for f in "${libs[@]}"; do readelf -SWl "$f"; done > "$work/layout.before"

python3 scripts/prune_fatbin.py --sm "$sm" "${libs[@]}"

# Checks: our own parser (only sm_$sm entries left, every .nvFatBinSegment wrapper still points
# at a well-formed fatbin), the layout, and NVIDIA's cuobjdump, which must still walk every
# fatbin and list nothing but sm_90/sm_90a cubins (and no PTX).
python3 scripts/prune_fatbin.py --sm "$sm" --verify "${libs[@]}" > "$work/verify.log" \
  || { cat "$work/verify.log"; echo "verify failed" >&2; exit 1; }
for f in "${libs[@]}"; do readelf -SWl "$f"; done > "$work/layout.after"
cmp -s "$work/layout.before" "$work/layout.after" || { echo "ELF layout changed" >&2; exit 1; }
if [[ -x $cuobjdump ]]; then
  # (outputs are captured first: with pipefail, an early-exiting `grep -q` could SIGPIPE
  # the writer and turn a failed check into a silent pass)
  n=0
  for f in "${libs[@]}"; do
    [[ $(readelf -SW "$f") == *.nv_fatbin* ]] || continue   # host-only library
    elfs=$("$cuobjdump" --list-elf "$f" 2>&1) || { echo "cuobjdump failed on $f: $elfs" >&2; exit 1; }
    listed=$(grep -c 'ELF file' <<<"$elfs" || true)
    good=$(grep -cE "^ELF file +[0-9]+: .*\.sm_${sm}a?\.cubin$" <<<"$elfs" || true)
    ptx=$("$cuobjdump" --list-ptx "$f" 2>&1 || true)
    if (( listed == 0 || listed != good )) || grep -q '^PTX file' <<<"$ptx"; then
      echo "cuobjdump: $f still lists other entries or PTX:"$'\n'"$elfs"$'\n'"$ptx" >&2; exit 1
    fi
    n=$((n + good))
  done
  echo "cuobjdump: $n sm_$sm cubins, no other cubin, no PTX" \
       "(prune_fatbin.py: $(grep 'total entries' "$work/verify.log" | tr -s ' '))"
else
  echo "cuobjdump not found at $cuobjdump (set CUOBJDUMP); skipped that check" >&2
fi

# Keep RECORD honest: new sha256 and size for the rewritten libraries (pip does not check
# these on import, but tools that verify an install would otherwise flag them).
python3 - "$site" <<'EOF'
import base64, csv, glob, hashlib, io, os, sys
site = sys.argv[1]
(record,) = glob.glob(os.path.join(site, "*.dist-info", "RECORD"))
rows = list(csv.reader(open(record, newline="")))
for row in rows:
    path = os.path.join(site, row[0])
    if row[0].endswith(".so") and row[1]:
        data = open(path, "rb").read()
        row[1] = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        row[2] = str(len(data))
buf = io.StringIO(); csv.writer(buf, lineterminator="\n").writerows(rows)
open(record, "w", newline="").write(buf.getvalue())
EOF

# Deterministic tar of exactly what the wheel installs (its top-level entries), then one xz
# stream cut into parts. Single-threaded -9e: a multi-threaded xz splits the input into
# independent blocks and loses matches between similar kernels (64.6 MB with -T0 -9, 2.5 min,
# vs ~60 MB here, ~7 min); part count is the thing to save.
rm -f "$out"*
mkdir -p .gpu
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$site" -cf - \
    $(cd "$site" && ls) \
  | xz -T1 -9e | split -b "$part_bytes" -d -a 2 - "$out"

# The parts must reassemble into an intact archive (xz carries a CRC64 per block) with the
# expected layout.
cat "$out"* | xz -t
cat "$out"* | tar tJf - | cut -d/ -f1 | sort -u | tr '\n' ' '; echo
ls -l "$out"*
# scripts/gpu_install.sh unpacks once it holds this many parts (they may come over several calls).
ls "$out"* | wc -l > .gpu/fbgemm_gpu_slim.parts
echo "total $(cat "$out"* | wc -c) bytes in $(ls "$out"* | wc -l) parts; sha256 of the whole stream:"
cat "$out"* | sha256sum
