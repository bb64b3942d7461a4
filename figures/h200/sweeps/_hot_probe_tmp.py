import torch, itertools
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n, w4a16_matmul
from minillm.kernels import gemv
dev=torch.device("cuda"); gen=torch.Generator(device=dev).manual_seed(0)
s,e=torch.cuda.Event(enable_timing=True),torch.cuda.Event(enable_timing=True)
def int4_set(k,n):
    return (pack_int4(torch.randint(0,16,(k,n),device=dev,generator=gen)),
            torch.rand(k//128,n,dtype=torch.bfloat16,device=dev,generator=gen)*0.01,
            pack_int4_along_n(torch.randint(0,16,(k//128,n),device=dev,generator=gen)))
def g_us(body,calls=20):
    body(0); torch.cuda.synchronize(); g=torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls): body(i)
    b=1e9
    for _ in range(5):
        s.record(); g.replay(); e.record(); torch.cuda.synchronize(); b=min(b,s.elapsed_time(e)*1e3)
    return b/calls
for k,n in ((4096,4096),(4096,11008),(11008,4096),(4096,22016)):
    x=torch.randn(1,k,dtype=torch.bfloat16,device=dev,generator=gen)
    pool=[int4_set(k,n) for _ in range(int(200e6//(k*n//2))+2)]
    hot=g_us(lambda i: w4a16_matmul(x,*pool[0],128)); cold=g_us(lambda i: w4a16_matmul(x,*pool[i%len(pool)],128))
    print(f"int4 {k}x{n}: hot {hot:.2f} us cold {cold:.2f} us", flush=True)
for k,n in ((4096,4096),(4096,11008)):
    x=torch.randn(1,k,dtype=torch.bfloat16,device=dev,generator=gen)
    pool=[torch.randn(n,k,dtype=torch.bfloat16,device=dev,generator=gen) for _ in range(int(200e6//(k*n*2))+2)]
    hot=g_us(lambda i: gemv.gemv(x,pool[0])); cold=g_us(lambda i: gemv.gemv(x,pool[i%len(pool)]))
    print(f"bf16 {k}x{n}: hot {hot:.2f} us cold {cold:.2f} us", flush=True)
