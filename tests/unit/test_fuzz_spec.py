"""Fuzzing the spec-to-code path over names and constants.

Each generated spec draws its argument, local and param names from the names most likely to break generated code (C
macros, C++ keywords and alternative tokens, FlashInfer's own fields, Triton launch options, Python builtins, fivar's
own names, reserved spellings such as `__x`, non-ASCII), its constants from either side of the int32/float32 ranges,
its Scalar defaults from NaN/inf/out-of-range values, its file name and docstring from text that could break out of a
comment, and sometimes nests too deep. Every spec must end in one of two ways:

* a FivarSpecError naming file:line (and it must, where the generator planted something that cannot be accepted);
* or every target renders it with user names only through fivar's mangling (the rendering is the same, comments
  aside, as that of the same spec with plain names and a plain file name), the Triton module is valid Python, and
  the real FA2 and FA3 variant structs compile together in one translation unit (g++ on the host with stand-ins for
  FlashInfer's hook macros; nvcc in the `nvcc` test), where FA2's logits and mask match the torch reference.

A few accepted specs also run their Triton twin under the interpreter against the reference.
"""
from __future__ import annotations

import io
import keyword
import linecache
import math
import os
import random
import re
import shutil
import subprocess
import tokenize
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fivar
from fivar import FivarSpecError
from fivar.codegen import fa2, fa3
from fivar.codegen.cuda import additional_args
from fivar.codegen.torch_ref import TorchEvaluator
from fivar.codegen.triton import render_attention
from fivar.paths import csrc_dir
from fivar.spec import names
from fivar.spec.parse import MAX_DEPTH
from fivar.spec.variant import CALL_KWARGS

NASTY = sorted({
    "INFINITY", "NAN", "errno", "NULL", "EOF", "M_PI", "FLT_MAX", "INT_MAX", "HUGE_VAL", "stdin", "isnan",
    "xor", "bitand", "and_eq", "compl", "decltype", "nullptr", "static_cast", "auto", "int", "float", "bool", "const",
    "signed", "template", "this", "new", "delete", "register", "char", "double", "long", "short", "virtual", "typename",
    "grid", "num_warps", "num_stages", "num_ctas", "maxnreg", "warmup", "stream", "debug",
    "window_left", "o", "lse", "kv_len", "qo_len", "logits", "params", "batch_idx", "qo_idx", "kv_idx", "smem_ptr",
    "sm_scale_log2", "output", "half", "int32_t", "threadIdx", "std", "flashinfer", "fivar", "math", "tl", "triton",
    "qk", "acc", "keep", "Q", "K", "V", "Out", "offs_m", "alpha", "m_i", "BLOCK_M", "HEAD_DIM", "LOG2E", "_tanh",
    "fv_h0", "h0", "fv_keep", "fv_q_offset", "fv_batch", "fvp_x", "fvl_x", "fvpx_U", "fvsize0_x", "maybe_x", "U",
    "abs", "min", "max", "len", "range", "print", "sum", "type", "object", "self",
    "_x", "__x", "x__y", "_X", "a_", "\u03b1", "\u00e9t\u00e9", "x1", "score", "batch", "q_idx",
})
PYTHON_KEYWORDS = ["assert", "class", "lambda", "None", "True", "def", "import", "await"]
ARG_ROLES = ("score", "batch", "qo_head", "kv_head", "q_idx", "kv_idx", "params")
INDEX_ROLES = ARG_ROLES[1:6]
TABLE_LEN = 7
FUNCS = "tanh exp exp2 log sigmoid sqrt abs floor minimum maximum clamp where"
BAD_INTS = ["3000000000", "2147483648", "-2147483649", "(10**40)"]
BAD_FLOATS = ["1e39", "-3.5e38", "(10.0**39)"]
BAD_DEFAULTS = {"float": ["float('nan')", "float('inf')", "-float('inf')", "1e39"],
                "int": ["2**40", "-2**31 - 1", "3000000000"]}
WEIRD_FILES = ["fz\n#include <cstdlib>\nint boom = 1; //{i}.py", "fz\\{i}.py", "fz*/\r{i}.py", "fz\u2028{i}\u00e9.py",
               "fz\"{i}'.py", "fz\udc80{i}.py"]
WEIRD_DOCS = ["doc\nint boom = 1;", "doc \\", "doc\r\nimport os", "doc \u2028 */ \x0b\x00 end", "plain doc"]


@dataclass
class Spec:
    index: int
    template: str  # module source with @A0@.. (arguments), @L0@.. (locals), @P0@.. (params) for names
    n_locals: dict  # role -> count of locals ("logits"/"mask")
    params: list  # (kind, default text) per param
    must_fail: list = field(default_factory=list)  # why the generator expects a FivarSpecError


