"""What each allowed custom call may look like: a kernel's operand and result types, checked before compiling.

Why: a custom call runs a C++ kernel that trusts the types the module gives it. ``lapack_spotrf_ffi`` with a
64x64 operand and a 4x4 result writes 64x64 values into the 4x4 buffer (the daemon died of "double free or
corruption"); with a 4x4 operand and a 256x256 result it returns memory it was never given. The allow-list
(actors/sandbox.py) says *which* kernels may run; this table says *how*.

The table (`KERNELS`) maps every kernel target to the JAX functions that emit it (`jax.lax.linalg.cholesky`
for ``*potrf*``, ``triangular_solve`` with each of its flags for ``*trsm*``, ...). A custom call in a blob is
accepted only if lowering one of them, on operands of the call's own types, for the blob's platform, emits a
call of the same target with the same types, the same kernel attributes (``mhlo.backend_config``, batch
dims), layouts and aliasing: the exact form JAX itself would have written. Anything else — other result
shapes, other attributes, dynamic shapes — is refused, naming the target and the mismatch.

Targets that run no kernel of their own are checked by rule (`MARKERS`): sharding markers and device
placement pass their operand through unchanged (same type); shape assertions return nothing. The XLA
expanders (``Qr``, ``Eigh``, ``ApproxTopK``, ...) and ``AllocateBuffer`` are rewritten by XLA's compile, which
checks their shapes, and runs in a child process (actors/cache.py): a bad one costs that child.

This runs in the checker's child process (it imports JAX); the daemon only reads the verdict.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Attribute keys that do not change what a kernel reads or writes (sharding annotations for the partitioner,
# an empty legacy backend config), left out of the comparison.
_IGNORED_ATTRS = re.compile(r"^(sdy\.|mhlo\.sharding$|mhlo\.layout_mode$)")
_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64", "i1": "bool", "i8": "int8", "i16": "int16",
           "i32": "int32", "i64": "int64", "ui8": "uint8", "ui16": "uint16", "ui32": "uint32", "ui64": "uint64",
           "complex<f32>": "complex64", "complex<f64>": "complex128"}
_TENSOR = re.compile(r"^tensor<((?:\d+x)*)([^,>]+(?:<[^>]*>)?)>$")


class SignatureError(ValueError):
    """A custom call whose types or attributes do not fit its kernel."""


@dataclass(frozen=True)
class CustomCall:
    """One custom call, as printed: its target, attributes (key -> text), operand and result types."""

    target: str
    attrs: tuple[tuple[str, str], ...]
    operands: tuple[str, ...]
    results: tuple[str, ...]

    def signature(self) -> str:
        return f"({', '.join(self.operands)}) -> ({', '.join(self.results)})"


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside (), [], {}, <> and quotes."""
    out, depth, cur, quoted, i = [], 0, [], False, 0
    while i < len(text):
        ch = text[i]
        if quoted:
            cur.append(ch)
            if ch == "\\" and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
            cur.append(ch)
        elif ch in "([{<":
            depth += 1
            cur.append(ch)
        elif ch in ")]}>" and not (ch == ">" and i > 0 and text[i - 1] == "-"):
            depth -= 1
            cur.append(ch)
        elif ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at `start`, skipping quoted strings and nested brackets."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack, quoted, i = [pairs[text[start]]], False, start + 1
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in pairs:
            stack.append(pairs[ch])
        elif ch in ")}]":
            if ch != stack.pop():
                raise SignatureError(f"unbalanced brackets in a custom call: {text[:200]!r}")
            if not stack:
                return i
        i += 1
    raise SignatureError(f"a custom call's text ends early: {text[:200]!r}")


_CALL = re.compile(r'stablehlo\.custom_call\s+@(?:"((?:[^"\\]|\\.)*)"|([\w$.\-]+))\s*\(')


def parse_custom_calls(module_text: str) -> list[CustomCall]:
    """Every custom call in a StableHLO module printed by MLIR (pretty form, one op a line)."""
    calls = []
    for line in module_text.splitlines():
        m = _CALL.search(line)
        if m is None:
            if "stablehlo.custom_call" in line:
                raise SignatureError(f"a custom call this checker cannot read: {line.strip()[:200]!r}")
            continue
        target = m.group(1) or m.group(2)
        i = _closing(line, m.end() - 1) + 1  # past the operand list (SSA names only)
        rest = line[i:].lstrip()
        attrs: dict[str, str] = {}
        if rest.startswith("{"):
            end = _closing(rest, 0)
            for item in _split_top(rest[1:end]):
                key, _, value = item.partition("=")
                attrs[key.strip()] = value.strip()
            rest = rest[end + 1 :].lstrip()
        if not rest.startswith(":"):
            raise SignatureError(f"custom call {target!r} has no type signature: {line.strip()[:200]!r}")
        sig = re.sub(r"\s+loc\(.*\)\s*$", "", rest[1:]).strip()
        lhs, arrow, rhs = sig.partition(" -> ")
        if not arrow or not lhs.startswith("("):
            raise SignatureError(f"custom call {target!r}: cannot read its type signature {sig[:200]!r}")
        operands = _split_top(lhs[1 : _closing(lhs, 0)])
        rhs = rhs.strip()
        results = _split_top(rhs[1 : _closing(rhs, 0)]) if rhs.startswith("(") else [rhs]
        kept = {k: v for k, v in attrs.items() if not _IGNORED_ATTRS.match(k) and not (k == "backend_config" and v == '""')}
        calls.append(CustomCall(target, tuple(sorted(kept.items())), tuple(operands), tuple(results)))
    return calls


