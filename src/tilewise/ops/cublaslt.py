"""cuBLASLt GEMMs with fused epilogues, through ctypes: bias + GELU inside the GEMM that makes the GELU's input,
GELU's backward inside the GEMM that makes its gradient, a bias's gradient inside the weight gradient's GEMM.

torch reaches cuBLASLt's bias epilogue (F.linear with a bias) but not these, so a GELU MLP pays a pass over
its tokens x ff_dim activation of its own each way: in the 1.3B bf16 step on the H200 at d5d762d the bias +
GELU kernels took 3.17 ms forward and 4.92 ms backward (24 layers), at GPT-2 124M 1.19 and 1.85 ms
(bench/results/e2e.json). Fused, the forward GEMM writes the GELU's input (kept for the backward) beside its
output, and the backward GEMM reads that input in its epilogue: three passes over the activation fewer a layer.

In torch's row-major terms (x: tokens x in, w: out x in, as nn.Linear; all operands contiguous):
    gelu_bias(x, w, b)  -> (gelu_tanh(x @ w.T + b), x @ w.T + b)   epilogue GELU_AUX_BIAS
    dgelu(dy, w, pre)   -> (dy @ w) * gelu_tanh'(pre)                epilogue DGELU
    wgrad(dy, x, bias_grad) -> dy.T @ x in fp32, and with bias_grad dy.sum(0) in fp32   (BGRADB)
    matmul(a, b, out, bias, accumulate) -> out = a @ b (+ bias) (+ out)   (BIAS; beta 1)
matmul is for the plain GEMMs (ops.linear's, the fused head's) where GEMMS routes them here, so that TUNE can
pick their algorithms: each problem's fastest of the heuristic's first TUNE_ALGOS, timed once on its first
call's own operands (torch takes the heuristic's first).
cuBLASLt is column-major, where a row-major r x c tensor is the c x r matrix: each call computes the
transposed product with the operands swapped, D^T = B^T A^T (the layouts Transformer Engine uses for the same
three GEMMs: "TN" forward, "NN" data gradient, "NT" weight gradient). Products accumulate in fp32; the GELU is
the tanh approximation (GPT-2's), which a GPU test tells apart from erf's.

Plans (descriptors, layouts, the algorithm) are cached per shape, dtype, epilogue and pointer alignment;
a call sets its pointers and launches on the current stream, so it captures into CUDA graphs. The workspace
is one buffer per (device, stream), never freed, as norm.py keeps its partial rows. Where the library is not
loaded (CPU tensors, a build without it) or cuBLASLt has no algorithm for a case, the same functions run as
torch ops: the reference, which is also what the CPU tests drive the MLP's autograd with.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
import warnings

import torch
import torch.nn.functional as F

# cudaDataType_t, cublasComputeType_t, cublasOperation_t
_CUDA_DTYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
# cublasLtMatmulDescAttributes_t
_TRANSA, _TRANSB, _EPILOGUE, _BIAS_POINTER, _AUX_POINTER, _AUX_LD = 3, 4, 7, 8, 11, 12
# cublasLtMatmulPreferenceAttributes_t: the workspace, and the A, B, C, D pointers' alignment (256 unless said)
_PREF_MAX_WORKSPACE_BYTES, _PREF_ALIGNMENT = 1, (5, 6, 7, 8)
# cublasLtEpilogue_t
DEFAULT, BIAS, GELU, GELU_BIAS, GELU_AUX, GELU_AUX_BIAS, DGELU, BGRADB = 1, 4, 32, 36, 160, 164, 192, 512
WORKSPACE_BYTES = 32 << 20      # what torch gives cuBLAS on Hopper
# Which GEMMs go through this module, beyond the GELU MLP's (ops.mlp.CUBLASLT_MLP): with GEMMS, ops.linear's
# (the bias gradient from the weight gradient's GEMM, BGRADB, instead of column_sums' pass) and the fused
# head's. With TUNE, a problem's algorithm is the fastest of the heuristic's first TUNE_ALGOS on its first
# call, not the heuristic's first (torch's choice). Both off until the H200 step measures them
# (bench/gemm_tune.py, bench/e2e_ab.py --cublaslt).
GEMMS = False
TUNE = False
TUNE_ALGOS = 8
TUNE_REPS = 5


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t; its first field, the algorithm, is what cublasLtMatmul takes."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library_files() -> list:
    """libcublasLt in the NVIDIA wheels' folders and torch's own lib folder (where a CUDA build of torch has it)."""
    import glob
    import os
    folders = [os.path.join(os.path.dirname(torch.__file__), "lib")]
    try:
        import nvidia
        folders += [os.path.join(root, "*", "lib") for root in nvidia.__path__]
    except ImportError:
        pass
    return sorted(p for folder in folders for p in glob.glob(os.path.join(folder, "libcublasLt.so*")))


def _load():
    """libcublasLt as torch loaded it (the copy its own GEMMs use: a cuBLAS handle loads it), else from the
    NVIDIA wheels' folders or by name; None if there is none."""
    paths = []
    try:
        if torch.cuda.is_available():
            torch.cuda.current_blas_handle()
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "libcublasLt.so" in line]
    except (OSError, RuntimeError):
        pass
    names = paths[:1] + _library_files() + ["libcublasLt.so.13", "libcublasLt.so.12",
                                                  ctypes.util.find_library("cublasLt")]
    for name in names:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        vp, out = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        signatures = {
            "cublasLtCreate": [out],
            "cublasLtMatmulDescCreate": [out, ctypes.c_int, ctypes.c_int],
            "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
            "cublasLtMatrixLayoutCreate": [out, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatmulPreferenceCreate": [out],
            "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulAlgoGetHeuristic": [vp] * 7 + [ctypes.c_int, ctypes.POINTER(_HeuristicResult),
                                                          ctypes.POINTER(ctypes.c_int)],
            "cublasLtMatmul": [vp] * 14 + [ctypes.c_size_t, vp],
        }
        for fn, args in signatures.items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, ctypes.c_int
        lib.cublasLtGetStatusName.argtypes, lib.cublasLtGetStatusName.restype = [ctypes.c_int], ctypes.c_char_p
        return lib
    return None


_LIB = None
_LOADED = False
_LOCK = threading.Lock()          # a plan's descriptor holds the call's pointers until it launches
_HANDLES: dict = {}               # device index -> cublasLtHandle_t
_WORKSPACES: dict = {}            # (device index, stream) -> uint8 tensor of WORKSPACE_BYTES
_PLANS: dict = {}                 # key -> (descriptor, A, B, D layouts, algorithm, tuned?) or None
_UNPLANNED = object()
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)