# --- a generator of specs --------------------------------------------------------------------------------------------
class Gen:
    def __init__(self, r: random.Random):
        self.r = r
        self.must_fail: list[str] = []
        self.globals: list[str] = []

    def int_const(self) -> str:
        r = self.r
        x = r.random()
        if x < 0.015:
            self.must_fail.append("int constant beyond int32")
            text = r.choice(BAD_INTS)
            if r.random() < 0.5:  # through a global, as fivar reads numbers defined outside the function
                self.globals.append(f"G{len(self.globals)} = {text}")
                return f"G{len(self.globals) - 1}"
            return text
        return str(r.randint(-5, 5))

    def float_const(self) -> str:
        r = self.r
        if r.random() < 0.015:
            self.must_fail.append("float constant beyond float32")
            text = r.choice(BAD_FLOATS)
            if "**" in text or r.random() < 0.5:
                self.globals.append(f"G{len(self.globals)} = {text}")
                return f"G{len(self.globals) - 1}"
            return text
        return f"{r.uniform(-3, 3):.3f}"

    def f(self, env, d: int) -> str:
        r = self.r
        if d <= 0 or r.random() < 0.25:
            return r.choice([lambda: env["score"], lambda: env["score"], self.float_const,
                             lambda: f"float({self.i(env, 0)})"]
                            + [lambda n=n: n for n in env["f_locals"] + env["f_params"]])()
        f = lambda: self.f(env, d - 1)  # noqa: E731
        i = lambda: self.i(env, d - 1)  # noqa: E731
        return r.choice([
            lambda: f"({f()} + {f()})", lambda: f"({f()} - {f()})", lambda: f"({f()} * {f()})",
            lambda: f"({f()} / (abs({f()}) + 1.0))", lambda: f"tanh({f()})", lambda: f"sigmoid({f()})",
            lambda: f"exp(clamp({f()}, -8.0, 8.0))", lambda: f"log(abs({f()}) + 1.0)", lambda: f"sqrt(abs({f()}))",
            lambda: f"floor({f()})", lambda: f"minimum({f()}, {f()})", lambda: f"maximum({f()}, {f()})",
            lambda: f"(-{f()})", lambda: f"({f()} if {self.b(env, d - 1)} else {f()})", lambda: f"float({i()})",
        ] + ([lambda: f"{env['params']}.{r.choice(env['t_params'])}[clamp({i()}, 0, {TABLE_LEN - 1})]"]
             if env["t_params"] else []))()

    def i(self, env, d: int) -> str:
        r = self.r
        if d <= 0 or r.random() < 0.3:
            return r.choice([lambda n=n: n for n in [env[k] for k in INDEX_ROLES] + env["i_locals"] + env["i_params"]]
                            + [self.int_const])()
        i = lambda: self.i(env, d - 1)  # noqa: E731
        return r.choice([
            lambda: f"({i()} + {i()})", lambda: f"({i()} - {i()})", lambda: f"({i()} * {r.randint(-3, 3)})",
            lambda: f"({i()} // {r.choice([-3, 2, 5])})", lambda: f"({i()} % {r.choice([-4, 3, 7])})",
            lambda: f"({i()} // (abs({i()}) + 1))", lambda: f"abs({i()})", lambda: f"minimum({i()}, {i()})",
            lambda: f"int(clamp({self.f(env, d - 1)}, -50.0, 50.0))",
        ])()

    def b(self, env, d: int) -> str:
        r = self.r
        d = max(d, 0)
        return r.choice([
            lambda: f"({self.i(env, d)} < {self.i(env, d)})", lambda: f"({self.i(env, d)} != {self.i(env, d)})",
            lambda: f"({self.f(env, d)} <= {self.f(env, d)})", lambda: f"({self.i(env, 0)} >= {self.i(env, 0)})",
            lambda: f"(not ({self.i(env, 0)} == {self.i(env, 0)}))",
        ])()