def _aval(t: str) -> Any:
    import jax
    import numpy as np

    m = _TENSOR.match(t.strip())
    if m is None or m.group(2) not in _DTYPES:
        raise SignatureError(f"operand type {t!r} is not a static tensor of a known dtype")
    dims = tuple(int(d) for d in m.group(1).split("x") if d)
    import ml_dtypes  # noqa: F401  (bfloat16 for np.dtype)

    return jax.ShapeDtypeStruct(dims, np.dtype(_DTYPES[m.group(2)]) if m.group(2) != "bf16" else jax.numpy.bfloat16)


Builder = Callable[[list[Any], list[Any]], Iterator[Callable[..., Any]]]


def _variants(fn: Callable[..., Any], **flags: tuple[Any, ...]) -> Iterator[Callable[..., Any]]:
    names = list(flags)
    for values in itertools.product(*flags.values()):
        yield lambda *a, _kw=dict(zip(names, values)): fn(*a, **_kw)


def _linalg(name: str) -> Any:
    from jax.lax import linalg

    if hasattr(linalg, name):
        return getattr(linalg, name)
    from jax._src.lax import linalg as private  # (geqrf has no public name)

    return getattr(private, name)


TF = (True, False)


def _svd(ops: list[Any], res: list[Any]) -> Iterator[Callable[..., Any]]:
    from jax.lax.linalg import SvdAlgorithm

    yield from _variants(_linalg("svd"), full_matrices=TF, compute_uv=TF, algorithm=(None, SvdAlgorithm.QR, SvdAlgorithm.JACOBI))


def _threefry(ops: list[Any], res: list[Any]) -> Iterator[Callable[..., Any]]:
    import jax
    import jax.extend.random as jrandom

    def fn(*a: Any) -> Any:
        with jax.threefry_gpu_kernel_lowering(True):
            return jrandom.threefry2x32_p.bind(*a)

    yield fn


# Kernel family -> the JAX functions that emit it (given the call's operand and result types).
KERNELS: dict[str, Builder] = {
    "potrf": lambda o, r: _variants(_linalg("cholesky"), symmetrize_input=(False,)),
    "geqrf": lambda o, r: iter([_linalg("geqrf")]),
    "orgqr": lambda o, r: iter([_linalg("householder_product")]),
    "syevd": lambda o, r: _variants(_linalg("eigh"), lower=TF, symmetrize_input=(False,), sort_eigenvalues=TF),
    "geev": lambda o, r: _variants(_linalg("eig"), compute_left_eigenvectors=TF, compute_right_eigenvectors=TF),
    "gesdd": _svd, "gesvd": _svd, "gesvdj": _svd,
    "getrf": lambda o, r: iter([_linalg("lu")]),
    "sytrd": lambda o, r: _variants(_linalg("tridiagonal"), lower=TF),
    "gehrd": lambda o, r: iter([_linalg("hessenberg")]),
    "gees": lambda o, r: _variants(_linalg("schur"), compute_schur_vectors=TF),
    "trsm": lambda o, r: _variants(_linalg("triangular_solve"), left_side=TF, lower=TF, transpose_a=TF, conjugate_a=TF,
                                   unit_diagonal=TF),
    "gtsv": lambda o, r: iter([_linalg("tridiagonal_solve")]),
    "lu_pivots_to_permutation": lambda o, r: iter(
        [lambda p: _linalg("lu_pivots_to_permutation")(p, r[0].shape[-1] if r and r[0].shape else 0)]),
    "threefry2x32": _threefry,
}
_FAMILY = {"heevd": "syevd", "ungqr": "orgqr", "hetrd": "sytrd", "gtsv2": "gtsv"}
_KERNEL_TARGET = re.compile(r"^(?:lapack_[sdcz](\w+)_ffi|(?:cusolver|hipsolver)_(\w+)_ffi|cusparse_(gtsv2)_ffi|"
                            r"(?:cu|hip)_(lu_pivots_to_permutation)|(?:cu|hip)_(threefry2x32)_ffi)$")
_PLATFORM = {"cpu": "cpu", "cuda": "cuda", "rocm": "rocm"}

