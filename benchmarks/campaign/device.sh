#!/usr/bin/env bash
# On the lent GPU machine, from the checkout's root (benchmarks/campaign/README.md):
#   device.sh stash            keep this call's carry/call-*/part-* in /tmp/dj/parts; once every
#                              part SHA256SUMS names is there: verify, unpack, install the gguf
#                              wheel, convert the target (the machine's /tmp lives while warm)
#   device.sh round R INIT CURVE [campaign flags...]
#                              campaign round R from drafter folder INIT ('fresh': a new one)
#                              and curve CURVE; what comes back goes to $OUT (the drafter's
#                              parts, back.tar with the curve, the round's record and logs,
#                              and as many of the exported shards' parts as fit the call)
#   device.sh fetch DIR [SKIP] files under /tmp/dj/DIR (e.g. out-9/shards, xla), sorted,
#                              after the first SKIP, at most 8 files and 60 MiB, into $OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
DJ="${DJ:-/tmp/dj}"
export PYTHONPATH="$DJ/pylib:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DOMINO_JAX_SMOLLM2_GGUF="$DJ/stage/smollm2.gguf" DOMINO_JAX_TOKENIZER_DIR="$DJ/tokenizer"
# the self-distillation queues (1,024 slots of a 512-token width: ~20 GB of caches, plus a
# refill's prefill) and the programs compiling beside them need more than jax's default 75%
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export DOMINO_JAX_CACHE="$DJ/cache" DOMINO_JAX_COMPILE_CACHE="$DJ/xla" JAX_COMPILATION_CACHE_DIR="$DJ/xla"
OUT="${OUT:-$DJ/out}"
mkdir -p "$DJ/parts" "$OUT"

setup() {
  [ -f "$DJ/parts/SHA256SUMS" ] || { echo "stash: no SHA256SUMS carried yet"; return 0; }
  local missing; missing=$(cd "$DJ/parts" && awk '{print $2}' SHA256SUMS | while read -r f; do
    [ -f "$f" ] || echo "$f"; done)
  if [ -n "$missing" ]; then echo "stash: waiting for" $missing; return 0; fi
  [ -f "$DJ/ready" ] && { echo "stash: already set up"; return 0; }
  (cd "$DJ/parts" && sha256sum -c --quiet SHA256SUMS) || { echo "stash: a part is corrupt" >&2; exit 2; }
  rm -rf "$DJ/stage" && mkdir -p "$DJ/stage" "$DJ/tokenizer" "$DJ/pylib"
  cat "$DJ"/parts/part-* | tar xf - -C "$DJ/stage"
  tar xzf "$DJ/stage/tokenizer.tgz" -C "$DJ/tokenizer"
  tar xzf "$DJ/stage/corpora.tgz" -C "$DJ"
  python3 -m zipfile -e "$DJ"/stage/gguf-*.whl "$DJ/pylib"
  python3 -c "from domino_jax.demo_model import demo_target_dir; print('target:', demo_target_dir())"
  touch "$DJ/ready"; ls "$DJ"
}

# copy_files SRC SKIP DEST MAXFILES MAXBYTES: SRC's files, sorted, after the first SKIP, into
# DEST while both limits hold; says where a later fetch goes on
copy_files() {
  local src="$1" skip="$2" dest="$3" max_files="$4" max_bytes="$5"
  (cd "$src" && find . -type f | sort) | tail -n +$((skip + 1)) | {
    n=0 bytes=0
    while read -r f; do
      size=$(stat -c %s "$src/$f")
      [ $n -lt "$max_files" ] && [ $((bytes + size)) -le "$max_bytes" ] || break
      mkdir -p "$dest/$(dirname "$f")"; cp "$src/$f" "$dest/$f"; n=$((n + 1)); bytes=$((bytes + size))
    done
    echo "fetch $src: $n files, $bytes bytes (next: SKIP=$((skip + n)) of $(cd "$src" && find . -type f | wc -l))"; }
}

cmd="${1:-}"; shift || true
case "$cmd" in
  stash)
    for f in carry/call-*/part-* carry/call-*/SHA256SUMS; do [ -f "$f" ] && cp "$f" "$DJ/parts/"; done
    setup ;;
  round)
    [ -f "$DJ/ready" ] || { echo "round: not set up (device.sh stash each carry/call-NN first)" >&2; exit 2; }
    [ $# -ge 3 ] || { echo "usage: device.sh round R INIT CURVE [campaign flags...]" >&2; exit 2; }
    r="$1" init="$2" curve="$3"; shift 3
    out="$DJ/out-$r"; rm -rf "$out"; mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
    rc=0
    python3 -m domino_jax.train.campaign --round "$r" --work "$DJ/work" --out "$out" \
        --init "$init" --curve "$curve" --export-shards \
        --train-args "--no-progress --loss-chunk-rows 0" "$@" >"$out/round-$r.log" 2>&1 || rc=$?
    tail -25 "$out/round-$r.log"
    # the drafter's parts as they are (each < 16 MiB); the rest, small, in one tar
    [ -d "$out/draft" ] && cp -r "$out/draft" "$OUT/draft"
    metrics=$(ls -t "$DJ"/work/round-"$r"*/metrics.jsonl 2>/dev/null | head -1 || true)
    [ -n "$metrics" ] && cp "$metrics" "$out/metrics-round$r.jsonl"
    (cd "$out" && tar czf "$OUT/back.tar.gz" --exclude ./shards --exclude ./draft .)
    # the exported shards' first parts too, in what a call's 8 files and ~60 MiB leave
    if [ -d "$out/shards" ]; then
      used=$(find "$OUT" -type f | wc -l) bytes=$(du -sb "$OUT" | cut -f1)
      copy_files "$out/shards" 0 "$OUT/shards" $((8 - used)) $((60 * 1024 * 1024 - bytes))
    fi
    ls -laR "$OUT"; exit "$rc" ;;
  fetch)
    [ $# -ge 1 ] || { echo "usage: device.sh fetch DIR [SKIP]" >&2; exit 2; }
    src="$DJ/$1" skip="${2:-0}"
    [ -d "$src" ] || { echo "fetch: no $src" >&2; exit 2; }
    if [ "$1" = xla ]; then tar czf "$DJ/xla.tgz" -C "$DJ" xla && src="$DJ/xla.tgz.d" &&
      rm -rf "$src" && mkdir "$src" && split -d -b 15M "$DJ/xla.tgz" "$src/xla.tgz.part-"; fi
    copy_files "$src" "$skip" "$OUT" 8 $((60 * 1024 * 1024)) ;;
  *) echo "usage: device.sh stash | round R INIT CURVE [flags...] | fetch DIR [SKIP]" >&2; exit 2 ;;
esac