def gen_spec(r: random.Random, index: int) -> Spec:
    g = Gen(r)
    params = []
    n_params = r.randint(0, 3)
    for k in range(n_params):
        kind = r.choice(["float", "float", "int", "tensor"])
        default = None
        if kind != "tensor":
            if r.random() < 0.05:
                default = r.choice(BAD_DEFAULTS[kind])
                g.must_fail.append("bad Scalar default")
            else:
                default = f"{r.uniform(-2, 2):.3f}" if kind == "float" else str(r.randint(1, 5))
        params.append((kind, default))
    body_lines, n_locals, n_all = {}, {}, 0
    roles = r.choice([("logits",), ("logits",), ("mask",), ("logits", "mask")])
    for role in roles:
        env = {name: f"@A{k}@" for k, name in enumerate(ARG_ROLES)}
        p = env["params"]
        env["f_params"] = [f"{p}.@P{k}@" for k, (kind, _) in enumerate(params) if kind == "float"]
        env["i_params"] = [f"{p}.@P{k}@" for k, (kind, _) in enumerate(params) if kind == "int"]
        env["t_params"] = [f"@P{k}@" for k, (kind, _) in enumerate(params) if kind == "tensor"]
        env["f_locals"], env["i_locals"] = [], []
        if role == "mask":  # no score argument
            env["score"] = f"float({env['q_idx']})"
        lines = []
        n = r.randint(0, 3)
        for _ in range(n):
            as_int = r.random() < 0.3
            name = f"@L{n_all}@"
            n_all += 1
            lines.append(f"    {name} = {g.i(env, r.randint(0, 3)) if as_int else g.f(env, r.randint(0, 3))}")
            env["i_locals" if as_int else "f_locals"].append(name)
        n_locals[role] = n
        if r.random() < 0.02:  # beyond the nesting fivar takes
            g.must_fail.append("too deep")
            deep = env["score"]
            for _ in range(MAX_DEPTH + 5):
                deep = f"tanh({deep})"
            result = deep if role == "logits" else f"({deep} > 0.0)"
        else:
            result = g.f(env, r.randint(1, 4)) if role == "logits" else g.b(env, r.randint(1, 3))
        lines.append(f"    return {result}")
        args = ", ".join(f"@A{k}@" for k in range(len(ARG_ROLES)) if role == "logits" or k)
        body_lines[role] = f"def {role}({args}):\n" + "\n".join(lines) + "\n"
    decls = ", ".join(
        f"'@P{k}@': " + (f"Tensor('float32', ('n',))" if kind == "tensor" else
                         f"Scalar({kind}, default={default})") for k, (kind, default) in enumerate(params))
    softmax = r.random() < 0.85
    fns = ", ".join(f"{role}={role}" for role in roles)
    src = (f"from fivar import AttentionVariant, Scalar, Tensor, {', '.join(FUNCS.split())}\n"
           + "".join(line + "\n" for line in g.globals) + "DOC = @DOC@\n\n" + "\n".join(body_lines.values())
           + f"\nvariant = AttentionVariant(name='fz{index}', {fns}, softmax={softmax}, doc=DOC, params={{{decls}}})\n")
    return Spec(index, src, n_locals, params, g.must_fail)


def pick_names(r: random.Random, spec: Spec) -> dict:
    """Names for the placeholders: distinct within each role; sometimes a name fivar must refuse for a param."""
    names_ = {}
    arg_pool = [n for n in NASTY if n not in FUNCS.split()]
    for k, n in enumerate(r.sample(arg_pool, len(ARG_ROLES))):
        names_[f"@A{k}@"] = n
    n_locals = sum(spec.n_locals.values())
    taken = set(names_.values())
    for k, n in enumerate(r.sample([n for n in NASTY if n not in taken], n_locals)):
        names_[f"@L{k}@"] = n
    pool = NASTY + (sorted(CALL_KWARGS) + PYTHON_KEYWORDS if r.random() < 0.1 else [])
    for k, n in enumerate(r.sample(pool, len(spec.params))):
        names_[f"@P{k}@"] = n
    return names_


def plain_names(spec: Spec) -> dict:
    out = {f"@A{k}@": f"zarg{k}" for k in range(len(ARG_ROLES))}
    out.update({f"@L{k}@": f"zloc{k}" for k in range(sum(spec.n_locals.values()))})
    out.update({f"@P{k}@": f"zpar{k}" for k in range(len(spec.params))})
    return out


def fill(spec: Spec, names_: dict, doc: str) -> str:
    return re.sub(r"@[ALP]\d+@|@DOC@", lambda m: repr(doc) if m.group(0) == "@DOC@" else names_[m.group(0)],
                  spec.template)


def load(src: str, filename: str):
    """The variant of module text `src` as if read from `filename` (inspect finds its source through linecache)."""
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns: dict = {"__name__": "fuzz_spec"}
    try:
        code = compile(src, filename, "exec")
    except SyntaxError as e:  # params.None: what fivar.load says of a variant file Python cannot read
        raise FivarSpecError(f"syntax error: {e.msg}", filename=filename, line=e.lineno, col=0) from None
    exec(code, ns)
    return ns["variant"]


@dataclass
class Outcome:
    spec: Spec
    variant: object = None
    error: FivarSpecError | None = None
    renders: dict = field(default_factory=dict)


