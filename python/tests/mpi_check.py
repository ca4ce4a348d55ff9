"""Run under `mpirun -np 2` (ctest: python.mpi): the module on the mpi backend, called several times
in one process (MPI stays initialised between calls), gives rank 0 the same gradients on tp=2 and
on dp=2 (the threads backend is refused under mpirun) and the other process empty results.
Exits non-zero on a mismatch."""
import sys

import numpy as np

import meshgrad

steps = meshgrad.train(backend="mpi", mesh="tp=2", steps=2)
grads = meshgrad.grads(backend="mpi", mesh="tp=2", seed=1, dtype="float64")
again = meshgrad.train(backend="mpi", mesh="tp=2", steps=2)
ref = meshgrad.grads(backend="mpi", mesh="dp=2", seed=1, dtype="float64")
if not steps:   # not rank 0
    sys.exit(0 if not grads and not again and not ref else "rank > 0 got results")
assert [s["loss"] for s in steps] == [s["loss"] for s in again], (steps, again)
assert grads and grads.keys() == ref.keys()
for name, g in ref.items():
    assert np.abs(grads[name] - g).max() <= 1e-12 * np.abs(g).max(), name
print("mpi: train twice, and grads on tp=2 and dp=2 agree")
