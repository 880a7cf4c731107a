"""GPU check of the trainer: tree vs expanded on CUDA, fp32 and bf16, kernel backends ref and triton.

Run on a CUDA machine: `python3 tests/gpu_check_trainer.py` (not collected by pytest: no test_
prefix). Prints one JSON line per configuration; writes $OUT/gpu_check.json when OUT is set.
"""
import json, sys, time, traceback
sys.path.insert(0, ".")
import torch
from tests.executor_helpers import make_plan
from tests.test_executor import _case, CASES
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.verify import compare_runs, run_and_capture

out = {"cuda": torch.cuda.is_available(), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
C = 16
for dtype in ("float32", "bfloat16"):
    for backend in ("ref", "triton"):
        key = f"{dtype}-{backend}"
        try:
            model = build_model("tiny-deep", seed=0, dtype=getattr(torch, dtype)).cuda()
            ex = Executor(model, ExecutorConfig(chunk_size=C, backend=backend, want_logprobs=True, capture_linear=True, validate=False))
            res = {}
            for case in ("unaligned-branch", "nested", "ends-inside-tree", "duplicated-prefix-across-microbatches"):
                trajs, kw = _case(case)
                t0 = time.time()
                ref, g1 = run_and_capture(ex, make_plan(trajs, chunk_size=C, sharing=False, all_positions=True, **{k: v for k, v in kw.items() if k not in ("groups", "old_logprobs", "ref_logprobs")}))
                got, g2 = run_and_capture(ex, make_plan(trajs, chunk_size=C, all_positions=True, **{k: v for k, v in kw.items() if k not in ("old_logprobs", "ref_logprobs")}))
                r = compare_runs(ref, g1, got, g2)
                res[case] = {k: r[k] for k in ("logprob_max_abs_diff", "grad_rel_diff_max", "linear_outputs_bitwise_equal", "linear_outputs_max_abs_diff", "expert_load_equal", "loss_diff")}
                res[case]["s"] = round(time.time() - t0, 2)
            out[key] = res
        except Exception as exc:
            out[key] = {"error": f"{type(exc).__name__}: {exc}"[:600], "trace": traceback.format_exc()[-1500:]}
        print(key, json.dumps(out[key])[:3000], flush=True)
import os
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as fh:
        json.dump(out, fh, indent=1)