def render_all(v) -> dict:
    return {"fa2": fa2.variant_decl(v).source, "fa3": fa3.variant_decl(v, exp2_emulated_of_8=0).source,
            "triton": render_attention(v)}


# A Python comment, or a string literal kept whole (a '#' or a quote inside one is not code). For a rendering that
# compiles, the comments it finds are tokenize's COMMENT tokens
# (test_the_comments_code_only_drops_are_pythons_comment_tokens), in a twentieth of tokenize's time, which was most
# of a fuzzed spec's.
_PY_STRINGS = (r"'''(?:[^'\\]|\\.|'(?!''))*'''", r'"""(?:[^"\\]|\\.|"(?!""))*"""', r"'(?:[^'\\\n]|\\.)*'",
               r'"(?:[^"\\\n]|\\.)*"')
_PY_COMMENT_OR_STRING = re.compile(r"(#[^\r\n]*)|(?:" + "|".join(_PY_STRINGS) + ")", re.S)


def _python_comments(text: str) -> tuple[str, list[str]]:
    """`text` without its comments, and the comments."""
    found = []

    def drop(m):
        if m.group(1) is None:
            return m.group(0)
        found.append(m.group(1))
        return ""
    return _PY_COMMENT_OR_STRING.sub(drop, text), found


def _code_only(target: str, text: str) -> str:
    """The code of a rendering: comments and blank lines dropped (a docstring of more lines has more comment lines)."""
    if target == "triton":
        text = _python_comments(text)[0]
    else:
        text = re.sub(r"//[^\n]*", "", text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


def _canonical(text: str, names_: dict) -> str:
    """`text` with each identifier derived from a placeholder's name written as the placeholder."""
    table = {}
    for ph, n in names_.items():
        tags = {"L": (names.LOCAL,), "P": (names.PARAM, names.size_tag(0), names.stride_tag(0))}.get(ph[1], ())
        for tag in tags:
            table[names.user_ident(tag, n)] = f"{tag}_{ph.strip('@')}"
    return re.sub(r"\b(fv\w+)", lambda m: table.get(m.group(1), m.group(1)), text)


def run_spec(r: random.Random, index: int) -> Outcome:
    spec = gen_spec(r, index)
    names_ = pick_names(r, spec)
    filename = r.choice(WEIRD_FILES).format(i=index) if r.random() < 0.3 else f"fz{index}.py"
    doc = r.choice(WEIRD_DOCS)
    src = fill(spec, names_, doc)
    out = Outcome(spec)
    bad_param = [n for k, n in names_.items() if k.startswith("@P") and (n in CALL_KWARGS or keyword.iskeyword(n))]
    try:
        out.variant = v = load(src, filename)
        v.ir, v.lowered  # noqa: B018 - parse and lower
    except FivarSpecError as e:
        assert e.filename and e.line, f"spec error without file:line: {e}\n{src}"
        out.error = e
        return out
    assert not spec.must_fail and not bad_param, f"accepted although {spec.must_fail or bad_param}:\n{src}"
    out.renders = render_all(v)
    compile(out.renders["triton"], f"<triton {index}>", "exec")  # valid Python, comments and all
    # the same spec with plain names and a plain file name renders the same code, comments aside
    plain = plain_names(spec)
    twin = render_all(load(fill(spec, plain, "plain doc"), f"fz{index}.py"))
    for target, text in out.renders.items():
        code = _code_only(target, text)
        assert _canonical(code, names_) == _canonical(_code_only(target, twin[target]), plain), \
            f"{target} rendering depends on the names or the file name beyond the mangled identifiers:\n{src}"
        derived = set(re.findall(r"\bfv(?:p|l|size\d+|stride\d+)x?_\w*", code))
        names.check_rendered("cuda" if target != "triton" else "triton", derived, v.name)
    return out


# --- the host harness: real FA2/FA3 structs in one translation unit ----------------------------------------------------
PRELUDE = r"""
#include <cerrno>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include "fivar_ops.cuh"
#ifndef __CUDACC__
#define __device__
#define __host__
#define __forceinline__ inline
#endif
#define FV_HOOK __device__ __host__ __forceinline__
#define REGISTER_LOGITS_TRANSFORM(params, logits, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, ...) \
  template <typename Params, typename T> FV_HOOK T LogitsTransform(const Params& params, T logits, \
      uint32_t batch_idx, uint32_t qo_idx, uint32_t kv_idx, uint32_t qo_head_idx, uint32_t kv_head_idx) { __VA_ARGS__ }
#define REGISTER_LOGITS_MASK(params, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, ...) \
  template <typename Params> FV_HOOK bool LogitsMask(const Params& params, uint32_t batch_idx, uint32_t qo_idx, \
      uint32_t kv_idx, uint32_t qo_head_idx, uint32_t kv_head_idx) { __VA_ARGS__ }
#define REGISTER_OUTPUT_TRANSFORM(params, output, batch_idx, qo_idx, qo_head_idx, m, d, scale, ...) \
  template <typename Params, typename T, typename T_M> FV_HOOK T OutputTransform(const Params& params, T output, \
      uint32_t batch_idx, uint32_t qo_idx, uint32_t qo_head_idx, T_M& m, float& d, float scale) { __VA_ARGS__ }
namespace flashinfer {
namespace math { constexpr float log2e = 1.44269504088896340736f; }
struct AttentionVariantBase {};
template <int N, bool S = false> struct OnlineSoftmax { __device__ __host__ explicit OnlineSoftmax(float) {} };
template <int N> struct DefaultUpdater {};
}  // namespace flashinfer
#ifdef __CUDACC__
#define FV_DATA __device__
#else
#define FV_DATA
#endif
struct Pt { float raw; uint32_t b, h, kh, qo, kv, qo_len, kv_len; };
struct Coord { uint32_t q_tile, qo_head, kv_head, qo_indptr, kv_indptr, qo_len, kv_len, batch; };
static FV_DATA float fv_table[%d] = {%s};
"""

CASE = r"""
namespace case{k} {{
{fa2}
{fa3}
struct Params {{
  {decl}
  uint32_t qo_len_, kv_len_;
  int32_t window_left = -1;  // FlashInfer's Params field the FA2 struct reads (no window here)
  __device__ __host__ uint32_t get_qo_len(uint32_t) const {{ return qo_len_; }}
  __device__ __host__ uint32_t get_kv_len(uint32_t) const {{ return kv_len_; }}
}};
struct Fa3Params {{ Params additional_params; }};
__device__ __host__ inline void run(const Pt& x, float* out) {{
  Params params{{}};
  {init}
  params.qo_len_ = x.qo_len; params.kv_len_ = x.kv_len;
  Fa3Params fa3_params{{params}};
  {struct_name} v(params, x.b, nullptr);
  out[0] = {logits};
  out[1] = {mask};
  fa3::{struct_name} w(fa3_params, Coord{{0u, x.h, x.kh, 0u, 0u, x.qo_len, x.kv_len, x.b}});
  out[2] = w.LogitsTransform(fa3_params, x.raw, x.b, x.qo, x.kv, x.h, x.kh);
}}
}}  // namespace case{k}
"""


def harness_case(k: int, v, values: dict) -> str:
    args = additional_args(v, with_causal_flag=bool(v.mask))
    decl = " ".join(f"{a.ctype}{'*' if a.source == 'tensor' else ''} {a.name};" for a in args)
    init = []
    for a in args:
        value = {"sm_scale": repr(values["sm_scale"]), "causal": "0", "tensor": "fv_table", "size": str(TABLE_LEN),
                 "scalar": repr(values.get(a.param))}[a.source]
        init.append(f"params.{a.name} = {value};")
    logits = (f"v.LogitsTransform(params, x.raw, x.b, x.qo, x.kv, x.h, x.kh) * (v.sm_scale_log2 / "
              "flashinfer::math::log2e)" if v.softmax else
              "v.LogitsTransform(params, x.raw, x.b, x.qo, x.kv, x.h, x.kh)") if v.logits else "0.f"
    mask = "float(v.LogitsMask(params, x.b, x.qo, x.kv, x.h, x.kh))" if v.mask else "1.f"
    fa3_src = fa3.variant_decl(v, exp2_emulated_of_8=0).source.replace('#include "fivar_ops.cuh"', "")
    return CASE.format(k=k, fa2=fa2.variant_decl(v).source.replace('#include "fivar_ops.cuh"', ""),
                       fa3="namespace fa3 {\n" + fa3_src + "\n}", decl=decl, init="\n  ".join(init),
                       struct_name=fa2.struct_name(v), logits=logits, mask=mask)


def harness(cases: list, points: list, table: list, device: bool) -> str:
    pts = ", ".join("{%sf, %du, %du, %du, %du, %du, %du, %du}" % (repr(p["raw"]), p["b"], p["h"], p["kh"], p["qo"],
                                                                 p["kv"], p["qo_len"], p["kv_len"]) for p in points)
    src = PRELUDE % (TABLE_LEN, ", ".join(f"{x!r}f" for x in table)) + "".join(cases)
    src += f"static FV_DATA const Pt fv_points[{len(points)}] = {{{pts}}};\n"
    if device:
        src += "__global__ void fv_all(float* out) {\n  const Pt& x = fv_points[threadIdx.x];\n"
        src += "".join(f"  case{k}::run(x, out + 3 * {k});\n" for k in range(len(cases))) + "}\n"
    else:
        src += "int main() {\n  float out[3];\n  for (int m = 0; m < %d; ++m) {\n" % len(points)
        src += "".join(f"    case{k}::run(fv_points[m], out); std::printf(\"{k} %d %.9g %.9g %.9g\\n\", m, out[0], "
                       "out[1], out[2]);\n" for k in range(len(cases)))
        src += "  }\n  return 0;\n}\n"
    return src


def reference(v, values: dict, pt: dict, table: list, dt) -> tuple[float, float]:
    qi = pt["qo"] + pt["kv_len"] - pt["qo_len"]
    env = {"score": torch.tensor(pt["raw"] * values["sm_scale"], dtype=dt), "sm_scale": values["sm_scale"],
           "batch": torch.tensor(pt["b"]), "qo_head": torch.tensor(pt["h"]), "kv_head": torch.tensor(pt["kh"]),
           "q_idx": torch.tensor(qi), "kv_idx": torch.tensor(pt["kv"])}
    params = {n: (torch.tensor(table, dtype=dt) if n in v.tensor_params else values[n]) for n in v.params}
    logits = float(TorchEvaluator(env, params, dt).run(v.ir.logits)) if v.logits else 0.0
    mask = float(bool(TorchEvaluator(env, params, dt).run(v.ir.mask))) if v.mask else 1.0
    return logits, mask


def _close(got: float, want: float) -> bool:
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    return abs(got - want) <= 2e-3 * max(1.0, abs(want))


def fuzz(seed: int, n_specs: int, tmp_path, nvcc: bool = False) -> dict:
    """Generate, check and compile `n_specs` specs; returns the figures."""
    r = random.Random(seed)
    outcomes = [run_spec(r, seed % 100000 * 10000 + i) for i in range(n_specs)]
    accepted = [o for o in outcomes if o.variant is not None and o.error is None]
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    table = [f32(r.uniform(-2, 2)) for _ in range(TABLE_LEN)]
    points = []
    for _ in range(4):
        qo_len = r.randint(1, 40)
        kv_len = r.randint(qo_len, 80)
        points.append(dict(raw=f32(r.uniform(-6, 6)), b=r.randint(0, 3), h=r.randint(0, 15), kh=r.randint(0, 3),
                           qo=r.randint(0, qo_len - 1), kv=r.randint(0, kv_len - 1), qo_len=qo_len, kv_len=kv_len))
    values = []
    for o in accepted:
        val = {"sm_scale": f32(r.choice([1.0, 0.125, 0.0883883]))}
        for n, p in o.variant.scalar_params.items():
            val[n] = f32(r.uniform(-2, 2)) if p.dtype is float else r.randint(1, 5)
        values.append(val)
    cases = [harness_case(k, o.variant, val) for k, (o, val) in enumerate(zip(accepted, values))]
    d = tmp_path
    (d / "fuzz.cpp").write_text(harness(cases, points, table, device=False))
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-w", "-I", str(csrc_dir()), "-o", str(d / "fuzz"),
                            str(d / "fuzz.cpp")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[:4000]
    run = subprocess.run([str(d / "fuzz")], check=True, capture_output=True, text=True)
    compared = 0
    for line in run.stdout.splitlines():
        k, m, logit, mask, _ = line.split()
        o, val, pt = accepted[int(k)], values[int(k)], points[int(m)]
        want = {dt: reference(o.variant, val, pt, table, dt) for dt in (torch.float64, torch.float32)}
        assert _close(float(mask), want[torch.float32][1]), f"FA2 mask differs:\n{o.spec.template}"
        # float32 next to a jump (floor, a comparison) may land on either side of float64: match either
        assert any(_close(float(logit), w[0]) for w in want.values()), \
            f"FA2 logits differ: {logit} vs {want}\n{cases[int(k)]}"
        compared += 1
    if nvcc:
        (d / "fuzz.cu").write_text(harness(cases, points, table, device=True))
        cmd = [NVCC, "-std=c++17", "-arch=sm_90a", "-c", "-w", "-I", str(csrc_dir()), "-o", str(d / "fuzz.o"),
               str(d / "fuzz.cu")]
        build = subprocess.run(cmd, capture_output=True, text=True)
        assert build.returncode == 0, build.stderr[:4000]
    refused = [o for o in outcomes if o.error is not None]
    fuzz.accepted = accepted  # for the Triton check
    return {"specs": n_specs, "refused": len(refused), "accepted": len(accepted), "compiled": len(accepted),
            "values_compared": compared, "planted_refusals": sum(bool(o.spec.must_fail) for o in outcomes)}


def check_triton(variants: list, seed: int) -> int:
    """Each variant's Triton twin under the interpreter against the reference, its params passed by the names the
    spec declares (INFINITY=..., num_warps=...): returns how many ran."""
    from fivar.testing import compare
    g = torch.Generator().manual_seed(seed)
    for v in variants:
        q, k, vv = (torch.randn(n, 2, 16, generator=g).half() for n in (5, 9, 9))
        params = {n: (torch.randn(TABLE_LEN, generator=g) if n in v.tensor_params else
                      (1.5 if p.dtype is float else 3)) for n, p in v.params.items()}
        out = v.prefill(q, k, vv, backend="triton", **params)
        result = compare(v.name, "fuzzed", out, v.reference(q, k, vv, **params), torch.float16)
        assert result.passed, f"{result}\n{render_attention(v)}"
    return len(variants)


NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
requires_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")


@requires_gxx
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1))
def test_fuzzed_specs_are_refused_with_a_location_or_compile_and_match(seed, tmp_path_factory):
    figures = fuzz(seed, 50, tmp_path_factory.mktemp("fuzz"))
    assert figures["accepted"] and figures["refused"]
    assert check_triton([o.variant for o in fuzz.accepted[:3]], seed) == min(3, figures["accepted"])