def _library():
    global _LIB, _LOADED
    if not _LOADED:
        _LIB, _LOADED = _load(), True
    return _LIB


def available(device) -> bool:
    """Whether cuBLASLt runs this module's GEMMs on `device` (a CUDA device with the library loaded)."""
    return torch.device(device).type == "cuda" and _library() is not None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed: {_LIB.cublasLtGetStatusName(status).decode()} ({status})")


def _set(desc, attribute: int, value) -> None:
    _check(_LIB.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
           f"setting matmul attribute {attribute}")


def _handle(index: int):
    if index not in _HANDLES:
        handle = ctypes.c_void_p()
        with torch.cuda.device(index):
            _check(_LIB.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _HANDLES[index] = handle
    return _HANDLES[index]


def _workspace(device: torch.device, stream) -> torch.Tensor:
    key = (device.index, stream.cuda_stream)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[key]


def _alignment(ptr: int) -> int:
    return 256 if ptr % 256 == 0 else ptr & -ptr


def _layout(dtype, rows: int, cols: int, ld: int):
    layout = ctypes.c_void_p()
    _check(_LIB.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _CUDA_DTYPE[dtype], rows, cols, ld),
           "cublasLtMatrixLayoutCreate")
    return layout


def _candidates(key, bias_ptr: int, aux_ptr: int, count: int):
    """The descriptor, layouts and the heuristic's first `count` algorithms (fastest estimate first) of one
    column-major problem; no algorithms where cuBLASLt has none."""
    index, epilogue, transa, transb, m, n, k, lda, ldb, ldd, ab_dtype, d_dtype, aux_ld, aligned = key
    desc = ctypes.c_void_p()
    _check(_LIB.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _CUDA_DTYPE[torch.float32]),
           "cublasLtMatmulDescCreate")
    _set(desc, _TRANSA, ctypes.c_int32(transa))
    _set(desc, _TRANSB, ctypes.c_int32(transb))
    _set(desc, _EPILOGUE, ctypes.c_uint32(epilogue))
    if bias_ptr:        # the heuristic reads the pointers' alignment
        _set(desc, _BIAS_POINTER, ctypes.c_void_p(bias_ptr))
    if aux_ptr:
        _set(desc, _AUX_POINTER, ctypes.c_void_p(aux_ptr))
        _set(desc, _AUX_LD, ctypes.c_int64(aux_ld))
    a = _layout(ab_dtype, *((k, m) if transa == _OP_T else (m, k)), lda)
    b = _layout(ab_dtype, *((n, k) if transb == _OP_T else (k, n)), ldb)
    d = _layout(d_dtype, m, n, ldd)
    pref = ctypes.c_void_p()
    _check(_LIB.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    size = ctypes.c_uint64(WORKSPACE_BYTES)
    _check(_LIB.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), 8),
           "setting the workspace preference")
    for attribute, alignment in zip(_PREF_ALIGNMENT, (aligned[0], aligned[1], aligned[2], aligned[2])):
        value = ctypes.c_uint32(alignment)   # C is D
        _check(_LIB.cublasLtMatmulPreferenceSetAttribute(pref, attribute, ctypes.byref(value), 4),
               "setting an alignment preference")
    results, found = (_HeuristicResult * count)(), ctypes.c_int(0)
    status = _LIB.cublasLtMatmulAlgoGetHeuristic(_handle(index), desc, a, b, d, d, pref, count, results,
                                                 ctypes.byref(found))
    _LIB.cublasLtMatmulPreferenceDestroy(pref)
    algos = [] if status != 0 else [r for r in results[:found.value]
                                    if r.state == 0 and r.workspace_size <= WORKSPACE_BYTES]
    return desc, a, b, d, algos


