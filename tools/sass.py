"""Static analysis of the Triton decode kernel for a GPU that is not here: `python -m tools.sass`.

Compiles stage 1 of kernel.py's Triton kernel for sm_90a and sm_80 at the bench case
(d = G = 128, page 64, 4 query heads per KV head, 32k tokens) with Triton's own compiler,
reads the SASS (cuobjdump, nvdisasm from Triton's wheel) and prints registers, spills, the
INT2 loop's instruction mix and a pipe model of its cycles against the H200's HBM time per
tile; then the plain kernel's (version 1) for sm_90a, and both kernels' summary lines.
sass_coverage compiles every configuration a list of launch shapes makes (the spec's
`pytest -m sass_all` runs it on every launch the kernel tests make).  No GPU, no project
import but kernel.py; run it with the interpreter off (no TRITON_INTERPRET=1).
"""
import os

import torch
import triton
import triton.language as tl

import kernel

# H200 figures the estimate rests on (printed with the result): HBM bandwidth, SMs, the
# base and boost clocks (HBM bytes per SM-cycle depend on the clock), schedulers per SM.
_H200 = dict(hbm_gbs=4800.0, sms=132, clocks_ghz=(1.755, 1.98), schedulers=4)
_SASS_CASE = dict(B=1, H_q=32, H_kv=8, d=128, G=128, P=64, n_quant=32768 - 320, NW=320)


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kw)` records the call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _record_launch(case):
    """Run the launcher on meta tensors of a launch shape; return the recorded calls.

    case: B, H_q, H_kv, d, G, P, NW, n_quant (longest INT2 length) and, optional,
    q_dtype / win_dtype ("fp32" or "bf16", default bf16), num_splits (default None),
    num_pages and max_blocks (default: just enough pages for n_quant tokens), and
    max_tokens (what sizes the default splits: n_quant, or the block-table capacity on
    the unchecked path), kernel ("fast", default, or "plain")."""
    c = case
    meta = torch.device("meta")
    blocks = c.get("max_blocks", triton.cdiv(c["n_quant"], c["P"]))
    num_pages = c.get("num_pages", blocks * c["B"])
    pages = (num_pages, c["H_kv"], c["P"])
    q_dtype = _DTYPES[c.get("q_dtype", "bf16")]
    win_dtype = _DTYPES[c.get("win_dtype", "bf16")]
    args = dict(
        q=torch.empty(c["B"], c["H_q"], c["d"], dtype=q_dtype, device=meta),
        k_codes=torch.empty(*pages, c["d"] // 4, dtype=torch.uint8, device=meta),
        k_scale=torch.empty(*pages, c["d"] // c["G"], device=meta),
        k_zero=torch.empty(*pages, c["d"] // c["G"], device=meta),
        v_codes=torch.empty(*pages, c["d"] // 4, dtype=torch.uint8, device=meta),
        v_scale=torch.empty(*pages, c["d"] // c["G"], device=meta),
        v_zero=torch.empty(*pages, c["d"] // c["G"], device=meta),
        block_table=torch.empty(c["B"], blocks, dtype=torch.int32, device=meta),
        n_quant=torch.empty(c["B"], dtype=torch.int32, device=meta),
        win_k=torch.empty(c["B"], c["H_kv"], c["NW"], c["d"], dtype=win_dtype, device=meta),
        win_v=torch.empty(c["B"], c["H_kv"], c["NW"], c["d"], dtype=win_dtype, device=meta),
        win_len=torch.empty(c["B"], dtype=torch.int32, device=meta))
    sizes = dict(B=c["B"], H_q=c["H_q"], H_kv=c["H_kv"], d=c["d"], P=c["P"], NW=c["NW"],
                 max_tokens=c.get("max_tokens", c["n_quant"]), num_pages=num_pages)
    recorders = {name: _Recorder(getattr(kernel, name)) for name in kernel._KERNEL_NAMES}
    saved = {name: getattr(kernel, name) for name in recorders}
    vars(kernel).update(recorders)
    try:
        kernel._launch(*args.values(), c["G"], c.get("num_splits"), None, sizes, c.get("kernel", "fast"))
    finally:
        vars(kernel).update(saved)
    return {name: rec.calls[0] for name, rec in recorders.items() if rec.calls}


_TL_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}


def _specialise(fn, args, kw):
    """(signature, constexprs, attrs, options) of a call, specialised like a real launch:
    pointers and ints divisible by 16 get the divisibility hint, ints equal to 1 are
    constants.  Two calls with equal results compile to the same kernel."""
    import inspect
    params = inspect.signature(fn.fn).parameters     # works compiled and interpreted
    names = list(params)
    signature, constexprs, attrs = {}, {}, {}
    options = {k: kw[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
    values = dict(zip(names, args))
    values.update({k: v for k, v in kw.items() if k not in options})
    for i, name in enumerate(names):
        v = values[name]
        if params[name].annotation in (tl.constexpr, "tl.constexpr"):
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TL_TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"cannot specialise argument {name} = {v!r}")
        elif isinstance(v, float):
            signature[name] = "fp32"
        elif v == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, options


def _compile_recorded(fn, args, kw, arch):
    """triton.compile the recorded call for sm_<arch> (cubin in .asm['cubin'])."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature, constexprs, attrs, options = _specialise(fn, args, kw)
    target = GPUTarget("cuda", arch, 32)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options)


def _nvidia_tool(name):
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _sass_of(compiled, disassemble=True):
    """(resource usage dict, list of (offset, opcode, text, source line) SASS lines,
    label -> offset).  Spills are the local-memory stores and loads in the SASS."""
    import re
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", path],
                             capture_output=True, text=True, check=True).stdout
        dis = subprocess.run([_nvidia_tool("nvdisasm"), "-c", "-g", path],
                             capture_output=True, text=True, check=True).stdout
    usage = {key: int(m.group(1)) if (m := re.search(rf"{pat}:(\d+)", res)) else 0
             for key, pat in (("regs", "REG"), ("stack", "STACK"), ("smem", "SHARED"))}
    lines, labels = [], {}
    pending, src_line = [], 0
    for raw in dis.splitlines():
        if (m := re.search(r'//## File ".*", line (\d+)', raw)):
            src_line = int(m.group(1))
            continue
        if (m := re.match(r"\s*(\.L_x_\d+):", raw)):
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", raw)
        if not m:
            continue
        offset, text = int(m.group(1), 16), m.group(2).strip()
        for label in pending:
            labels[label] = offset
        pending = []
        body = re.sub(r"^@!?U?P[T\d]+\s+", "", text)
        lines.append((offset, body.split()[0], body, src_line))
    usage["spill_stores"] = sum(1 for _, op, _, _ in lines if op.startswith("STL"))
    usage["spill_loads"] = sum(1 for _, op, _, _ in lines if op.startswith("LDL"))
    return usage, lines, labels


def _loops(lines, labels):
    """Backward branches: list of (start offset, end offset) of each loop body."""
    import re
    loops = []
    for offset, op, text, _ in lines:
        if op.startswith("BRA") and (m := re.search(r"`\((\.L_x_\d+)\)", text)):
            target = labels.get(m.group(1))
            if target is not None and target <= offset:
                loops.append((target, offset))
    return loops


