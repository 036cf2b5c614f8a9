#!/usr/bin/env python3
"""Is Mixtral's bf16 divergence from HF a routing near-tie? Compare HF bf16 against HF bf16 whose router
matmul runs in fp32 (a perturbation as small as kernel rounding): if HF disagrees with itself outside
its own top-5, the top-5 rule cannot hold for this shape in bf16, whatever the engine does."""
import sys; sys.path.insert(0, "tests")
import torch, torch.nn.functional as F
import test_gpu_engine as gpu, test_gpu_models_moe as moe
from transformers.models.mixtral import modeling_mixtral as mm

for shape in ("mixtral-8x7b", "qwen3-30b-a3b"):
    model, batch, requests = moe.run_ours(shape, torch.bfloat16, 5)
    with torch.no_grad():
        hf = [gpu.hf_generate(model, p) for p in batch]
    router_cls = mm.MixtralTopKRouter if shape.startswith("mixtral") else None
    if router_cls is None:
        from transformers.models.qwen3_moe import modeling_qwen3_moe as qm
        router_cls = qm.Qwen3MoeTopKRouter if hasattr(qm, "Qwen3MoeTopKRouter") else None
    orig = router_cls.forward if router_cls else None
    def forward_fp32(self, hidden_states, _orig=orig):
        w = self.weight
        self.weight.data = w.data.float()
        try:
            out = _orig(self, hidden_states.float())
        finally:
            self.weight.data = w.data.to(torch.bfloat16)
        return tuple(o.to(torch.bfloat16) if torch.is_tensor(o) and o.is_floating_point() and i == 0 else o
                     for i, o in enumerate(out))
    if router_cls:
        router_cls.forward = forward_fp32
        with torch.no_grad():
            hf32r = [gpu.hf_generate(model, p) for p in batch]
        router_cls.forward = orig
    else:
        hf32r = hf
    def first_div(a, a_tops, b, b_tops):
        for step, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return step, x in b_tops[step], y in a_tops[step]
        return None
    for i, (r, (h, htops), (h2, h2tops)) in enumerate(zip(requests, hf, hf32r)):
        ours_tops = [set(e) for e in r.logprobs]
        print(shape, "prompt", i, "ours-vs-hf", first_div(r.output_token_ids, ours_tops, h, htops),
              "hf-vs-hf(router fp32)", first_div(h, htops, h2, h2tops), flush=True)
    del model; torch.cuda.empty_cache()
