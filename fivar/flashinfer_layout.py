"""Which FlashInfer sources make each JIT module: per op, the config template, the kernel-instantiation templates,
the host sources and the name they include the config as. fivar.jit.build renders and compiles them; fivar.spec.names
reads the same files for the names a user's params may not take. Imports nothing, so both can use it."""

#: Per op: FlashInfer's config template, kernel-instantiation templates (rendered per mask mode unless
#: the op has none), host sources, and the name the host sources include the config as.
FA2_LAYOUT = {
    "single_prefill": ("single_prefill_customize_config.jinja", ["single_prefill_kernel_inst.jinja"],
                       ["single_prefill.cu", "single_prefill_jit_binding.cu"], "single_prefill_config.inc"),
    "batch_prefill": ("batch_prefill_customize_config.jinja",
                      ["batch_prefill_paged_kernel_inst.jinja", "batch_prefill_ragged_kernel_inst.jinja"],
                      ["batch_prefill.cu", "batch_prefill_jit_binding.cu", "batch_prefill_paged.cuh"],
                      "batch_prefill_config.inc"),
    "batch_decode": ("batch_decode_customize_config.jinja", ["batch_decode_kernel_inst.jinja"],
                     ["batch_decode.cu", "batch_decode_jit_binding.cu"], "batch_decode_config.inc"),
}

#: FA3 (Hopper): single and batch prefill only; decode stays on FA2's decode kernel (FlashInfer has no FA3 one).
FA3_LAYOUT = {
    "single_prefill": ("single_prefill_sm90_customize_config.jinja", ["single_prefill_sm90_kernel_inst.jinja"],
                       ["single_prefill_sm90.cu", "single_prefill_sm90_jit_binding.cu"],
                       "single_prefill_sm90_config.inc"),
    "batch_prefill": ("batch_prefill_sm90_customize_config.jinja",
                      ["batch_prefill_paged_sm90_kernel_inst.jinja", "batch_prefill_ragged_sm90_kernel_inst.jinja"],
                      ["batch_prefill_sm90.cu", "batch_prefill_sm90_jit_binding.cu"], "batch_prefill_sm90_config.inc"),
}