@pytest.mark.nvcc
@requires_gxx
@pytest.mark.skipif(not os.path.exists(NVCC), reason="nvcc not installed")
def test_thousands_of_fuzzed_specs_compile_with_nvcc(tmp_path, capsys):
    """The figures docs/reliability.md quotes: FIVAR_FUZZ_SPECS specs (default 1000) in batches of 250."""
    total = int(os.environ.get("FIVAR_FUZZ_SPECS", "1000"))
    figures: dict = {}
    for batch in range(0, total, 250):
        d = tmp_path / str(batch)
        d.mkdir()
        got = fuzz(7919 + batch, min(250, total - batch), d, nvcc=batch == 0)
        figures = {k: figures.get(k, 0) + v for k, v in got.items()}
    with capsys.disabled():
        print(f"\nfuzz figures: {figures}")
    assert figures["specs"] == total and figures["accepted"] > total // 4


# --- the cases the fuzzer generalises, one by one -----------------------------------------------------------------------
HOSTILE = '''"""A variant whose every name is one generated code used to take as it is."""
from fivar import AttentionVariant, Scalar, Tensor, tanh, minimum

def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    xor = score * params.INFINITY + params.NAN
    bitand = tanh(xor) * params.M_PI
    decltype = params.grid[minimum(q_idx, 6)] + float(params.errno + params.EOF)
    nullptr = bitand + decltype * params.FLT_MAX
    static_cast = nullptr * params.num_warps + params.num_stages + params.NULL
    return static_cast

def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    compl = kv_idx - params.num_ctas
    return compl <= q_idx

variant = AttentionVariant(name="hostile", logits=logits, mask=mask, params={
    "INFINITY": Scalar(float, default=0.5), "NAN": Scalar(float, default=0.25), "M_PI": Scalar(float, default=1.5),
    "errno": Scalar(int, default=2), "EOF": Scalar(int, default=-1), "FLT_MAX": Scalar(float, default=0.75),
    "num_warps": Scalar(float, default=1.25), "num_stages": Scalar(float, default=-0.5),
    "NULL": Scalar(float, default=0.125), "num_ctas": Scalar(int, default=1),
    "grid": Tensor("float32", ("n",))})
'''
HOSTILE_VALUES = {"INFINITY": 0.5, "NAN": -0.25, "M_PI": 1.5, "errno": 2, "EOF": -1, "FLT_MAX": 0.75,
                  "num_warps": 1.25, "num_stages": -0.5, "NULL": 0.125, "num_ctas": 2}


