"""The Python training API (python/training_api.cpp) against the library's guarantees: operations with
autograd equal their formulas and central differences, a block written in Python trains bit for bit as
the C++ block it re-implements (on tp=2 with SP and on fsdp=2), a custom block's gradients do not depend
on the mesh, checkpoints load on another mesh, the full trainer runs a registered family with on_step,
and bad input is an exception naming it. The examples in examples/python run here too.

ctest runs this against the built module (PYTHONPATH=build/python)."""
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import meshgrad as mg

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "python"
sys.path.insert(0, str(EXAMPLES))
from gpt2_block import Gpt2Block  # noqa: E402
from parallel_block import ParallelBlock  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def families():
    mg.register_family("gpt2-python", Gpt2Block)
    mg.register_family("parallel-block", ParallelBlock, dropout_draws=1)
    yield
    assert mg.unregister_family("gpt2-python") and mg.unregister_family("parallel-block")


def test_version_is_the_projects():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert mg.__version__ == re.search(r"project\(meshgrad VERSION ([0-9.]+)", cmake).group(1)


# ---- tensors and autograd ------------------------------------------------------------------------

def test_backward_of_products_equals_the_formulas():
    rng = np.random.default_rng(0)
    a, b, c = rng.normal(size=(3, 4)), rng.normal(size=(4, 5)), rng.normal(size=(3, 5))
    ta, tb = mg.tensor(a.copy(), requires_grad=True), mg.tensor(b.copy(), requires_grad=True)
    loss = ((ta @ tb) * mg.tensor(c)).sum()
    loss.backward()
    assert loss.item() == pytest.approx(float(((a @ b) * c).sum()), rel=1e-14)
    np.testing.assert_allclose(ta.grad.numpy(), c @ b.T, rtol=1e-13)
    np.testing.assert_allclose(tb.grad.numpy(), a.T @ c, rtol=1e-13)


def test_backward_of_a_composition_equals_central_differences():
    # float64 central differences with h = 1e-5: truncation ~h^2 and rounding ~1e-16/h, both far below
    # the 1e-7 tolerance; a wrong backward is off by O(1).
    rng = np.random.default_rng(1)
    x0, w = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 6))

    def f(x):
        y = mg.gelu(mg.tensor(x) @ mg.tensor(w))
        return (mg.log_softmax(y) * 0.5 + mg.tanh(y)).mean()

    x = mg.tensor(x0.copy(), requires_grad=True)
    y = mg.gelu(x @ mg.tensor(w))
    (mg.log_softmax(y) * 0.5 + mg.tanh(y)).mean().backward()
    h, numeric = 1e-5, np.zeros_like(x0)
    for i in np.ndindex(x0.shape):
        up, down = x0.copy(), x0.copy()
        up[i] += h
        down[i] -= h
        numeric[i] = (f(up).item() - f(down).item()) / (2 * h)
    np.testing.assert_allclose(x.grad.numpy(), numeric, atol=1e-7)


def test_no_grad_records_nothing():
    x = mg.tensor(np.ones(3), requires_grad=True)
    with mg.no_grad():
        y = x * 2.0
    assert not y.requires_grad and (x * 2.0).requires_grad


def test_cross_entropy_equals_numpy():
    rng = np.random.default_rng(2)
    logits, targets = rng.normal(size=(5, 7)), np.array([0, 3, 6, 2, 2], dtype=np.int64)
    got = mg.cross_entropy(mg.tensor(logits), mg.tensor(targets)).item()
    z = logits - logits.max(axis=1, keepdims=True)
    want = float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(5), targets]))
    assert got == pytest.approx(want, rel=1e-13)


# ---- models of one's own on meshes ---------------------------------------------------------------

SIZES = dict(layers=2, hidden=32, heads=4, vocab=256, seq=16, batch=4)


def loop_on_rank(m, kind, steps=3, dtype="float32", sequence_parallel=False, dropout=0.0):
    """On every rank of mesh m: `steps` steps of a training loop of one's own. Returns the losses, every
    parameter's full bytes and this rank."""
    model = mg.Model(m, kind=kind, seed=3, dtype=dtype, dropout=dropout, sequence_parallel=sequence_parallel, **SIZES)
    opt = mg.AdamW(model, lr=1e-2)
    data = mg.Data(batch=SIZES["batch"], seq=SIZES["seq"])
    losses = []
    for step in range(steps):
        inputs, targets = data.batch(step)
        loss = model.loss(inputs, targets)
        loss.backward()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(model.global_loss(loss))
    full = {p.name: p.gather(p.value).numpy().tobytes() for p in model.parameters()}
    return losses, full, m.rank


