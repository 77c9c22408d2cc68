import cProfile, pstats, time, zlib, os, sys, io
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from ostinato.engine.loading.source import open_model
from ostinato.engine.loading.model_cache import ModelCache, file_checksum
t2 = time.perf_counter()
print(f"import torch {t1-t0:.2f} s, engine loading modules {t2-t1:.2f} s")
b = os.urandom(64 << 20)
t = time.perf_counter(); zlib.crc32(b); print(f"crc32 {64/(time.perf_counter()-t):.0f} MB/s")
cache = ModelCache(os.environ["OSTINATO_CACHE_DIR"])
pr = cProfile.Profile(); pr.enable()
t = time.perf_counter(); src = open_model(None, cache=cache); print(f"open_model {time.perf_counter()-t:.2f} s")
pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25); print(s.getvalue()[:6000])
