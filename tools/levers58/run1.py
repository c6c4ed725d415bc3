import sys; sys.path.insert(0, __import__('os').path.dirname(__file__)); from lev import *
import kernel, types, v1
def mk(unpack):
    g = dict(vars(v1)); g['UNPACK'] = unpack
    return types.FunctionType(v1.job_v1.__code__, g, 'job_v1')
vs = {"base": build(kernel._cpu_decode_job)}
for name, up in (("bytes", v1.unpack_bytes), ("gather", v1.unpack_gather)):
    scope_fn = mk(None)
    import numba
    # build with UNPACK jitted inline
    scope = dict(vars(kernel), prange=numba.prange)
    scope['UNPACK'] = numba.njit(inline="always")(types.FunctionType(up.__code__, scope, up.__name__))
    scope['_cpu_exp_rows'] = numba.njit(inline="always", fastmath=F)(types.FunctionType(kernel._cpu_exp_rows.__code__, scope, '_cpu_exp_rows'))
    scope['_cpu_decode_job'] = numba.njit(fastmath=F)(types.FunctionType(v1.job_v1.__code__, scope, '_cpu_decode_job'))
    vs[name] = numba.njit(parallel=True)(types.FunctionType(kernel._cpu_decode.__code__, scope, '_cpu_decode'))
compare(vs)
