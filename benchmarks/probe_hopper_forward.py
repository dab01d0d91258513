"""Does Hopper's machinery in Triton 3.6 (TMA tensor descriptors, automatic warp specialisation) make the rbf forward
faster?  A compact causal rbf forward written the way the Triton fused-attention tutorial's Hopper path is (device-side
tensor descriptors for Q/K/V/O, an off-band loop without masks and a diagonal loop with them), with the loop's
``warp_specialize`` on or off and three forms of the key-norm term, next to the shipped kernel and SDPA's flash and
cuDNN backends, forward only, bf16, one process.

    PYTHONPATH=. python benchmarks/probe_hopper_forward.py --out DIR [--d 64,128] [--n 1024,2048,4096,8192]
        [--tokens 32768] [--heads 16] [--tune-n 4096] [--rounds 3]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/probe_hopper_forward.py --check   # CPU: every form agrees

Variants of the probe kernel (``NORM``): 0 no norm term (the scaled dot product: the kernel's own shape against
flash), 1 the key-norm bias from a vector computed before the call (``-c ||k||^2 log2 e``, fp32, one load per key
tile), 2 the key norms reduced from the key tile the descriptor loaded (no second read, no pass).  Each with
``WS`` (``tl.range(..., warp_specialize=True)`` on the off-band loop) off and on, and with the off-band loop issuing
the next tile's ``q k^T`` before this tile's softmax (``OVERLAP``, ``_tiles_overlap``).  Per head dim, every variant's
tile configs are tried at ``--tune-n`` (a config that does not compile is reported, not fatal) and the best kept for
the other lengths; each cell is checked against the naive float32 attention of the first batch element (relative
error reported; a wrong kernel's time is marked, not hidden).  Times: CUDA events around ``--iters`` back-to-back
launches, every variant once per round (interleaved), best round kept.  Writes ``hopper_forward.json`` / ``.md``.

This is a probe, not a shipped kernel: what it finds decides whether the shipped forward
(``hf_rbf/kernels_flash_fwd.py``) moves to descriptors and warp specialisation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages): the tutorial's Hopper space, trimmed to what fits a 128-row tile
CONFIGS = [
    (128, 64, 4, 3),
    (128, 64, 4, 4),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (64, 64, 4, 3),
]
VARIANTS = [  # (name, NORM, the off-band loop: "plain", "ws" (warp_specialize) or "overlap" (_tiles_overlap))
    ("no norm", 0, "plain"),
    ("no norm, WS", 0, "ws"),
    ("no norm, overlap", 0, "overlap"),
    ("norm bias vector", 1, "plain"),
    ("norm bias vector, WS", 1, "ws"),
    ("norm bias vector, overlap", 1, "overlap"),
    ("norm from tile", 2, "plain"),
    ("norm from tile, WS", 2, "ws"),
    ("norm from tile, overlap", 2, "overlap"),
]


@triton.jit
def _tile_scores(s, k, KB_ptr, start_n, a, kcoef, NORM: tl.constexpr, BLOCK_N: tl.constexpr):
    """A key tile's scores in log2 units from its raw product ``s = q k^T`` (the norm term per ``NORM``)."""
    s = s * a
    if NORM == 1:
        s += tl.load(KB_ptr + start_n + tl.arange(0, BLOCK_N))[None, :]
    elif NORM == 2:
        kf = k.to(tl.float32)
        s += (tl.sum(kf * kf, 1) * kcoef)[None, :]
    return s


