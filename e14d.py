import torch, warnings, sys, io
warnings.simplefilter("ignore")
from tests.models.families import FAMILIES
import lucid_fx
f = FAMILIES["gpt2"]
m = f.make_model(); a, k = f.example_inputs()
prepared = lucid_fx.prepare(m, example_inputs=a, example_kwargs=k)
lucid_fx.calibrate(prepared, [k], progress=False)
q = lucid_fx.convert(prepared)
buf = io.BytesIO()
try:
    lucid_fx.save(q, buf)
    buf.seek(0)
    r = lucid_fx.load(buf)
    print(type(r(**k)), (r(**k)["logits"] - q(**k)["logits"]).abs().max())
except Exception as e:
    print("ERR", type(e).__name__, str(e)[:1000])
