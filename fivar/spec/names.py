"""How user-chosen names become identifiers in generated code, and the names no generated identifier may take.

Generated code never spells a user's name as it is. A param `softcap` is `fvp_softcap` in the CUDA structs, in
FlashInfer's `Params` (the module's `additional_params`) and in the Triton twin's kernel arguments; a local `xor` is
`fvl_xor`. Every identifier fivar derives from a user name starts with `fv` and a namespace tag (`user_ident`), and
fivar's own names (`fv_h0`, `fv_q_offset`, `fv_keep` ...) use the tag `fv_`, which no derived name carries; so a user
name can clash neither with a C macro (`INFINITY`, `errno`), a C++ keyword or alternative token (`xor`, `bitand`), a
FlashInfer field (`window_left`), a Triton launch option (`num_warps`, `grid`), nor with fivar's own names. The
reserved sets below are what `check_rendered` holds every derived identifier against, so a namespace tag that ever
collided would be caught when the code is rendered, not by nvcc.

What a param name still cannot be is a keyword argument fivar's own entry points take (`causal`, `sm_scale`, `dtype`
...: fivar.spec.variant.CALL_KWARGS) or a Python keyword (the spec could not write `params.class`).
"""
from __future__ import annotations

import builtins
import functools
import importlib.util
import keyword
import re
from pathlib import Path

from ..errors import FivarError
from ..flashinfer_layout import FA2_LAYOUT, FA3_LAYOUT

CPP_KEYWORDS = frozenset("""
alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t class compl
concept const consteval constexpr constinit const_cast continue co_await co_return co_yield decltype default delete
do double dynamic_cast else enum explicit export extern false final float for friend goto if import inline int long
module mutable namespace new noexcept not not_eq nullptr operator or or_eq override private protected public register
reinterpret_cast requires restrict return short signed sizeof static static_assert static_cast struct switch template
this thread_local throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t while xor
xor_eq _Bool _Complex _Imaginary
""".split())

#: Macros and reserved library names of the C/C++ and CUDA headers a module includes (cmath, cstdio, cerrno, cfloat,
#: climits, cstdint, cuda_runtime, cuda_fp16/bf16): an identifier spelled like one is rewritten by the preprocessor.
C_MACROS = frozenset("""
NULL EOF errno assert offsetof va_arg va_start va_end va_copy setjmp longjmp stdin stdout stderr BUFSIZ FILENAME_MAX
FOPEN_MAX L_tmpnam SEEK_CUR SEEK_END SEEK_SET TMP_MAX EDOM ERANGE EILSEQ EXIT_SUCCESS EXIT_FAILURE RAND_MAX
MB_CUR_MAX INFINITY NAN HUGE_VAL HUGE_VALF HUGE_VALL FP_NAN FP_INFINITE FP_ZERO FP_SUBNORMAL FP_NORMAL FP_ILOGB0
FP_ILOGBNAN MATH_ERRNO MATH_ERREXCEPT math_errhandling isnan isinf isfinite isnormal signbit fpclassify isgreater
isgreaterequal isless islessequal islessgreater isunordered M_E M_LOG2E M_LOG10E M_LN2 M_LN10 M_PI M_PI_2 M_PI_4
M_1_PI M_2_PI M_2_SQRTPI M_SQRT2 M_SQRT1_2 FLT_MAX FLT_MIN FLT_EPSILON FLT_DIG FLT_MANT_DIG FLT_MAX_EXP FLT_MIN_EXP
FLT_MAX_10_EXP FLT_MIN_10_EXP FLT_RADIX FLT_ROUNDS FLT_TRUE_MIN DBL_MAX DBL_MIN DBL_EPSILON DBL_DIG DBL_MANT_DIG
DBL_MAX_EXP DBL_MIN_EXP DBL_TRUE_MIN LDBL_MAX LDBL_MIN LDBL_EPSILON DECIMAL_DIG CHAR_BIT CHAR_MAX CHAR_MIN SCHAR_MAX
SCHAR_MIN UCHAR_MAX SHRT_MAX SHRT_MIN USHRT_MAX INT_MAX INT_MIN UINT_MAX LONG_MAX LONG_MIN ULONG_MAX LLONG_MAX
LLONG_MIN ULLONG_MAX INT8_MAX INT8_MIN INT16_MAX INT16_MIN INT32_MAX INT32_MIN INT64_MAX INT64_MIN UINT8_MAX
UINT16_MAX UINT32_MAX UINT64_MAX INTPTR_MAX INTPTR_MIN UINTPTR_MAX SIZE_MAX PTRDIFF_MAX PTRDIFF_MIN INT32_C INT64_C
UINT32_C UINT64_C INTMAX_C UINTMAX_C WCHAR_MAX WCHAR_MIN WEOF true false bool unix linux i386 __cplusplus
CUDART_VERSION CUDA_VERSION CUDART_INF_F CUDART_NAN_F __CUDACC__ __CUDA_ARCH__ FIVAR_INLINE
""".split())

