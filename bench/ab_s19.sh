python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
run(){ (cd $1 && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 -m bench.verify_step --contexts 512 32768 185000 --q-lens 1 16 --reps 50 --batch-invariant --json-out $OUT/vs_inv_$2.json 2>&1 | grep -E "^ +(512|32768|185000) " | sed "s/^/$2 /"); }
run before s18_1; run . s19_1; run before s18_2; run . s19_2