# Instruction classes of the per-iteration table, matched on the opcode's prefix.
_CLASSES = [("LDG", ("LDG",)), ("LDGSTS", ("LDGSTS",)), ("LDS", ("LDS", "LDSM")),
            ("STS", ("STS",)), ("LDL/STL", ("LDL", "STL")), ("I2F", ("I2F",)),
            ("F2F", ("F2F", "F2FP")), ("HMMA", ("HMMA",)), ("HADD2/HFMA2", ("HADD2", "HFMA2", "HMUL2")),
            ("FFMA", ("FFMA",)), ("FADD/FMUL", ("FADD", "FMUL")), ("MUFU", ("MUFU",)),
            ("IMAD", ("IMAD",)), ("LOP3", ("LOP3",)), ("SHF", ("SHF",)), ("PRMT", ("PRMT",)),
            ("shuffles", ("SHFL",)), ("FSEL/SEL", ("FSEL", "SEL")),
            ("IADD3/ISETP", ("IADD3", "ISETP", "FSETP")), ("BAR", ("BAR",))]

_LOAD_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def _is(op, prefixes):
    return any(op == p or op.startswith(p + ".") for p in prefixes)


def _classify(ops):
    counts = {name: 0 for name, _ in _CLASSES}
    counts["other"] = 0
    for op in ops:
        for name, prefixes in _CLASSES:
            if _is(op, prefixes):
                counts[name] += 1
                break
        else:
            counts["other"] += 1
    return counts


def _lane_bytes(op):
    """Bytes per lane of a load or store opcode (32-bit unless the opcode says otherwise)."""
    return next((b for suffix, b in _LOAD_BYTES.items() if f".{suffix}" in op), 4)


def _global_bytes(ops):
    """Bytes per warp that the LDG / LDGSTS instructions request (all 32 lanes active)."""
    return sum(32 * _lane_bytes(op) for op in ops if op.startswith("LDG"))