#: Names CUDA C++ predefines in device code, and the namespaces generated code reaches into.
CUDA_NAMES = frozenset("""
threadIdx blockIdx blockDim gridDim warpSize dim3 half half2 nv_bfloat16 nv_bfloat162 int2 int4 float2 float4 uint2
uint4 std cute cutlass flashinfer fivar math __syncthreads __device__ __host__ __global__ __shared__ __constant__
__forceinline__ __restrict__ __ldg size_t ptrdiff_t int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t
uint64_t intptr_t uintptr_t
""".split())

#: Keyword arguments a Triton kernel launch takes itself (`kernel[grid](..., num_warps=4)`): a kernel argument named
#: like one is never passed to the kernel.
TRITON_LAUNCH_OPTIONS = frozenset("""
grid warmup num_warps num_ctas num_stages num_buffers_warp_spec num_consumer_groups reg_dec_producer reg_inc_consumer
maxnreg warp_size ptx_version ptx_options ir_override enable_fp_fusion sched4reg enable_reflect_ftz
launch_cooperative_grid launch_pdl clc supported_fp8_dtypes deprecated_fp8_dot_operand_dtypes
default_dot_input_precision allowed_dot_input_precisions max_num_imprecise_acc_default extern_libs debug backend_name
sanitize_overflow arch instrumentation_mode min_shared_mem stream device
""".split())

#: The Triton twin's module-level names (fivar.codegen.triton's template and helpers).
TRITON_MODULE_NAMES = frozenset("tl triton torch os math tle libdevice".split())

#: Namespace tags of identifiers derived from user names (user_ident). fivar's own names use "fv_".
PARAM, LOCAL = "fvp", "fvl"


def size_tag(dim: int) -> str:
    return f"fvsize{dim}"


def stride_tag(dim: int) -> str:
    return f"fvstride{dim}"


_PLAIN = re.compile(r"[A-Za-z0-9]+(?:_[A-Za-z0-9]+)*\Z")


def user_ident(tag: str, name: str) -> str:
    """The identifier generated code uses for the user-chosen `name` in namespace `tag` (PARAM, LOCAL, size_tag(d),
    stride_tag(d)): `tag_name` for a plain ASCII name; otherwise `tagx_` and the name with every character but ASCII
    letters and digits written as `U` and 6 hex digits (so also `U` itself), which keeps the identifier free of
    `__` and leading underscores (reserved in C++) and of non-ASCII characters. Distinct (tag, name) pairs give
    distinct identifiers: the text before the first `_` names the tag, and each encoding is one-to-one."""
    if _PLAIN.match(name):
        return f"{tag}_{name}"
    encoded = "".join(c if c.isascii() and c.isalnum() and c != "U" else f"U{ord(c):06x}" for c in name)
    return f"{tag}x_{encoded}"


