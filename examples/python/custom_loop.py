"""A block of one's own (parallel_block.py) trained by a training loop of one's own at tp=2, saved, then
loaded at fsdp=2 (the checkpoint read on another mesh) and trained on.

    PYTHONPATH=build/python python3 examples/python/custom_loop.py [--steps 40]

Each rank runs rank_main (launch starts the ranks: threads here, processes under mpirun with
backend="mpi"). Exit status 0 when the loss fell and the resumed run followed the uninterrupted one.
"""
import argparse
import math
import os
import sys
import tempfile

import meshgrad as mg
from parallel_block import ParallelBlock

SIZES = dict(layers=2, hidden=64, heads=4, ffn=128, vocab=256, seq=32, batch=8)


def train_steps(mesh, first, last, total, checkpoints, resume_from=None):
    """Steps [first, last) of a run of `total` steps on this rank; saves after the last one."""
    model = mg.Model(mesh, kind="parallel-block", seed=7, **SIZES)
    opt = mg.AdamW(model, lr=3e-3, weight_decay=0.1)
    if resume_from:
        first = mg.load_checkpoint(resume_from, model, opt)   # any mesh's checkpoint: each rank reads its pieces
    data = mg.Data(batch=SIZES["batch"], seq=SIZES["seq"])     # the built-in corpus; the same batches on every rank
    saver = mg.Checkpointer(checkpoints, mesh)
    losses = []
    for step in range(first, last):
        opt.lr = mg.learning_rate(step, steps=total, lr=3e-3, warmup_steps=5)
        inputs, targets = data.batch(step)
        loss = model.loss(inputs, targets)          # this rank's share of the global mean cross-entropy
        loss.backward()
        opt.clip_grad_norm(1.0)                     # completes the gradients over the mesh, then clips
        opt.step()
        opt.zero_grad()
        losses.append(model.global_loss(loss))      # the step's loss (summed over the batch's ranks)
    saver.save(last, model, opt)
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    half = args.steps // 2
    mg.register_family("parallel-block", ParallelBlock, dropout_draws=1)
    with tempfile.TemporaryDirectory() as tmp:
        first = mg.launch(lambda mesh: train_steps(mesh, 0, half, args.steps, os.path.join(tmp, "a")), mesh="tp=2")[0]
        resumed = mg.launch(lambda mesh: train_steps(mesh, 0, args.steps, args.steps, os.path.join(tmp, "b"),
                                                     resume_from=os.path.join(tmp, "a")), mesh="fsdp=2")[0]
        whole = mg.launch(lambda mesh: train_steps(mesh, 0, args.steps, args.steps, os.path.join(tmp, "c")),
                          mesh="tp=2")[0]
    for step in (0, half - 1):
        print(f"tp=2     step {step + 1:3d}  loss {first[step]:.4f}")
    for i, loss in enumerate(resumed):
        if i % 5 == 0 or i == len(resumed) - 1:
            print(f"fsdp=2   step {half + i + 1:3d}  loss {loss:.4f}   (uninterrupted tp=2: {whole[half + i]:.4f})")
    fell = resumed[-1] < first[0] - 0.5
    # Another mesh adds in another order: float32 rounding, not a different run.
    followed = all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(resumed, whole[half:]))
    print("PASS" if fell and followed and len(resumed) == args.steps - half else "FAIL")
    return 0 if fell and followed else 1


if __name__ == "__main__":
    sys.exit(main())
