"""The full trainer on a model of one's own: the parallel block of parallel_block.py registered as a model
family, trained by meshgrad.train at fsdp=2 with checkpoints, evaluation and metrics, stopped from the
per-step callback, and resumed at tp=2 on the checkpoint it saved.

    PYTHONPATH=build/python python3 examples/python/train_custom_model.py [--steps 30]

Exit status 0 when the callback saw every step, the stop saved a checkpoint and the resumed run ended
where the uninterrupted one did.
"""
import argparse
import json
import math
import os
import sys
import tempfile

import meshgrad as mg
from parallel_block import ParallelBlock

MODEL = dict(model="parallel-block", layers=2, hidden=64, heads=4, ffn=128, seq=32, batch=8, lr=3e-3, warmup=5)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    stop_after = args.steps // 2
    mg.register_family("parallel-block", ParallelBlock, dropout_draws=1)
    with tempfile.TemporaryDirectory() as tmp:
        validation = os.path.join(tmp, "validation.txt")   # bytes of text: the evaluation's held-out tokens
        with open(validation, "w") as f:
            f.write("".join(f"Line {i}: a held-out sentence for the evaluation.\n" for i in range(400)))
        checkpoints = os.path.join(tmp, "checkpoints")
        seen = []

        def on_step(step):                       # runs while training runs, after each step
            seen.append(step)
            if step["step"] % 5 == 0:
                print(f"fsdp=2  step {step['step']:3d}  loss {step['loss']:.4f}  val_loss {step['val_loss']:.4f}  "
                      f"lr {step['lr']:.2e}")
            return step["step"] < stop_after     # False: stop now, saving a checkpoint as Ctrl-C does

        stopped = mg.train(**MODEL, mesh="fsdp=2", steps=args.steps, checkpoint_dir=checkpoints, save_every=10,
                           metrics=os.path.join(tmp, "metrics.jsonl"), val_data=validation, eval_every=5,
                           on_step=on_step)
        saved = sorted(d for d in os.listdir(checkpoints) if d.startswith("step_"))
        resumed = mg.train(**MODEL, mesh="tp=2", steps=args.steps, resume=checkpoints)
        whole = mg.train(**MODEL, mesh="fsdp=2", steps=args.steps)
        with open(os.path.join(tmp, "metrics.jsonl")) as f:
            header = json.loads(f.readline())
    print(f"stopped after step {stopped[-1]['step']}, checkpoints {saved}; resumed at tp=2 from step "
          f"{resumed[0]['step']}: loss {resumed[-1]['loss']:.4f} at step {resumed[-1]['step']} (uninterrupted fsdp=2: "
          f"{whole[-1]['loss']:.4f}); metrics say model {header.get('config', {}).get('model', '?')}")
    evaluated = [s["step"] for s in seen if "val_loss" in s]
    ok = (evaluated == list(range(5, stop_after + 1, 5)) and len(seen) == stop_after and stopped[-1]["step"] == stop_after and f"step_{stop_after:08d}" in saved and
          resumed[0]["step"] == stop_after + 1 and resumed[-1]["step"] == args.steps and
          math.isclose(resumed[-1]["loss"], whole[-1]["loss"], rel_tol=1e-3) and whole[-1]["loss"] < whole[0]["loss"])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
