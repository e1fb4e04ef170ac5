#!/bin/bash
# Session 15, device call B: two attention-launch experiments, toggled by env, alternated:
#   SPLITFLASH_ATTN_TRIGGER=1  attention lets its split combine (PDL) be scheduled at once
#   SPLITFLASH_PART_FP16=1     split partial outputs stored in fp16 instead of fp32
# Ran on the working tree of fe07892 with temporary env toggles in kernels/paged_attention.py;
# the trigger became the default (ae81398) and the toggles were removed: a record of what ran.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
for i in 1 2; do
  for tf in 00 10 01 11; do
    SPLITFLASH_ATTN_TRIGGER=${tf:0:1} SPLITFLASH_PART_FP16=${tf:1:1} timeout 90 python3 -m \
      bench.kernels --batch-sizes 1 --kv-lens 8192,32768 --q-lens 1,16 \
      --out "$OUT/k_${tf}_$i.json" > /dev/null 2>&1
    python3 -c "import json,sys; [print(sys.argv[2], r['kv_len'], r['q_len'], '%.1f us' % (r['triton_ms'] * 1e3), 'copy %.3f sdpa %.3f' % (r['triton_vs_copy'], r['triton_vs_sdpa'])) for r in json.load(open(sys.argv[1]))]" "$OUT/k_${tf}_$i.json" "$tf/$i"
  done
done
for tf in 00 10 01 11; do
  SPLITFLASH_ATTN_TRIGGER=${tf:0:1} SPLITFLASH_PART_FP16=${tf:1:1} timeout 80 python3 -m \
    bench.verify_step --contexts 512 185000 --q-lens 16 --reps 100 \
    --json-out "$OUT/vs_$tf.json" 2>&1 | grep -E "^ +(512|185000) " | sed "s/^/$tf /"
done