def _identifiers(text: str) -> set[str]:
    """Names declared or used unqualified in C++ source."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"|<[\w/.]+\.(?:h|cuh|hpp)>', " ", text)
    text = re.sub(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}", " ", text, flags=re.S)  # jinja: filled in per module
    text = re.sub(r"^\s*#\s*(include|pragma)\b[^\n]*", " ", text, flags=re.M)
    return {m.group(1) for m in re.finditer(r"(?<![\w.>:])(?<!->)([A-Za-z_]\w*)\b(?!\s*::)", text)}


def _flashinfer_csrc() -> Path | None:
    spec = importlib.util.find_spec("flashinfer")  # finds the package without importing it (slow)
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "data" / "csrc"
    return d if d.is_dir() else None


@functools.lru_cache(maxsize=1)
def flashinfer_names() -> frozenset[str]:
    """Names FlashInfer's files that a module's params go into declare or use (the `Params` structs' configs and the
    host sources whose run functions take them: fivar.flashinfer_layout), read off the installed FlashInfer."""
    fi = _flashinfer_csrc()
    layouts = [*FA2_LAYOUT.values(), *FA3_LAYOUT.values()]
    names_ = [config for config, _, _, _ in layouts] + [h for _, _, host, _ in layouts for h in host]
    found: set[str] = set()
    for n in dict.fromkeys(names_):
        try:
            found |= _identifiers((fi / n).read_text()) if fi is not None else set()
        except OSError:
            continue
    return frozenset(found)


#: The reserved identifiers of each language fivar emits, by its name: CUDA C++ (FA2, FA3) and Triton's Python.
_RESERVED = {
    "cuda": lambda: CPP_KEYWORDS | C_MACROS | CUDA_NAMES | flashinfer_names(),
    "triton": lambda: (frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(dir(builtins))
                       | TRITON_LAUNCH_OPTIONS | TRITON_MODULE_NAMES),
}


def reserved(language: str) -> frozenset[str]:
    """Identifiers no name derived from a user's may be in `language` ("cuda" or "triton")."""
    if language not in _RESERVED:
        raise ValueError(language)
    return _RESERVED[language]()


def is_reserved_cpp_spelling(ident: str) -> bool:
    """C++ reserves every identifier with `__` and every one starting with `_` and an uppercase letter."""
    return "__" in ident or re.match(r"_[A-Z]", ident) is not None


def check_rendered(language: str, idents, variant_name: str) -> None:
    """Raise if an identifier derived from a user name is reserved in `language`: a fivar bug, never the user's."""
    bad = sorted(i for i in idents if i in reserved(language) or not i.isascii() or not i.isidentifier()
                 or keyword.iskeyword(i) or (language == "cuda" and is_reserved_cpp_spelling(i)))
    if bad:
        raise FivarError(f"variant '{variant_name}': fivar rendered the reserved {language} identifier(s) "
                         f"{', '.join(bad)} from user names (a fivar bug: please report it)")


def why_param_name_is_taken(name: str, call_kwargs=()) -> str | None:
    """Why `name` cannot be a param, or None when it can: it must be writable as `params.NAME` in the spec and as a
    keyword argument of fivar's entry points, so neither a Python keyword nor one of their own arguments."""
    if keyword.iskeyword(name):
        return "it is a Python keyword (the spec could not write params." + name + ")"
    if name in call_kwargs:
        return "fivar's entry points take a keyword argument of that name (prefill(..., " + name + "=...))"
    return None


_COMMENT_SAFE = re.compile(r"[ -\[\]-~]")  # printable ASCII but the backslash


def comment_text(text) -> str:
    """`text` (a file name, a variant name, a docstring line) made safe inside a one-line `//` or `#` comment: every
    character but printable ASCII (line breaks, a backslash that would splice the next line in C++, NUL, non-ASCII)
    is written as an escape without a backslash (`<U+000a>`)."""
    return "".join(c if _COMMENT_SAFE.match(c) else f"<U+{ord(c):04x}>" for c in str(text))