@triton.jit
def _softmax_step(acc, l_i, m_i, s, desc_v, row):
    """One key tile's online-softmax update of ``(acc, l_i, m_i)`` from its scores ``s`` (log2 units); its values are
    the descriptor's rows from ``row`` on."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = desc_v.load([row, 0])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _tiles(acc, l_i, m_i, q, desc_k, desc_v, KB_ptr, y0, lo, hi, a, kcoef, offs_m,
           NORM: tl.constexpr, MASK: tl.constexpr, WS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles ``lo .. hi`` of one (batch, head), whose key ``j`` is row ``y0 + j`` of the flattened keys."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([y0 + start_n, 0])
        s = _tile_scores(tl.dot(q, k.T), k, KB_ptr, start_n, a, kcoef, NORM, BLOCK_N)
        if MASK:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, -1.0e6)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, desc_v, y0 + start_n)
    return acc, l_i, m_i


@triton.jit
def _tiles_overlap(acc, l_i, m_i, q, desc_k, desc_v, KB_ptr, y0, lo, hi, a, kcoef,
                   NORM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The off-band loop of ``_tiles`` (no mask) with the next key tile's product ``q k^T`` issued before this tile's
    softmax, FlashAttention-3's overlap within one warpgroup written by hand: the tensor cores work on tile ``j + 1``
    while the warp computes tile ``j``'s exponentials, if triton leaves the product's wait where its result is used
    (the next iteration) instead of right after it.  The prologue's product of tile ``lo`` and the last iteration's of
    tile ``hi`` (the diagonal block: it exists) are one extra product per program, unused when the range is empty."""
    k = desc_k.load([y0 + lo, 0])
    s_raw = tl.dot(q, k.T)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_next = desc_k.load([y0 + start_n + BLOCK_N, 0])
        s_next = tl.dot(q, k_next.T)
        s = _tile_scores(s_raw, k, KB_ptr, start_n, a, kcoef, NORM, BLOCK_N)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, desc_v, y0 + start_n)
        s_raw = s_next
        k = k_next
    return acc, l_i, m_i


