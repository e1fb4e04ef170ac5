# Sourced by the bench/gpu_s*.sh scripts on the device machine (carry [".whl"]): the wheels
# its image lacks into /tmp/site, this checkout and them on PYTHONPATH, and the card's name;
# verify_ab, the verify step A/B of the split-K setting the scripts share.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader

verify_ab() {  # $1: seconds per run; the rest: SPLITFLASH_LINEAR_SPLIT_K of each run
  local limit=$1; shift
  for s in "$@" ; do
    SPLITFLASH_LINEAR_SPLIT_K=$s timeout "$limit" python3 -m bench.verify_step --contexts 512 \
      185000 --q-lens 16 1 --reps 40 --json-out "$OUT/verify_step_split${s}_$SECONDS.json" \
      2>&1 | grep -E "\] ctx" | sed "s|^|split=$s |"
  done
}
