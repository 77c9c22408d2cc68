import time, torch, transformers as tf, ostinato, sys
torch.manual_seed(0)
net = tf.GPT2LMHeadModel(tf.GPT2Config()).to("cuda", torch.bfloat16).eval()
fn = lambda ids: net(input_ids=ids, use_cache=False).logits
MiB = 2**20
def mark(tag, base):
    torch.cuda.synchronize()
    print(f"{tag:40s} now {(torch.cuda.memory_allocated()-base)/MiB:8.1f}  peak {(torch.cuda.max_memory_allocated()-base)/MiB:8.1f}  reserved {torch.cuda.memory_reserved()/MiB:8.1f}", flush=True)
    torch.cuda.reset_peak_memory_stats()
sizes = [1, 2, 4, 8, 16, 24, 32]
ids = {b: torch.randint(0, 1000, (b, 128), device="cuda") for b in sizes}
which = sys.argv[1]
base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
t = time.time()
if which == "ro":
    f = torch.compile(fn, mode="reduce-overhead")
    for _ in range(3):
        for b in sizes:
            with torch.inference_mode(): out = f(ids[b])
    del out; mark("r-o 3 passes", base)
else:
    f = ostinato.graphed(fn, max_batch_size=32, seq_buckets=(128,), capture=which)
    with torch.inference_mode(): out = f(ids[32])
    del out; mark(f"{which}: first call (captures)", base)
    for b in sizes:
        with torch.inference_mode(): out = f(ids[b])
    del out; mark("pass", base)
    f.wait_for_upgrades(); mark("wait_for_upgrades", base)
    for b in sizes:
        with torch.inference_mode(): out = f(ids[b])
    del out; mark("pass", base)
    print(f.stats().summary())
print("t", time.time() - t)
