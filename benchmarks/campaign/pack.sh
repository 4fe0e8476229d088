#!/usr/bin/env bash
# Builds carry/: everything a fresh lent GPU machine needs for drafter campaign rounds
# (benchmarks/campaign/README.md), from a checkout with ./dev's venv and nothing else.
#   bash benchmarks/campaign/pack.sh [--call-mib N]
# carry/call-NN/ are the folders to carry one per device call (each within the call's tree
# limit beside the tracked files); benchmarks/campaign/device.sh joins them on the machine.
# What goes in: the SmolLM2 GGUF, its tokenizer folder, the gguf wheel, and the three campaign
# corpora rebuilt from their seeds (docs/design.md §25; the held-out split is the seed-0 build's).
set -euo pipefail
cd "$(dirname "$0")/../.." && root=$PWD
call_mib=""
while [ $# -gt 0 ]; do
  case "$1" in
    --call-mib) call_mib="$2"; shift 2 ;;
    *) echo "usage: pack.sh [--call-mib N]" >&2; exit 2 ;;
  esac
done
[ -x .venv/bin/python ] || ./dev test --version >/dev/null
PY=.venv/bin/python
if [ -z "$call_mib" ]; then
  # a call carries the tracked tree too: what is left of its 64 MiB, less 2 MiB of margin
  tracked_kib=$(git ls-files -z | xargs -0 du -k --apparent-size 2>/dev/null | awk '{s+=$1} END {print s}')
  call_mib=$(( 62 - tracked_kib / 1024 ))
fi
[ "$call_mib" -ge 4 ] || { echo "pack.sh: only $call_mib MiB a call left beside the tracked tree" >&2; exit 2; }
rm -rf carry && mkdir -p carry/stage carry/build
stage=carry/stage
gguf=$($PY -c "from domino_jax.demo_model import find_smollm2_gguf; print(find_smollm2_gguf())")
target=$($PY -c "from domino_jax.demo_model import demo_target_dir; print(demo_target_dir())")
cp "$gguf" "$stage/smollm2.gguf"
tar czf "$stage/tokenizer.tgz" -C "$target" --exclude model.safetensors --exclude gguf_source.json .
gguf_version=$($PY -c "import importlib.metadata as m; print(m.version('gguf'))")
.venv/bin/pip download -q --no-deps --no-cache-dir -d "$stage" "gguf==$gguf_version"
b=carry/build
$PY -m domino_jax.train.corpus --out $b/corpus0 --num-prompts 60000 --seed 0 >$b/corpus0.log
$PY -m domino_jax.train.corpus --out $b/corpus1 --num-prompts 100000 --seed 1 \
    --extends $b/corpus0 >$b/corpus1.log
$PY -m domino_jax.train.corpus --out $b/corpus2 --num-prompts 100000 --seed 2 \
    --extends $b/corpus0 --extends $b/corpus1 >$b/corpus2.log
# the campaign's curve compares rounds on one held-out split and counts prompts by their place
# in these exact files: a rebuild that differs (other package versions as sources) must stop
(cd $b && sha256sum -c --quiet "$root/benchmarks/campaign/corpora.sha256") || {
  echo "pack.sh: the corpora rebuilt here differ from the campaign's" \
       "(benchmarks/campaign/corpora.sha256); see $b/corpus*.log" >&2; exit 2; }
tar czf "$stage/corpora.tgz" -C $b corpus0 corpus1 corpus2
# one stream of the stage, cut into parts, a part per call folder; sha256 of every part
(cd "$stage" && tar cf - .) | split -d -a 2 -b "${call_mib}M" - carry/part-
n=0
for part in carry/part-*; do
  d=$(printf 'carry/call-%02d' "$n"); mkdir -p "$d"; mv "$part" "$d/"; n=$((n + 1))
done
(cd carry && sha256sum call-*/part-* | sed 's# call-[0-9]*/# #' > SHA256SUMS)
for d in carry/call-*; do cp carry/SHA256SUMS "$d/"; done
rm -rf "$stage" carry/build
echo "carry/: $n call folders of at most $call_mib MiB (corpora checked against corpora.sha256)"
echo "carry each as 'carry/call-NN' with: bash benchmarks/campaign/device.sh stash"
du -sh carry/call-* | sed 's/^/  /'