def own_loop(kind, mesh, **options):
    """loop_on_rank on every rank of `mesh`: rank 0's (losses, parameter bytes)."""
    losses, full, _ = mg.launch(lambda m: loop_on_rank(m, kind, **options), mesh=mesh)[0]
    return losses, full


@pytest.mark.parametrize("mesh,sp", [("tp=2", True), ("fsdp=2", False)])
def test_a_python_block_trains_bit_for_bit_as_the_cpp_block_it_rewrites(mesh, sp):
    # examples/python/gpt2_block.py is GPT-2's block in Python, with its names and initialisation:
    # the same operations in the same order, so every loss and every saved byte is --model gpt's.
    want = own_loop("gpt", mesh, sequence_parallel=sp, dropout=0.1)
    got = own_loop("gpt2-python", mesh, sequence_parallel=sp, dropout=0.1)
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys() and all(got[1][k] == want[1][k] for k in want[1])


def full_gradients(kind, mesh, sequence_parallel=False):
    def rank_main(m):
        model = mg.Model(m, kind=kind, seed=5, dtype="float64", sequence_parallel=sequence_parallel, **SIZES)
        opt = mg.AdamW(model)   # built before backward: its synchroniser completes the gradients over the mesh
        loss = model.loss(*mg.Data(batch=SIZES["batch"], seq=SIZES["seq"]).batch(0))
        loss.backward()
        opt.clip_grad_norm(1e9)   # completes the gradients; never clips
        return model.global_loss(loss), {p.name: p.gather(p.grad).numpy() for p in model.parameters()}
    return mg.launch(rank_main, mesh=mesh)[0]


@pytest.mark.parametrize("mesh,sp", [("tp=2", True), ("fsdp=2", False), ("dp=2", False), ("dp=2,tp=2", True)])
def test_a_custom_blocks_gradients_are_one_ranks(mesh, sp):
    # float64: another mesh adds the same terms in another order, ~1e-16 relative per sum; 1e-12 of
    # the largest gradient is that with room, and a missing or doubled reduction is off by O(1).
    loss1, one = full_gradients("parallel-block", "tp=1")
    loss2, two = full_gradients("parallel-block", mesh, sequence_parallel=sp)
    assert loss2 == pytest.approx(loss1, rel=1e-14)
    assert one.keys() == two.keys() and len(one) == 2 + 2 * 5 + 2   # wte, wpe, 5 per block, ln_f
    for name, g in one.items():
        assert np.abs(two[name] - g).max() <= 1e-12 * max(np.abs(g).max(), 1e-30), name


def test_a_checkpoint_loads_on_another_mesh(tmp_path):
    def save(m):
        model = mg.Model(m, kind="parallel-block", seed=9, **SIZES)
        opt = mg.AdamW(model)
        inputs, targets = mg.Data(batch=4, seq=16).batch(0)
        model.loss(inputs, targets).backward()
        opt.step()
        where = mg.Checkpointer(str(tmp_path / "ck"), m).save(1, model, opt)
        return where, {p.name: p.gather(p.value).numpy().tobytes() for p in model.parameters()}

    def load(m):
        model = mg.Model(m, kind="parallel-block", seed=123, **SIZES)   # another seed: the load must replace it all
        opt = mg.AdamW(model)
        step = mg.load_checkpoint(str(tmp_path / "ck"), model, opt)
        return step, {p.name: p.gather(p.value).numpy().tobytes() for p in model.parameters()}

    where, saved = mg.launch(save, mesh="tp=2")[0]
    assert pathlib.Path(where).name == "step_00000001"
    for mesh in ("tp=1", "fsdp=2"):
        step, loaded = mg.launch(load, mesh=mesh)[0]
        assert step == 1 and loaded == saved, mesh


def test_train_step_on_a_pipeline_equals_one_rank():
    def rank_main(m):
        model = mg.Model(m, kind="parallel-block", seed=4, dtype="float64", **SIZES)
        opt = mg.AdamW(model, lr=1e-2)
        data = mg.Data(batch=4, seq=16)
        return [model.train_step(*data.batch(s), opt, grad_accum=2)[0] for s in range(3)]
    one, two = mg.launch(rank_main, mesh="tp=1")[0], mg.launch(rank_main, mesh="pp=2")[0]
    assert two == pytest.approx(one, rel=1e-12)


MLP_PLAN = mg.Plan("mlp", [("up", "column"), ("down", "row")])