# The pipe model: cycles each class of SASS instruction occupies its pipe, per warp
# instruction.  Scheduler-side pipes (one of each per SM sub-partition, 4 per SM):
#   integer/logic (ALU; LOP3, SHF, PRMT, IADD3, compares, selects, min/max, moves):
#     16 lanes per cycle, 2 cycles a warp instruction;
#   FMA: fp32 FFMA/FADD/FMUL and packed fp16 HFMA2/HADD2/HMUL2 on two 16-lane halves
#     (1 cycle a warp instruction); IMAD only on one half (2 cycles), so the pipe needs
#     max(2 * IMAD, fp + IMAD) cycles;
#   special functions and conversions (MUFU, F2F, F2FP, I2F, F2I): 4 lanes, 8 cycles;
#   tensor: mma.sync at the sm_80 rate per sub-partition, 512 fp16 (256 tf32) FLOP per
#     cycle, so HMMA.16816 (m16 n8 k16, 4,096 FLOP) takes 8 cycles; Hopper's dense peak
#     is twice that but only through wgmma, which Triton does not use for these shapes.
# Shared memory, one per SM: 128 bytes per cycle for LDS/LDSM/STS/LDGSTS, one cycle per
# shuffle.  Issue: one instruction per scheduler per cycle.
_ALU_OPS = ("LOP3", "SHF", "PRMT", "IADD3", "ISETP", "FSETP", "HSETP2", "SEL", "FSEL", "MOV",
            "FMNMX", "IMNMX", "LEA", "IABS", "PLOP3", "P2R", "R2P", "SGXT", "BMSK", "LOP",
            "ISCADD", "FLO", "POPC", "VIADD", "VIMNMX", "UIADD3", "ULOP3", "USHF", "UMOV")
_FP_OPS = ("FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2", "FSWZADD")
_XU_OPS = ("MUFU", "F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP")
_SHARED_OPS = ("LDS", "LDSM", "STS", "LDGSTS")
_LDSM_BYTES = {"1": 128, "2": 256, "4": 512}
_PIPES = ("issue", "integer/logic", "FMA", "special/convert", "tensor", "shared memory")


def _hmma_cycles(op):
    """Tensor-pipe cycles of one HMMA (shape from the opcode, e.g. HMMA.16816.F32)."""
    import re
    m = re.match(r"HMMA\.(16)(8)(\d+)", op)
    flop = 2 * 16 * 8 * int(m.group(3)) if m else 4096
    rate = 256 if "TF32" in op else 512
    return flop / rate


def _shared_cycles(op):
    """Shared-memory cycles of one warp instruction (128 bytes per SM-cycle)."""
    import re
    if op.startswith("SHFL"):
        return 1.0
    if op.startswith("LDSM"):
        m = re.search(r"\.(\d)$", op)
        return _LDSM_BYTES.get(m.group(1) if m else "4", 512) / 128
    return 32 * _lane_bytes(op) / 128


def _pipe_cycles(ops, warps, per_tile):
    """SM cycles per 64-token tile that each pipe needs for the loop body `ops` (one
    warp's instructions) run by `warps` warps, scaled by per_tile (64 / tokens per
    iteration); the sub-partition pipes serve warps / 4 of the warps each."""
    n = lambda prefixes: sum(1 for op in ops if _is(op, prefixes))
    imad, fp = n(("IMAD", "IMUL")), n(_FP_OPS)
    per_smsp = {
        "issue": len(ops),
        "integer/logic": 2 * n(_ALU_OPS),
        "FMA": max(2 * imad, fp + imad),
        "special/convert": 8 * n(_XU_OPS),
        "tensor": sum(_hmma_cycles(op) for op in ops if op.startswith("HMMA")),
    }
    smsp_share = warps / _H200["schedulers"] * per_tile
    cycles = {k: v * smsp_share for k, v in per_smsp.items()}
    cycles["shared memory"] = warps * per_tile * sum(
        _shared_cycles(op) for op in ops if _is(op, _SHARED_OPS + ("SHFL",)))
    return cycles


def _hbm_cycles(tile_bytes, clock_ghz):
    """SM cycles the HBM needs for tile_bytes at clock_ghz (bandwidth shared by all SMs)."""
    return tile_bytes / (_H200["hbm_gbs"] / _H200["sms"] / clock_ghz)


_LOOP_KERNELS = {"fast": "_int2_decode_split_kernel", "plain": "_int2_decode_plain_kernel"}
_UNPACKING = {"fast": "_codes_fp16", "plain": "_q2_rows"}     # what finds the INT2 loop