# Targets that run no kernel of their own: what their types must satisfy.
_SAME_TYPE = ("Sharding", "annotate_device_placement")
_RESHARD = ("SPMDFullToShardShape", "SPMDShardToFullShape")
_COMPILED_AWAY = ("AllocateBuffer", "Eigh", "Qr", "ProductOfElementaryHouseholderReflectors", "LuDecomposition", "ApproxTopK",
                  "stablehlo.dynamic_approx_top_k", "stablehlo.dynamic_reduce_window", "stablehlo.dynamic_rng_bit_generator",
                  "stablehlo.dynamic_top_k")


def _element(t: str) -> tuple[int, str]:
    m = _TENSOR.match(t.strip())
    if m is None:
        raise SignatureError(f"type {t!r} is not a static tensor")
    return len([d for d in m.group(1).split("x") if d]), m.group(2)


def _check_marker(call: CustomCall) -> bool:
    """True if `call` is a marker target and fits its rule; False if it is not a marker; raises if it does not fit."""
    if call.target in _SAME_TYPE:
        if len(call.operands) != 1 or call.results != call.operands:
            raise SignatureError(f"custom call {call.target!r} passes one value through unchanged, but its signature is "
                                 f"{call.signature()}")
        return True
    if call.target in _RESHARD:
        if len(call.operands) != 1 or len(call.results) != 1 or _element(call.operands[0]) != _element(call.results[0]):
            raise SignatureError(f"custom call {call.target!r} reshapes one value to its shard (or back) keeping its rank and "
                                 f"element type, but its signature is {call.signature()}")
        return True
    if call.target == "shape_assertion":
        if call.results:
            raise SignatureError(f"custom call 'shape_assertion' returns nothing, but its signature is {call.signature()}")
        return True
    return call.target in _COMPILED_AWAY


class SignatureChecker:
    """Checks custom calls against `KERNELS`; remembers the reference forms it lowered (per target, types and platform)."""

    def __init__(self) -> None:
        self._references: dict[tuple[str, tuple[str, ...], tuple[str, ...], str], set[CustomCall]] = {}

    def check(self, module_text: str, platforms: tuple[str, ...]) -> int:
        """Raise SignatureError naming the first custom call that does not fit; return how many were checked."""
        calls = parse_custom_calls(module_text)
        for call in calls:
            self.check_call(call, platforms)
        return len(calls)

    def check_call(self, call: CustomCall, platforms: tuple[str, ...]) -> None:
        if _check_marker(call):
            return
        m = _KERNEL_TARGET.match(call.target)
        if m is None:
            raise SignatureError(f"custom call target {call.target!r} has no signature in this daemon's table "
                                 "(actors/signatures.py), so its operand and result types cannot be checked; it is refused")
        family = next(g for g in m.groups() if g)
        family = _FAMILY.get(family, family)
        if family not in KERNELS:
            raise SignatureError(f"custom call target {call.target!r} (kernel {family!r}) has no signature in this daemon's table")
        known: set[CustomCall] = set()
        for platform in platforms:
            known |= self._reference(call, family, _PLATFORM.get(platform, platform))
        if call in known:
            return
        same_types = [k for k in known if k.operands == call.operands and k.results == call.results]
        if same_types:
            got, want = dict(call.attrs), dict(same_types[0].attrs)
            diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
            raise SignatureError(f"custom call {call.target!r} with signature {call.signature()} has attributes JAX never writes "
                                 f"for it (differing: {', '.join(diff)}; e.g. {diff[0]} = {got.get(diff[0])!r} where JAX writes "
                                 f"{want.get(diff[0])!r}); it is refused")
        expected = sorted({k.signature() for k in known})
        raise SignatureError(f"custom call {call.target!r} has signature {call.signature()}, which does not fit its kernel: for "
                             f"these operands JAX writes {' or '.join(expected[:4]) if expected else 'no such call (the operands do not fit it)'}. "
                             "A kernel trusts these types, so the blob is refused")

    def _reference(self, call: CustomCall, family: str, platform: str) -> set[CustomCall]:
        key = (call.target, call.operands, call.results, platform)
        if key in self._references:
            return self._references[key]
        import jax

        found: set[CustomCall] = set()
        try:
            ops = [_aval(t) for t in call.operands]
            res = [_aval(t) for t in call.results]
        except SignatureError:
            ops = None
        if ops is not None:
            for fn in KERNELS[family](ops, res):
                try:
                    text = jax.jit(fn).trace(*ops).lower(lowering_platforms=(platform,)).as_text()
                except Exception:  # these operands do not fit this function (or its flags): no reference from it
                    continue
                found |= {c for c in parse_custom_calls(text) if c.target == call.target}
        if len(self._references) > 4096:
            self._references.clear()
        self._references[key] = found
        return found


__all__ = ["KERNELS", "CustomCall", "SignatureChecker", "SignatureError", "parse_custom_calls"]
