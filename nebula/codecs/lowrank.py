"""`lowrank(r, oversample=16, iters=1)`: randomized truncated SVD (Halko, Martinsson & Tropp 2011).

Same contract and wire layout as `svd(r)` (parts U_k S_k (m, k) and V_k^T (k, n), meta {"shape"}), so
the receiver decodes both alike. Instead of a full SVD it runs subspace iteration on the small side:
with A (m, n), n <= m (else A^T), l = k + oversample basis vectors V (n, l),
    `iters` times: V <- orth(A^T (A V))           two (m, n, l) matmuls + a small QR
    AV = A V; W = eigvecs((AV)^T AV)              Rayleigh-Ritz in the l-dim subspace
    U_k S_k = AV W_k,  V_k = V W_k                 best rank k inside span(V)
That is 2 iters + 1 large matmuls instead of a full SVD. With a state, the l Ritz vectors are kept
and start the next step (warm start): activations and gradients drift slowly between steps, so
the subspace only needs refining, and the error falls below a cold start's at the same cost.
A^T (A V) squares A's magnitude, so a tensor with max |x| outside 2^+-40 is iterated on scaled by a
power of two (exact, `scale_exponent`), and U_k S_k is scaled back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nebula.codecs.base import Codec, Meta, Parts, check_ratio, register_codec
from nebula.codecs.svd import as_matrix, decode_factors, rank_for, require_finite_factor, scale_exponent
from nebula.errors import CodecError, ConfigError

SEED = 0x6E6562  # a fixed seed: encoding is deterministic and never touches the global RNG


@register_codec("lowrank")
@dataclass(frozen=True)
class LowRank(Codec):
    ratio: float
    oversample: int = 16
    iters: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", float(self.ratio))
        check_ratio("lowrank", "ratio", self.ratio)
        for field, value, top in (("oversample", self.oversample, 4096), ("iters", self.iters, 16)):
            if type(value) is not int or not 0 <= value <= top:
                raise ConfigError(f"codec 'lowrank': {field}={value!r} must be an integer in 0..{top}")

    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        a = as_matrix("lowrank", x)  # (m, n)
        k = rank_for(self.ratio, *a.shape)
        if k == 0:
            return [a.new_zeros(a.shape[0], 0), a.new_zeros(0, a.shape[1])], {"shape": list(x.shape)}
        transpose = a.shape[1] > a.shape[0]  # iterate on the smaller side
        e = scale_exponent(a)
        b = a * 2.0 ** -e if e else a  # exact: a power of two; the Ritz vectors do not depend on it
        p, v = _factor(b.T if transpose else b, k, self.oversample, self.iters, state)
        p = p * 2.0 ** e if e else p  # back to a's scale, exact (or Inf, refused next)
        require_finite_factor("lowrank", p)
        # a ~ p @ v[:, :k].T, p (m, k) = U_k S_k, v (n, l) Ritz vectors best first
        us, vh = (v[:, :k].contiguous(), p.T.contiguous()) if transpose else (p, v[:, :k].T.contiguous())
        return [us, vh], {"shape": list(x.shape)}

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        return decode_factors("lowrank", parts, meta)


def _factor(a: torch.Tensor, k: int, oversample: int, iters: int, state: dict | None):
    """a (m, n), n <= m -> (A V_k (m, k), V (n, l)) with V's columns the Ritz vectors, best first."""
    n = a.shape[1]
    l = min(n, k + oversample)  # noqa: E741 - the docstring's l, the subspace width
    v = _orthonormal(_start(state, n, l))  # (n, l)
    for _ in range(iters):
        v = _orthonormal(a.T @ (a @ v))  # (n, l)
    av = a @ v  # (m, l)
    scale = av.abs().max()  # scaling its Gram matrix keeps gradients of 1e-10 out of denormals
    if not torch.isfinite(scale):
        raise CodecError("codec 'lowrank': tensor has NaN/Inf values; fix the producer or send it with codec 'none'")
    if scale == 0:  # a zero tensor: nothing to factor; the warm start stays for the next step
        return av[:, :k], _orthonormal(_start(state, n, l))
    w = _ritz(av / scale)  # (l, l), best first
    v = v @ w  # (n, l): the Ritz vectors
    if state is not None:
        state["basis"] = v
    return av @ w[:, :k], v


def _ritz(av: torch.Tensor) -> torch.Tensor:
    """Right singular vectors of A V (m, l), largest first: eigenvectors of its small Gram matrix,
    or, where that fails, an SVD of A V itself. Gradients are rank-deficient (padded positions are
    exactly zero), and eigh of a Gram matrix with many zero eigenvalues failed to converge or returned
    NaN about once in 130 calls (it stopped a training run at step 1071); the SVD never did in the
    same fuzzing, but costs 1.4-2x the eigh path, so it is only the fallback."""
    try:
        _, w = torch.linalg.eigh(av.T @ av)  # eigenvalues ascending
        if torch.isfinite(w).all():
            return w.flip(1)
    except torch.linalg.LinAlgError:
        pass
    return torch.linalg.svd(av, full_matrices=False).Vh.T


def _start(state: dict | None, n: int, l: int) -> torch.Tensor:  # noqa: E741 - the docstring's l
    """The previous step's Ritz vectors when they fit this tensor, else a seeded Gaussian (n, l)."""
    previous = state.get("basis") if state is not None else None
    if isinstance(previous, torch.Tensor) and previous.shape[0] == n and previous.shape[1] >= l:
        return previous[:, :l]
    start = torch.randn(n, l, generator=torch.Generator().manual_seed(SEED))
    if isinstance(previous, torch.Tensor) and previous.shape[0] == n:  # fewer columns: keep them, pad
        start[:, :previous.shape[1]] = previous
    return start


def _orthonormal(v: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(v).Q