@pytest.fixture
def hostile(tmp_path):
    """The hostile variant in a file whose name holds a newline and C++ and Python code after it."""
    path = tmp_path / "hostile\nint injected_cpp = 1; injected_py() #\\.py"
    path.write_text(HOSTILE)
    return fivar.load(str(path))


@requires_gxx
def test_names_of_macros_keywords_and_launch_options_compile_and_match(hostile, tmp_path):
    """Params named INFINITY, NAN, errno, NULL, EOF, M_PI, FLT_MAX (C macros), grid, num_warps, num_stages (Triton
    launch options), locals xor, bitand, decltype, nullptr, static_cast (C++ keywords): the FA2 and FA3 structs compile
    in one unit with <cmath>, <cerrno>, <cstdio>, <cfloat> included, and match the reference."""
    sm = 0.125
    table = [float(torch.tensor(0.1 * k - 0.3, dtype=torch.float32)) for k in range(TABLE_LEN)]
    points = [dict(raw=1.5, b=0, h=1, kh=0, qo=k, kv=2 * k, qo_len=8, kv_len=12) for k in range(4)]
    src = harness([harness_case(0, hostile, {"sm_scale": sm, **HOSTILE_VALUES})], points, table, device=False)
    (tmp_path / "h.cpp").write_text(src)
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-I", str(csrc_dir()), "-o", str(tmp_path / "h"),
                            str(tmp_path / "h.cpp")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[:3000]
    out = subprocess.run([str(tmp_path / "h")], check=True, capture_output=True, text=True).stdout.splitlines()
    assert len(out) == len(points)
    for line, pt in zip(out, points):
        _, m, logit, mask, _ = line.split()
        want = reference(hostile, {"sm_scale": sm, **HOSTILE_VALUES}, pt, table, torch.float32)
        assert _close(float(logit), want[0]) and float(mask) == want[1], (line, want)


