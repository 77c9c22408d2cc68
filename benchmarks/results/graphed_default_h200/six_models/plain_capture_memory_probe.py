import torch, transformers as tf, sys
torch.manual_seed(0)
net = tf.GPT2LMHeadModel(tf.GPT2Config()).to("cuda", torch.bfloat16).eval()
fn = lambda ids: net(input_ids=ids, use_cache=False).logits
sizes = [32, 24, 16, 8, 4, 2, 1]
ids = {b: torch.randint(0, 1000, (b, 128), device="cuda") for b in sizes}
pool = torch.cuda.graph_pool_handle(); s = torch.cuda.Stream(); keep = []
R = lambda: f"alloc {torch.cuda.memory_allocated()/2**20:8.1f} peak {torch.cuda.max_memory_allocated()/2**20:8.1f} reserved {torch.cuda.memory_reserved()/2**20:8.1f}"
print("base", R())
ctx = torch.inference_mode() if sys.argv[1] == "inf" else torch.no_grad()
with ctx:
  for b in sizes:
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s): fn(ids[b])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, stream=s):
        out = fn(ids[b])
    keep.append((g, out)) if sys.argv[2] == "keep" else keep.append(g)
    del out
    print(b, R(), flush=True)
