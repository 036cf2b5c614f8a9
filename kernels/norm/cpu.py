"""CPU: RMSNorm and LayerNorm through torch's one fused norm kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cpu_step_native
from . import reference

# Rows up to which the C kernel (one thread) takes a 2-D norm; more go to torch's kernel, which may use
# every thread.
MAX_NATIVE_ROWS = 64


def rms_norm(x, weight, eps, residual=None):
    """As :func:`reference.rms_norm`: a few contiguous rows in one C pass (``cpu_step_native``), else
    through torch's one fused norm kernel.

    ``F.rms_norm`` is several ops on the CPU (and slow in bf16); ``F.layer_norm`` is one. Over
    ``[x, -x]`` the mean is zero and the variance is ``mean(x**2)``, so layer norm of that, cut back
    to its first half, is the RMS norm of ``x``.
    """
    if (x.dim() == 2 and x.shape[0] <= MAX_NATIVE_ROWS and cpu_step_native.supports_rms_norm(x, weight, residual)
            and cpu_step_native.available()):
        return cpu_step_native.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
    size = x.shape[-1]
    normed = F.layer_norm(torch.cat((x, x.neg()), dim=-1), (2 * size,), None, None, eps)[..., :size]
    return normed * weight, x


def layer_norm(x, weight, bias, eps, residual=None):
    """As :func:`reference.layer_norm`, in torch's one fused kernel (float32 inside, as the reference)."""
    if residual is not None:
        x = x + residual
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return reference.layer_norm(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps), x


# torch's argmax and topk scan a row element by element; amax is vectorized and ~20x faster. Over
# a vocabulary-wide row it pays to find the best chunks with amax first and search only those.
