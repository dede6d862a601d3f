"""`fivar.FusionVariant`: a fusion declaration (fivar.fusion.spec) you can call.

The declaration sits at the bottom of the fusion layers and knows nothing of kernels; this subclass sits at
the top and adds the calls, so the layers in between (args, reference, build, runtime) only import downward.
"""
from __future__ import annotations

from . import reference as _reference
from . import runtime as _runtime
from .spec import FusionSpec


class FusionVariant(FusionSpec):
    """A fused norm / residual / RoPE / FP8 kernel; its fields and their meaning: fivar.fusion.spec."""

    def __call__(self, **kwargs):
        """Validate the arguments (fivar.fusion.args), build the kernel if needed, launch it; the outputs."""
        return _runtime.run(self, **kwargs)

    def run(self, **kwargs):
        return _runtime.run(self, **kwargs)

    def bind(self, **kwargs):
        """Validate once; a zero-argument callable that launches on these tensors (hot loops, graphs)."""
        return _runtime.bind(self, **kwargs)

    def reference(self, **kwargs):
        """The torch reference (fp32 math on the unfused ops); same arguments as a call, never in place."""
        return _reference.reference(self, **kwargs)
