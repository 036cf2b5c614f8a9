# sourced at the start of every device call: env, our wheels in /tmp/site, the hearth_llm namespace in /tmp/hsrc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0
for w in .whl .whl-light; do
  if [ -d $w ] && [ ! -f /tmp/site/.ok-$w ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $w/*.whl && touch /tmp/site/.ok-$w
  fi
done
mkdir -p /tmp/hsrc/hearth_llm
[ -f /tmp/hsrc/hearth_llm/__init__.py ] || touch /tmp/hsrc/hearth_llm/__init__.py
for d in engine kernels embeddings integrations benchmarks cli server; do
  [ -d $PWD/$d ] && ln -sfn $PWD/$d /tmp/hsrc/hearth_llm/$d
done
export PYTHONPATH=/tmp/hsrc:/tmp/site:$PWD