def _compile_stage1(arch, case, config):
    """Record the INT2 loop's kernel (stage 1, or the plain kernel if case says kernel="plain")
    at `case`, compile it for sm_<arch>, return (kw, SASS)."""
    name = _LOOP_KERNELS[case.get("kernel", "fast")]
    grid, args, kw = _record_launch(case)[name]
    kw = dict(kw)
    if "DOT_PRECISION" in kw:
        kw["DOT_PRECISION"] = "tf32x3"     # what the launcher picks on sm80+
    kw.update(config or {})
    return kw, _sass_of(_compile_recorded(getattr(kernel, name), args, kw, arch))


def sass_report(arch=90, case=None, verbose=True, config=None):
    """Compile stage 1 (case kernel="plain": the plain kernel) for sm_<arch> at the bench case
    and analyse its INT2 loop.

    The INT2 loop is the innermost backward-branch loop holding the most instructions
    of _codes_fp16 (plain: _q2_rows), the unpacking of the codes, found by the SASS line info.
    config overrides launch meta-parameters (BLOCK_N, num_warps, ...).  Returns a dict
    of the figures, the issue/HBM ratio at the base clock; prints a table if verbose."""
    case = dict(_SASS_CASE, **(case or {}))
    kw, (usage, lines, labels) = _compile_stage1(arch, case, config)
    loops = _loops(lines, labels)
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1]
                                           for o in loops)]
    import inspect
    src, first = inspect.getsourcelines(getattr(kernel, _UNPACKING[case.get("kernel", "fast")]).fn)
    unpack = range(first, first + len(src))
    start, end = max(inner, key=lambda lp: sum(1 for off, _, _, ln in lines
                                               if lp[0] <= off <= lp[1] and ln in unpack))
    body = [op for off, op, _, _ in lines if start <= off <= end]
    counts = _classify(body)
    warps = kw.get("num_warps", 4)
    tokens = kw.get("BLOCK_N", kw["PAGE_SIZE"])   # tokens of one KV head per loop iteration
    per_tile = 64 / tokens
    d, G = case["d"], case["G"]
    tile_bytes = 64 * 2 * (d // 4 + 2 * 4 * (d // G))
    pipes = _pipe_cycles(body, warps, per_tile)
    clocks = _H200["clocks_ghz"]
    hbm = {ghz: _hbm_cycles(tile_bytes, ghz) for ghz in clocks}
    global_bytes = _global_bytes(body) * warps
    r = dict(arch=arch, regs=usage["regs"], spills=usage["spill_stores"] + usage["spill_loads"],
             spill_stores=usage["spill_stores"], spill_loads=usage["spill_loads"],
             stack=usage["stack"], smem=usage["smem"], total=len(lines), loop=len(body),
             counts=counts, warps=warps, tokens=tokens, global_bytes=global_bytes,
             tile_bytes=tile_bytes, pipes=pipes, hbm_cycles=hbm[clocks[0]],
             issue_cycles=pipes["issue"], ratio=pipes["issue"] / hbm[clocks[0]],
             binding=max(pipes, key=pipes.get),
             ratios={ghz: {k: v / hbm[ghz] for k, v in pipes.items()} for ghz in clocks})
    if verbose:
        print(f"sm_{arch}: {r['regs']} registers, {r['stack']} B stack, "
              f"{r['spill_stores']} spill stores + {r['spill_loads']} spill loads, "
              f"{r['smem']} B shared memory, {r['total']} SASS instructions, "
              f"num_warps {warps}")
        print(f"  INT2 loop: {len(body)} instructions per warp per iteration "
              f"({tokens} tokens of one KV head)")
        print("  " + " | ".join(f"{k} {v}" for k, v in counts.items() if v))
        print(f"  global loads per iteration (all warps, all lanes): {global_bytes} B; "
              f"the {tokens}-token K+V tile holds {tile_bytes * tokens // 64} B")
        head = "".join(f" | / HBM at {ghz} GHz" for ghz in clocks)
        print(f"  per 64-token tile ({tile_bytes} B; HBM "
              + ", ".join(f"{hbm[ghz]:.0f} cycles at {ghz} GHz" for ghz in clocks) + ")")
        print(f"  {'pipe':<16} | SM cycles{head}")
        for name in _PIPES:
            print(f"  {name:<16} | {pipes[name]:9.0f}"
                  + "".join(f" | {pipes[name] / hbm[ghz]:16.2f}" for ghz in clocks))
        print(f"  binding pipe: {r['binding']} ({pipes[r['binding']] / hbm[clocks[0]]:.2f}x "
              f"the HBM time at {clocks[0]} GHz, "
              f"{pipes[r['binding']] / hbm[clocks[1]]:.2f}x at {clocks[1]} GHz)")
    return r


def main():
    """python -m tools.sass: the report at the bench case for sm_80 and sm_90a."""
    if kernel._INTERPRETED:
        raise SystemExit("tools.sass compiles for a GPU: run it without TRITON_INTERPRET=1")
    c = _SASS_CASE
    print(f"case: d = {c['d']}, G = {c['G']}, page {c['P']}, {c['H_q'] // c['H_kv']} query "
          f"heads per KV head, bf16 q and windows, {c['n_quant'] + c['NW']} tokens")
    bpc = ", ".join(f"{_H200['hbm_gbs'] / _H200['sms'] / ghz:.1f} B per SM-cycle at {ghz} GHz"
                    for ghz in _H200["clocks_ghz"])
    print(f"H200 assumptions: {_H200['hbm_gbs']:.0f} GB/s HBM over {_H200['sms']} SMs = "
          f"{bpc}; {_H200['schedulers']} schedulers per SM issuing 1 instruction per cycle "
          f"each; all loads full-width with no cache reuse; pipe rates in tools/sass.py's _pipe_cycles")
    results = {arch: sass_report(arch) for arch in (80, 90)}
    print("The plain kernel (kernel.py's version 1: one program per sequence and KV head, a page per step):")
    plain = sass_report(90, dict(kernel="plain"))
    for name, r in (("fast", results[90]), ("plain", plain)):
        print(f"SASS sm_90a {name:>5}: regs {r['regs']} | spills {r['spills']} | "
              f"issue/HBM cycles per tile {r['ratio']:.2f}")


def _compile_job(job):
    """Compile one recorded call for one architecture; (registers, spills, smem) or the
    error text.  Module-level so that a process pool can run it."""
    name, args, kw, arch = job
    try:
        usage, _, _ = _sass_of(_compile_recorded(getattr(kernel, name), args, kw, arch))
        return usage["regs"], usage["spill_stores"] + usage["spill_loads"], usage["smem"]
    except Exception as e:                        # a compile failure is a result here
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def config_key(name, args, kw):
    """A string naming the compiled kernel that the call kernel `name`[grid](*args, **kw)
    gets (equal keys, one compilation); the fp32 dot precision is left out (the launcher
    picks it from the device)."""
    kw = dict(kw, DOT_PRECISION="tf32x3") if "DOT_PRECISION" in kw else kw
    sig, const, attrs, opts = _specialise(getattr(kernel, name), args, kw)
    return repr((name, sorted(sig.items()), sorted(const.items()),
                 sorted(attrs.items()), sorted(opts.items())))


def sass_coverage(launches, archs=(90, 80), verbose=True, workers=1):
    """Compile every distinct kernel configuration among `launches` (launch shapes as in
    _record_launch) for each architecture; returns a list of rows (kernel, arch, the
    specialisation's constexprs, registers, spills, shared memory, error or None) and
    prints one line per row and the summary line if verbose."""
    jobs, keys = [], set()
    for case in launches:
        for name, (grid, args, kw) in _record_launch(case).items():
            kw = dict(kw)
            if "DOT_PRECISION" in kw:
                kw["DOT_PRECISION"] = "tf32x3"
            key = config_key(name, args, kw)
            for arch in archs:
                if (key, arch) not in keys:
                    keys.add((key, arch))
                    jobs.append((name, args, kw, arch))
    if workers > 1:
        import concurrent.futures as cf
        import multiprocessing as mp
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
            results = list(pool.map(_compile_job, jobs))
    else:
        results = [_compile_job(job) for job in jobs]
    rows = []
    for (name, args, kw, arch), res in zip(jobs, results):
        shown = {k: v for k, v in kw.items() if k.isupper() or k.startswith("num_")}
        err = res if isinstance(res, str) else None
        regs, spills, smem = (0, 0, 0) if err else res
        rows.append(dict(kernel=name, arch=arch, config=shown, regs=regs, spills=spills,
                         smem=smem, error=err))
        if verbose:
            what = err or f"regs {regs:3d} | spills {spills:3d} | smem {smem:6d} B"
            cfg = " ".join(f"{k}={v}" for k, v in shown.items())
            print(f"sm_{arch} {name}: {what} | {cfg}", flush=True)
    if verbose:
        print(f"SASS coverage: {len(rows)} configurations | "
              f"failures {sum(1 for r in rows if r['error'])} | "
              f"with spills {sum(1 for r in rows if r['spills'])} | "
              f"max regs {max((r['regs'] for r in rows), default=0)}")
    return rows


if __name__ == "__main__":
    main()