def _launch(plan, algo, ptrs, beta, device, stream, workspace) -> int:
    desc, la, lb, ld_ = plan[:4]
    return _LIB.cublasLtMatmul(_handle(device.index), desc, ctypes.addressof(_ONE), ptrs[0], la, ptrs[1], lb,
                               ctypes.addressof(_ONE if beta else _ZERO), ptrs[2], ld_, ptrs[2], ld_,
                               ctypes.addressof(algo), workspace.data_ptr(), WORKSPACE_BYTES, stream.cuda_stream)


def _fastest(plan, algos, ptrs, device, stream, workspace):
    """The algorithm of `algos` that ran these operands fastest (TUNE_REPS launches each after one warm-up,
    CUDA events; a failing one is skipped). It synchronizes the stream, once per new problem."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best, best_ms = algos[0], float("inf")
    for algo in algos:
        if _launch(plan, algo, ptrs, 0.0, device, stream, workspace) != 0:
            continue
        start.record(stream)
        for _ in range(TUNE_REPS):
            _launch(plan, algo, ptrs, 0.0, device, stream, workspace)
        end.record(stream)
        end.synchronize()
        if start.elapsed_time(end) < best_ms:
            best, best_ms = algo, start.elapsed_time(end)
    return best


def _matmul(epilogue, transa, transb, m, n, k, a, lda, b, ldb, d, ldd, bias=None, aux=None, aux_ld=0,
            beta=0.0) -> bool:
    """D = op(A) op(B) (+ D when beta is 1; m x n, column-major) with `epilogue`, into d; False if cuBLASLt has
    no algorithm. A problem's first call (outside a CUDA graph capture, with beta 0) with TUNE on times the
    heuristic's first TUNE_ALGOS algorithms on its own operands and keeps the fastest; else the heuristic's first."""
    ptrs = (a.data_ptr(), b.data_ptr(), d.data_ptr(), 0 if bias is None else bias.data_ptr(),
            0 if aux is None else aux.data_ptr())
    key = (d.device.index, epilogue, transa, transb, m, n, k, lda, ldb, ldd, a.dtype, d.dtype, aux_ld,
           tuple(_alignment(p) if p else 0 for p in ptrs))
    stream = torch.cuda.current_stream(d.device)
    with _LOCK:
        workspace = _workspace(d.device, stream)
        plan = _PLANS.get(key, _UNPLANNED)
        if plan is _UNPLANNED or (plan is not None and not plan[5] and TUNE and not beta
                                  and not torch.cuda.is_current_stream_capturing()):
            tune = TUNE and not beta and not torch.cuda.is_current_stream_capturing()
            desc, la, lb, ld_, algos = _candidates(key, ptrs[3], ptrs[4], TUNE_ALGOS if tune else 1)
            if not algos:
                warnings.warn(f"cuBLASLt has no algorithm for epilogue {epilogue} at m={m} n={n} k={k} "
                              f"({a.dtype} -> {d.dtype}); these calls run as torch ops", RuntimeWarning,
                              stacklevel=3)
                _PLANS[key] = None
                return False
            plan = (desc, la, lb, ld_, algos[0], tune)
            if tune and len(algos) > 1:
                plan = plan[:4] + (_fastest(plan, algos, ptrs, d.device, stream, workspace), True)
            _PLANS[key] = plan
        if plan is None:
            return False
        if bias is not None:
            _set(plan[0], _BIAS_POINTER, ctypes.c_void_p(ptrs[3]))
        if aux is not None:
            _set(plan[0], _AUX_POINTER, ctypes.c_void_p(ptrs[4]))
        _check(_launch(plan, plan[4], ptrs, beta, d.device, stream, workspace),
               f"cublasLtMatmul (epilogue {epilogue}, m={m} n={n} k={k})")
    return True


def _operand(t: torch.Tensor):
    """(op, ld) of a row-major matrix t (r x c) as the cuBLASLt operand whose op() is t^T (c x r, column-major):
    contiguous: N, ld c; the transpose of a contiguous matrix: T, ld r; None otherwise."""
    r, c = t.shape
    if t.stride() == (c, 1):
        return _OP_N, c
    if t.stride() == (1, r):
        return _OP_T, r
    return None


def _mm(a, b, out, epilogue=DEFAULT, bias=None, aux=None, beta=0.0) -> bool:
    """out (M x N, contiguous) = a (M x K) @ b (K x N) with `epilogue` (bias: N elements; aux: M x N), each of
    a, b contiguous or the transpose of a contiguous matrix, through cuBLASLt; False where it cannot (the
    caller computes it otherwise)."""
    tensors = [a, b, out] + [t for t in (bias, aux) if t is not None]
    if not (out.is_cuda and available(out.device) and all(t.dtype in _CUDA_DTYPE for t in tensors)
            and out.is_contiguous() and (aux is None or aux.is_contiguous()) and (bias is None or bias.is_contiguous())
            and all(size % 8 == 0 for size in (*a.shape, b.shape[1]))):
        return False
    a_op, b_op = _operand(a), _operand(b)
    if a_op is None or b_op is None:
        return False
    (M, K), N = a.shape, b.shape[1]
    return _matmul(epilogue, b_op[0], a_op[0], N, M, K, b, b_op[1], a, a_op[1], out, N, bias=bias, aux=aux,
                   aux_ld=N if aux is not None else 0, beta=beta)


# ------------------------------------------------------------------------------------------ the GEMMs

def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
           accumulate: bool = False) -> torch.Tensor:
    """out = a @ b (+ bias) (+ out when accumulate), the product in fp32 and rounded once to out's dtype (a
    half-precision product into an fp32 out: fp32 throughout). a, b: 2-D; out: contiguous (M, N); bias: (N,)
    in out's dtype; not both bias and accumulate. torch ops where cuBLASLt cannot."""
    if _mm(a, b, out, BIAS if bias is not None else DEFAULT, bias=bias, beta=1.0 if accumulate else 0.0):
        return out
    with torch.autocast(out.device.type, enabled=False):   # the operands are in the dtypes they are meant in
        if out.dtype == a.dtype:
            if accumulate:
                return out.addmm_(a, b)
            return torch.mm(a, b, out=out) if bias is None else torch.addmm(bias, a, b, out=out)
        product = torch.mm(a.float(), b.float())   # a half-precision product into an fp32 out
        if bias is not None:
            product += bias.float()
        return out.add_(product) if accumulate else out.copy_(product)