@triton.jit
def _rbf_fwd_desc(Q, K, V, KB, C, OUT, LSE, N, H,
                  D: tl.constexpr, NORM: tl.constexpr, WS: tl.constexpr, OVERLAP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Causal rbf forward (``N`` a multiple of ``BLOCK_M``, ``BLOCK_M`` of ``BLOCK_N``): score in log2 units
    ``2 c q.k log2e - c ||k||^2 log2e`` (NORM 1: the bias vector ``KB``; 2: from the key tile; 0: no norm term)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.num_programs(1) * N
    desc_q = tl.make_tensor_descriptor(Q, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    desc_k = tl.make_tensor_descriptor(K, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    desc_v = tl.make_tensor_descriptor(V, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    desc_o = tl.make_tensor_descriptor(OUT, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    y0 = bh * N
    c = tl.load(C + bh % H).to(tl.float32) * 1.4426950408889634
    a = 2.0 * c
    kcoef = -c
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = desc_q.load([y0 + pid_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    KB_ptr = KB + y0
    # off-band: every key before the row block, no mask (the loop that warp specialisation targets)
    if OVERLAP:
        acc, l_i, m_i = _tiles_overlap(acc, l_i, m_i, q, desc_k, desc_v, KB_ptr, y0, 0, pid_m * BLOCK_M, a, kcoef,
                                       NORM, BLOCK_N)
    else:
        acc, l_i, m_i = _tiles(acc, l_i, m_i, q, desc_k, desc_v, KB_ptr, y0, 0, pid_m * BLOCK_M, a, kcoef, offs_m,
                               NORM, False, WS, BLOCK_N)
    # diagonal: the row block's own keys, causal mask
    acc, l_i, m_i = _tiles(acc, l_i, m_i, q, desc_k, desc_v, KB_ptr, y0, pid_m * BLOCK_M, (pid_m + 1) * BLOCK_M,
                           a, kcoef, offs_m, NORM, True, False, BLOCK_N)
    desc_o.store([y0 + pid_m * BLOCK_M, 0], (acc / l_i[:, None]).to(OUT.dtype.element_ty))
    tl.store(LSE + y0 + offs_m, m_i + tl.math.log2(l_i))


def _alloc(size: int, alignment: int, stream):
    """Global scratch for device-side tensor descriptors (``triton.set_allocator``)."""
    return torch.empty(size, device="cpu" if INTERPRET else "cuda", dtype=torch.int8)


triton.set_allocator(_alloc)


def probe_forward(q, k, v, c, kb, norm: int, loop: str, cfg):
    """``(out, lse)`` of the probe kernel; ``q, k, v [B, H, N, D]`` contiguous, ``c [H]`` fp32, ``kb [B, H, N]``;
    ``loop``: the off-band loop's form (see ``VARIANTS``)."""
    if loop not in ("plain", "ws", "overlap"):
        raise ValueError(f"loop must be 'plain', 'ws' or 'overlap'; got {loop!r}")
    bsz, heads, n, d = q.shape
    bm, bn, warps, stages = cfg
    if n % bm or bm % bn:
        raise ValueError(f"N={n} must be a multiple of BLOCK_M={bm}, itself a multiple of BLOCK_N={bn}")
    out = torch.empty_like(q)
    lse = torch.empty(bsz, heads, n, device=q.device, dtype=torch.float32)
    _rbf_fwd_desc[(n // bm, bsz * heads)](q, k, v, kb, c, out, lse, n, heads, D=d, NORM=norm, WS=loop == "ws",
                                            OVERLAP=loop == "overlap", BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                            num_stages=stages)
    return out, lse


def key_bias_vector(k, c):
    """``-c ||k||^2 log2(e)`` fp32 ``[B, H, N]``: the norm term the NORM=1 kernel loads."""
    return (-(c.view(1, -1, 1) * LOG2E) * k.float().square().sum(-1)).contiguous()


def naive(q, k, v, c, norm: int):
    """Float32 (or the inputs' dtype, float64 on CPU) causal attention with the probe's score."""
    n = q.shape[-2]
    cc = c.view(1, -1, 1, 1).to(q.dtype)
    s = 2 * cc * (q @ k.transpose(-1, -2))
    if norm:
        s = s - cc * k.square().sum(-1)[..., None, :]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def check_on_cpu():
    """Under the interpreter: every NORM form and both WS settings against the float64 reference."""
    torch.manual_seed(0)
    for d in (16, 32):
        q, k, v = (torch.randn(2, 3, 64, d) for _ in range(3))
        c = torch.rand(3) * 0.3 + 0.05
        ref = {norm: naive(q.double(), k.double(), v.double(), c.double(), norm) for norm in (0, 1)}
        kb = key_bias_vector(k, c)
        for name, norm, loop in VARIANTS:
            out, lse = probe_forward(q, k, v, c, kb, norm, loop, (32, 16, 4, 2))
            err = rel_err(out, ref[min(norm, 1)])
            assert err < 1e-5, (name, d, err)
            assert torch.isfinite(lse).all(), (name, d)
    print("every probe variant agrees with the float64 reference")


def whole_calls(q, k, v, c):
    """``{name: (callable, None)}``: the shipped rbf forward+backward and GKA forward, SDPA flash forward+backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    import hf_rbf

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    log_sigma = torch.full((q.shape[1],), 0.5 * math.log(math.sqrt(q.shape[-1])), device=q.device)

    def rbf_fwd_bwd():
        out = hf_rbf.rbf_attention(*leaves, gamma=c, causal=True, backend="triton")
        return torch.autograd.grad(out, leaves, dout)

    def sdpa_fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        return torch.autograd.grad(out, leaves, dout)

    return {"SDPA flash fwd+bwd": (sdpa_fwd_bwd, None), "shipped rbf fwd+bwd": (rbf_fwd_bwd, None),
            "shipped gka forward": (lambda: hf_rbf.gka_attention(k, log_sigma, causal=True, backend="triton"), None)}


def events_ms(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def inputs(b, h, n, d, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    c = torch.full((h,), 0.5 / math.sqrt(d), device="cuda", dtype=torch.float32)
    return q, k, v, c


def tune(d, args, variants):
    """Best config of each variant at ``--tune-n`` (and the compile failures)."""
    n = args.tune_n
    q, k, v, c = inputs(max(1, args.tokens // n), args.heads, n, d)
    kb = key_bias_vector(k, c)
    best, failures = {}, {}
    for name, norm, loop in variants:
        for cfg in CONFIGS:
            try:
                t = min(events_ms(lambda: probe_forward(q, k, v, c, kb, norm, loop, cfg), args.iters) for _ in range(2))
            except Exception as e:  # noqa: BLE001 (a config that does not compile or launch is a finding)
                failures.setdefault(name, []).append(f"{cfg}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                torch.cuda.synchronize()
                continue
            print(f"tune D{d} N{n} {name} {cfg}: {t:.3f} ms", flush=True)
            if name not in best or t < best[name][1]:
                best[name] = (cfg, t)
    return best, failures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="hopper_forward")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--n", default="1024,2048,4096,8192")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tune-n", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-ws", action="store_true", help="leave out the warp-specialised variants")
    ap.add_argument("--whole", action="store_true",
                    help="add the shipped calls: rbf forward+backward and GKA's forward (rbf_attention / "
                         "gka_attention, unchecked here: the GPU tests check them) and SDPA flash forward+backward")
    ap.add_argument("--check", action="store_true", help="CPU check of every variant under the interpreter")
    args = ap.parse_args()
    if args.check:
        check_on_cpu()
        return 0
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from hf_rbf.kernels_flash_fwd import distance_forward

    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    rows, tuned, failed = [], {}, {}
    variants = [v for v in VARIANTS if not (args.no_ws and v[2] == "ws")]
    for d in (int(x) for x in args.d.split(",")):
        best, failures = tune(d, args, variants)
        tuned[d] = {name: list(cfg) for name, (cfg, _) in best.items()}
        failed[d] = failures
        for name, lines in failures.items():
            print(f"D{d} {name}: {len(lines)} configs failed, first: {lines[0]}", flush=True)
        for n in (int(x) for x in args.n.split(",")):
            b = max(1, args.tokens // n)
            q, k, v, c = inputs(b, args.heads, n, d)
            kb = key_bias_vector(k, c)
            refs = {norm: naive(q[:1].float(), k[:1].float(), v[:1].float(), c, norm) for norm in (0, 1)}

            def sdpa(backend):
                def call():
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=2 * c[0].item())
                return call

            fns = {"SDPA flash": (sdpa(SDPBackend.FLASH_ATTENTION), 0),
                   "SDPA cuDNN": (sdpa(SDPBackend.CUDNN_ATTENTION), 0),
                   }
            for label, tma in (("TMA", True), ("pointer loads", False)):
                fns[f"shipped rbf forward ({label})"] = (
                    lambda tma=tma: distance_forward(q, k, v, None, None, None, None, c, None, causal=True,
                                                     window=None, num_prefix_keys=0, normalize=True, qnorm=False,
                                                     kv_same=False, eps=0.0, knorm_inline=True, tma=tma)[0], 1)
            if args.whole:
                fns.update(whole_calls(q, k, v, c))
            for name, norm, loop in variants:
                if name in best:
                    fns[name] = (lambda norm=norm, loop=loop, cfg=best[name][0]:
                                 probe_forward(q, k, v, c, kb, norm, loop, cfg)[0], norm)
            errors = {}
            for name, (fn, norm) in fns.items():
                try:
                    out = fn()
                    errors[name] = None if norm is None else rel_err(out[:1], refs[min(norm, 1)])
                except Exception as e:  # noqa: BLE001
                    errors[name] = f"{type(e).__name__}: {str(e)[:160]}"
            live = {name: fn for name, (fn, _) in fns.items() if not isinstance(errors[name], str)}
            times = {}
            for _ in range(args.rounds):
                for name, fn in live.items():
                    t = events_ms(fn, args.iters)
                    times[name] = min(times.get(name, math.inf), t)
            flash = times["SDPA flash"]
            for name in fns:
                t = times.get(name, math.nan)
                rows.append(dict(d=d, n=n, b=b, name=name, ms=t, vs_flash=t / flash, error_vs_naive=errors[name],
                                 config=tuned[d].get(name)))
            print(f"D{d} N{n}:", {name: round(times.get(name, math.nan) / flash, 3) for name in fns},
                  "errors:", {name: (round(e, 5) if isinstance(e, float) else e) for name, e in errors.items()},
                  flush=True)
            q = k = v = kb = refs = fns = live = None  # the closures hold the inputs
            torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                args=vars(args), seconds=round(time.time() - started, 1), tuned=tuned, failures=failed)
    with open(os.path.join(args.out, "hopper_forward.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "hopper_forward.md"), "w") as f:
        f.write(f"# Hopper forward probe\n\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
                f"{meta['seconds']} s; causal bf16, H{args.heads}, {args.tokens} tokens per call; "
                "ms per forward (best round), ratio to SDPA flash, relative error vs naive fp32 (batch element 0)\n\n")
        f.write("| D | N | variant | config (BM, BN, warps, stages) | ms | vs flash | rel. error |\n"
                "|---|---|---|---|---|---|---|\n")
        for r in rows:
            err = r["error_vs_naive"]
            f.write(f"| {r['d']} | {r['n']} | {r['name']} | {r['config'] or ''} | {r['ms']:.3f} | "
                    f"{r['vs_flash']:.3f} | {err if isinstance(err, str) else '' if err is None else f'{err:.2e}'} |\n")
        for d, fails in failed.items():
            for name, lines in fails.items():
                f.write(f"\nD{d} {name}: configs that failed:\n" + "".join(f"- {x}\n" for x in lines))
    print(f"wrote {args.out}/hopper_forward.md ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
