python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:src:benchmarks:tests PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/sympy $SP/triton $SP/numpy $SP/jinja2 $SP/networkx $SP/torchvision $SP/timm src /tmp/site >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
export TORCHINDUCTOR_CACHE_DIR=/tmp/ic-tests
CUDAGRAPHS_REQUIRE_CUDA=1 timeout 240 python3 -m pytest -q -x -p no:cacheprovider -m cuda tests/test_decoder_cuda.py > $OUT/pt-decoder.txt 2>&1; tail -3 $OUT/pt-decoder.txt
unset TORCHINDUCTOR_CACHE_DIR
timeout 330 python3 benchmarks/decode_startup.py --batch 16 --max-length 4096 --rows cudagraphs,batch-one --json $OUT/startup.json --markdown $OUT/startup.md 2>&1 | tail -30
