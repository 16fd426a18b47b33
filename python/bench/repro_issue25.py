import torch, sonicmoe_cpp as sm, sys
E, T = int(sys.argv[1]), int(sys.argv[2])
m = sm.MoE(num_experts=E, num_experts_per_tok=8, hidden_size=4096, intermediate_size=1024).cuda().bfloat16()
x = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y, aux = m(x); y.backward(torch.randn_like(y)); torch.cuda.synchronize()
print("repro ok", E, T, y.float().norm().item(), x.grad.float().norm().item(), flush=True)
