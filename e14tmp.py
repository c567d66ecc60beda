import torch, warnings, collections, sys
warnings.simplefilter("ignore")
from tests.models.families import FAMILIES
from tests.models.measure import _data, _sqnr_on, _reports
import lucid_fx
for fam in sys.argv[1:]:
    f = FAMILIES[fam]
    m = f.make_model(); a, k = f.example_inputs()
    prepared = lucid_fx.prepare(m, example_inputs=a, example_kwargs=k)
    print(prepared.lucid_fx_report)
    batches, held = _data(f)
    lucid_fx.calibrate(prepared, [x if not y else y for x, y in batches] or [(x, y) for x, y in batches], progress=False)
    q = lucid_fx.convert(prepared)
    print(fam, "sqnr", _sqnr_on(m, q, held))
