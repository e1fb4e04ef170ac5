# Sourced by the bench/gpu_s*.sh scripts on the device machine (carry [".whl"]): the wheels
# its image lacks into /tmp/site, this checkout and them on PYTHONPATH, and the card's name.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