def gelu_bias(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, keep_pre: bool = True):
    """(gelu_tanh(x @ w.T + bias), x @ w.T + bias) in x's dtype; the second is None unless keep_pre.
    x: (tokens, in), w: (out, in), bias: (out,) in x's dtype or None."""
    act = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    pre = torch.empty_like(act) if keep_pre else None
    epilogue = {(True, True): GELU_AUX_BIAS, (True, False): GELU_AUX, (False, True): GELU_BIAS,
                (False, False): GELU}[(keep_pre, bias is not None)]
    if _mm(x, w.t(), act, epilogue, bias=bias, aux=pre):
        return act, pre
    ref_act, ref_pre = gelu_bias_reference(x, w, bias)
    act.copy_(ref_act)
    if keep_pre:
        pre.copy_(ref_pre)
    return act, pre


def dgelu(dy: torch.Tensor, w: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """(dy @ w) * gelu_tanh'(pre) in dy's dtype: the gradient at the GELU's input, for y = gelu(pre) @ w.T.
    dy: (tokens, out), w: (out, in), pre: (tokens, in)."""
    dh = torch.empty(dy.shape[0], w.shape[1], dtype=dy.dtype, device=dy.device)
    if pre.dtype == dy.dtype and _mm(dy, w, dh, DGELU, aux=pre):
        return dh
    return dh.copy_(dgelu_reference(dy, w, pre))


def wgrad(dy: torch.Tensor, x: torch.Tensor, bias_grad: bool = False):
    """dy.T @ x in fp32 (the weight's gradient of y = x @ w.T), and with bias_grad also dy.sum(0) in fp32,
    as (dw, db). dy: (tokens, out), x: (tokens, in)."""
    dw = torch.empty(dy.shape[1], x.shape[1], dtype=torch.float32, device=dy.device)
    db = torch.empty(dy.shape[1], dtype=torch.float32, device=dy.device) if bias_grad else None
    if _mm(dy.t(), x, dw, BGRADB if bias_grad else DEFAULT, bias=db):
        return dw, db
    ref_dw, ref_db = wgrad_reference(dy, x)
    dw.copy_(ref_dw)
    if bias_grad:
        db.copy_(ref_db)
    return dw, db


# ------------------------------------------------------------------------------------------ the reference

def gelu_bias_reference(x, w, bias=None):
    """The products in x's dtype (fp32 accumulation where torch gives it), the GELU in fp32 of the rounded input."""
    pre = F.linear(x, w, bias)
    return F.gelu(pre.float(), approximate="tanh").to(x.dtype), pre


def dgelu_reference(dy, w, pre):
    return torch.ops.aten.gelu_backward((dy @ w).float(), pre.float(), approximate="tanh").to(dy.dtype)


def wgrad_reference(dy, x):
    from .linear import _mm_fp32     # linear imports this module
    return _mm_fp32(dy.t(), x), dy.float().sum(0)
