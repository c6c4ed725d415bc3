import sys; sys.path.insert(0, __import__('os').path.dirname(__file__)); from lev import *
import kernel, numba, time
dec = build(kernel._cpu_decode_job)
for n in (7700,):
    args = inputs(n)
    for th in (1,2):
      for sp in (1,2,4,8,16,32):
        numba.set_num_threads(th)
        dec(*args, sp)
        ts=[]
        for _ in range(30):
            t0=time.perf_counter(); dec(*args, sp); ts.append(time.perf_counter()-t0)
        m = sorted(ts)[15]*1e6
        print(n, th, sp, f"{m:.1f} us", f"{m*1e3/(3*n) if n else 0:.1f} ns/pair(incl t0)")
