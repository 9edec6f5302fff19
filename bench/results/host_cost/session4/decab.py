import sys, time, statistics, torch
torch.set_num_threads(1)
import megalodon_kernels, importlib
root = megalodon_kernels.__path__[0]
sys.path.append(root + "/bench")
from decode import build, general_step
from megalodon_kernels.model.decode import StaticDecoder
model = build("tiny")
prompt = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(5))
caches = {}
for n in ("general", "eager"):
    caches[n], logits = model.prefill([prompt])
tok = logits.argmax(-1)
eager = StaticDecoder(model, caches["eager"])
runs = {"general": lambda: general_step(model, caches["general"], tok), "eager": lambda: eager.step(tok)}
for f in runs.values(): f(); f()
cpu = {n: [] for n in runs}
with torch.no_grad():
  for _ in range(15):
    for n, f in runs.items():
        for _ in range(10):
            c = time.thread_time(); f(); cpu[n].append(time.thread_time() - c)
print(sys.argv[1], {n: round(statistics.median(v) * 1e3, 3) for n, v in cpu.items()}, flush=True)