def mlp_with_a_loss_of_ones_own(m, steps=5):
    """A model of layers and a loss of one's own, no Model at all: up (column), gelu, down (row), a
    squared error against a target; AdamW over the layers' parameters."""
    ctx = mg.Context(m)
    up = MLP_PLAN.linear(ctx, "up", 8, 16, seed=1, dtype="float64")
    down = MLP_PLAN.linear(ctx, "down", 16, 4, seed=1, dtype="float64")
    opt = mg.AdamW(up.parameters() + down.parameters(), m, lr=1e-2, weight_decay=0.0)
    rng = np.random.default_rng(0)
    x, target = mg.tensor(rng.normal(size=(6, 2, 8))), mg.tensor(rng.normal(size=(6, 2, 4)))   # [T, B, features]
    losses = []
    for _ in range(steps):
        error = down(mg.gelu(up(x, 6)), 6) - target      # the row layer's output, summed over tp
        loss = (error * error).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_layers_and_a_loss_of_ones_own_train_alike_on_every_mesh():
    one = mg.launch(mlp_with_a_loss_of_ones_own, mesh="tp=1")[0]
    two = mg.launch(mlp_with_a_loss_of_ones_own, mesh="tp=2")
    assert two[0] == two[1]                                # the loss is replicated over tp
    assert two[0] == pytest.approx(one, rel=1e-12) and one[-1] < one[0]
    with pytest.raises(mg.InvalidArgument, match="no parameters given"):
        mg.launch(lambda m: mg.AdamW([], m), mesh="tp=1")


# ---- the full trainer on a registered family -----------------------------------------------------

def test_the_trainer_runs_a_python_family_and_on_step_stops_it_with_a_checkpoint(tmp_path):
    calls = []

    def on_step(step):
        calls.append(step)
        return step["step"] < 3

    base = dict(model="parallel-block", layers=1, hidden=32, heads=4, seq=16, batch=4)
    out = mg.train(**base, mesh="fsdp=2", steps=8, checkpoint_dir=str(tmp_path / "ck"), on_step=on_step,
                   metrics=str(tmp_path / "m.jsonl"))
    assert [c["step"] for c in calls] == [1, 2, 3] and [s["step"] for s in out] == [1, 2, 3]
    assert calls[0].keys() >= {"step", "loss", "lr", "grad_norm"}
    assert (tmp_path / "ck" / "step_00000003").is_dir()
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])["config"]["model"] == "parallel-block"
    resumed = mg.train(**base, mesh="tp=2", steps=8, resume=str(tmp_path / "ck"))
    whole = mg.train(**base, mesh="fsdp=2", steps=8)
    assert [s["step"] for s in resumed] == list(range(4, 9))
    assert resumed[-1]["loss"] == pytest.approx(whole[-1]["loss"], rel=1e-4)


def test_an_exception_in_on_step_stops_training_and_is_raised():
    def on_step(step):
        raise KeyError("from the callback")
    with pytest.raises(KeyError, match="from the callback"):
        mg.train(model="parallel-block", layers=1, hidden=32, heads=4, steps=5, on_step=on_step)


# ---- bad input -----------------------------------------------------------------------------------

def test_registering_is_refused_by_name():
    with pytest.raises(mg.InvalidArgument, match="'gpt' is a built-in model kind"):
        mg.register_family("gpt", Gpt2Block)
    with pytest.raises(mg.InvalidArgument, match="registered already"):
        mg.register_family("parallel-block", ParallelBlock)
    with pytest.raises(mg.InvalidArgument, match="must be callable"):
        mg.register_family("not-callable", 3)
    with pytest.raises(mg.InvalidArgument, match="letters, digits"):
        mg.register_family("has space", ParallelBlock)
    assert "parallel-block" in mg.model_kinds() and not mg.unregister_family("never-registered")


def test_a_block_that_returns_no_tensor_is_named():
    class Broken(ParallelBlock):
        def forward(self, x, seq, dropout):
            return 3
    mg.register_family("broken-block", Broken)
    try:
        with pytest.raises(mg.InvalidArgument, match=r"block 'h\.0': forward returned <class 'int'>"):
            mg.launch(lambda m: mg.Model(m, kind="broken-block", **SIZES).loss(*mg.Data(batch=4, seq=16).batch(0)),
                      mesh="tp=2")
    finally:
        mg.unregister_family("broken-block")


def test_an_exception_on_one_rank_names_the_rank_and_stops_the_others():
    def rank_main(m):
        if m.rank == 1:
            raise ValueError("only on rank one")
        model = mg.Model(m, kind="gpt", **SIZES)   # collective construction: rank 0 would wait for rank 1
        return model.config["kind"]
    with pytest.raises(ValueError, match="only on rank one") as raised:
        mg.launch(rank_main, mesh="tp=2")
    assert raised.value.__notes__ == ["on rank 1 of tp=2"]