def test_triton_twin_takes_params_named_like_launch_options(hostile):
    """num_warps, num_stages, num_ctas and grid are kernel arguments of the twin like any other param, and callers
    pass them by the names the spec declares."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 16, generator=g).half() for n in (6, 11, 11))
    params = {**HOSTILE_VALUES, "grid": torch.randn(TABLE_LEN, generator=g)}
    from fivar.testing import compare
    out = hostile.prefill(q, k, v, backend="triton", **params)
    result = compare("hostile", "launch-option names", out, hostile.reference(q, k, v, **params), torch.float16)
    assert result.passed, result


# quotes, backslashes and '#' where only a tokenizer tells a comment from a string
_TRICKY_PY = "\n".join([
    r'x = "a # b"  # one',
    r'''y = 'it\'s # not' + "\"#\""  # two "quoted" 'and' \ ''',
    'z = """doc # "" ' + r"''' \"" + ' still',
    r'# inside"""  # three',
    r"""w = (r'\\', '#', f"{x!r}#", '\\')  # four '''""",
    ""])


def test_the_comments_code_only_drops_are_pythons_comment_tokens(hostile):
    """_code_only's comment scanner against Python's tokenizer, on a text of strings and comments that hold each
    other's characters and on the Triton renderings of the hostile spec and of fuzzed ones: the comments it drops are
    tokenize's COMMENT tokens, and what it keeps is the same tokens."""
    texts = [_TRICKY_PY, render_all(hostile)["triton"]]
    r = random.Random(11)
    texts += [o.renders["triton"] for o in (run_spec(r, 110000 + i) for i in range(12)) if o.renders]
    assert len(texts) > 8

    def tokens(text):
        return list(tokenize.generate_tokens(io.StringIO(text).readline))
    for text in texts:
        code, comments = _python_comments(text)
        toks = tokens(text)
        assert comments == [t.string for t in toks if t.type == tokenize.COMMENT]
        assert [(t.type, t.string) for t in tokens(code) if t.type != tokenize.NL] == \
            [(t.type, t.string) for t in toks if t.type not in (tokenize.COMMENT, tokenize.NL)]