def test_unknown_keywords_and_kinds_are_named():
    with pytest.raises(TypeError, match="unexpected keyword argument 'hiden'"):
        mg.launch(lambda m: mg.Model(m, hiden=3), mesh="tp=1")
    with pytest.raises(mg.InvalidArgument, match="unknown kind 'nope'"):
        mg.launch(lambda m: mg.Model(m, kind="nope"), mesh="tp=1")
    with pytest.raises(mg.InvalidArgument, match="the model must be one of"):
        mg.train(model="nope", steps=1)
    with pytest.raises(mg.InvalidArgument, match="style 'diagonal'"):
        mg.Plan("p", [("h.*.x", "diagonal")])


def test_sampling_a_python_family_is_refused_before_the_first_step():
    with pytest.raises(mg.InvalidArgument, match="does not decode"):
        mg.train(model="parallel-block", layers=1, hidden=32, heads=4, steps=2, sample_every=1)


# ---- rank threads and the GIL --------------------------------------------------------------------

def test_no_constructor_releases_the_gil_around_its_registration():
    # A call guard on py::init covers pybind11's registering of the new instance in its process-wide map:
    # two rank threads constructing at once without the GIL corrupt it (python/training_api.cpp, Release).
    # A constructor releases the GIL inside its factory instead. Every py::init's arguments, read here.
    offenders = []
    for source in sorted((ROOT / "python").glob("*.cpp")):
        text = source.read_text()
        for match in re.finditer(r"py::init\s*[(<]", text):
            depth, end = 0, match.start()
            while end < len(text):   # to the parenthesis closing the .def( around py::init
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth < 0:
                    break
                end += 1
            arguments = text[match.start():end]
            if "Release()" in arguments or "call_guard" in arguments:
                offenders.append(f"{source.name}:{text.count(chr(10), 0, match.start()) + 1}")
    assert not offenders, f"py::init with a GIL-releasing call guard at {offenders}"


def test_objects_built_on_every_rank_at_once_stay_registered(tmp_path):
    # The constructors that release the GIL (Data, Model, Checkpointer), run on two rank threads at once many
    # times: with the registration outside the GIL this failed within a few thousand ("Tried to deallocate
    # unregistered instance", or a double free), so it runs in a process of its own.
    script = f"""
import meshgrad as mg
def rank(m):
    for i in range(3000):
        data = mg.Data(batch=2, seq=8)
        data.batch(i)
        if i % 100 == 0:
            model = mg.Model(m, kind="gpt", layers=1, hidden=16, heads=2, vocab=64, seq=8, batch=2)
            saver = mg.Checkpointer({str(tmp_path / "ck")!r} + str(m.rank), m)
            del model, saver
        del data
    return m.rank
for _ in range(3):
    assert mg.launch(rank, mesh="dp=2") == [0, 1]
print("PASS")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "PASS", out.stdout + out.stderr


# ---- the examples, and the mpi backend -----------------------------------------------------------

@pytest.mark.parametrize("example,args", [("custom_loop.py", ["--steps", "20"]),
                                          ("train_custom_model.py", ["--steps", "20"])])
def test_the_examples_pass(example, args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, str(EXAMPLES / example), *args], cwd=EXAMPLES, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("PASS"), out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (OpenMPI)")
def test_a_loop_under_mpirun_is_the_threads_backends(tmp_path):
    # One process per rank (backend="mpi") runs the same loop as the rank threads: the same losses, bit for bit.
    want = own_loop("parallel-block", "tp=2", dtype="float64")[0]
    script = tmp_path / "loop.py"
    script.write_text(f"""
import json, sys
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
import meshgrad as mg
import test_training_api as t
mg.register_family("parallel-block", t.ParallelBlock, dropout_draws=1)
losses, _, rank = mg.launch(lambda m: t.loop_on_rank(m, "parallel-block", dtype="float64"), mesh="tp=2",
                            backend="mpi")[0]
json.dump([losses, rank], open(sys.argv[1] + "." + str(rank), "w"))
""")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, str(script),
                           str(tmp_path / "losses")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        losses, got_rank = json.loads((tmp_path / f"losses.{rank}").read_text())
        assert got_rank == rank and losses == want



def test_the_readme_snippet_runs(tmp_path):
    # README.md, "Use it from Python": the training API's snippet, as written.
    readme = (ROOT / "README.md").read_text()
    start = readme.index("To write the model or the loop yourself")
    snippet = readme[readme.index("```python\n", start) + len("```python\n"):readme.index("```\n", start + 1)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES)] + [p for p in sys.path if p]))
    out = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "ck" / "step_00000050").is_dir()
    losses = [float(line) for line in out.stdout.split()]
    assert len(losses) == 100 and losses[-1] < losses[0] - 0.5