def test_a_file_name_with_a_newline_stays_inside_the_comment(hostile):
    """The file name (and the docstring) reach generated code only inside one-line comments, escaped."""
    for target, text in render_all(hostile).items():
        code = _code_only(target, text)
        assert "injected" not in code, (target, code)
        assert "hostile<U+000a>int injected_cpp = 1; injected_py() #<U+005c>.py" in text, target
    compile(render_all(hostile)["triton"], "<triton>", "exec")


def test_identifiers_from_user_names_are_checked_against_each_target():
    """user_ident keeps every derived identifier out of the reserved sets, one-to-one, ASCII, without `__`."""
    pool = NASTY + PYTHON_KEYWORDS + sorted(CALL_KWARGS) + ["U", "U000055", "x_", "a__b", "\u00e9", "e\u0301"]
    seen = {}
    for tag in (names.PARAM, names.LOCAL, names.size_tag(0), names.size_tag(1), names.stride_tag(0)):
        for n in pool:
            ident = names.user_ident(tag, n)
            assert seen.setdefault(ident, (tag, n)) == (tag, n), (ident, seen[ident], (tag, n))
            names.check_rendered("cuda", [ident], "v")
            names.check_rendered("triton", [ident], "v")
    for bad in ("INFINITY", "xor", "num_warps", "grid", "window_left", "__x", "print"):
        with pytest.raises(fivar.FivarError, match="reserved"):
            names.check_rendered("cuda" if bad not in ("num_warps", "grid", "print") else "triton", [bad], "v")
