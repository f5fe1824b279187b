"""Device discipline, checked without a GPU: every tensor meshtrain creates with a torch factory
names its device (taken from the mesh or from a source tensor), except the tensors listed in
ALLOWED, which stay on the host on purpose. A CPU-only CI cannot see a CUDA device mismatch
("Expected all tensors to be on the same device"); it can see the factory call that causes it.

The factories checked are the ones that make a tensor from nothing or from host data:
`tensor`, `as_tensor`, `zeros`, `ones`, `empty`, `full`, `arange`, `linspace`, `logspace`,
`eye`, `empty_strided` and the random ones. `*_like` factories and `Tensor.new_*` are not
checked: they inherit the device of the tensor they are made from. `torch.frombuffer` is host
memory by definition (it wraps a Python buffer): every use must be in ALLOWED.
"""
import ast
import pathlib

import meshtrain

FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace",
             "logspace", "eye", "empty_strided", "rand", "randn", "randint", "randperm",
             "frombuffer"}

# (path under meshtrain/, enclosing function or "*") -> why the tensor stays on the host
ALLOWED = {
    ("_preload.py", "*"): "warms torch up in the forkserver before any rank has a device",
    ("core/mesh.py", "rank_grid"): "the rank layout: integers that name ranks, never data",
    ("data/corpus.py", "*"): "the corpus's tokens on the host; batches move to the device in "
                             "the step driver",
    ("data/sampler.py", "*"): "batch indices and windows on the host, as data loaders make them",
    ("models/spin.py", "__init__"): "a parameter created with its module, moved with the model",
    ("strategies/zero/offload.py", "tensor"): "offload='disk': a memory-mapped file is host "
                                            "memory by definition",
    ("strategies/data_parallel/parameter_server.py", "local_optimizer_state"):
        "AdamW's step count: a 0-dim host scalar in torch.optim (capturable=False)",
    ("bench/harness.py", "one_all_reduce"): "the harness's ranks are run_ranks' gloo ranks "
                                            "on the host: it times their start, not a device",
    ("measure/verify.py", "*"): "plan verification's batches, moved by the step driver",
    ("strategies/expert_parallel/dispatch.py", "__init__"): "routing counters for the "
        "metrics (rows sent, tokens per expert): read on the host every step",
    ("bench/recipe.py", "bench_rank"): "the batch drawn on the host from one generator, "
                                        "the same tokens on every device, then moved",
    ("models/experts.py", "take"): "a layer's capacity drop counters, read on the host for "
                                   "the metrics (zeros where the layer did not run)",
    ("models/gpt_moe.py", "__init__"): "parameters created with their module, moved with the "
                                       "model (built on the meta device by meshtrain train)",
    ("strategies/pipeline/boundary.py", "header"): "a stage message's header: shapes and "
        "dtypes (Python ints) assembled on the host, moved to the device in one copy",
    ("bench/ep.py", "ep_rank"): "the global batch drawn on the host from one generator, so "
                                "every device sees the same tokens; each rank moves its rows",
}


def violations(source: str, path: str) -> list[str]:
    """`path:line function: call` for each torch factory in `source` without device=, and
    not allowed by ALLOWED."""
    tree = ast.parse(source)
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch"
                    and child.func.attr in FACTORIES
                    and not any(k.arg == "device" for k in child.keywords)
                    and not _allowed(path, function)):
                found.append(f"{path}:{child.lineno} {function}: {ast.unparse(child)}")
            visit(child, function)

    visit(tree, "*")
    return found


def _allowed(path: str, function: str) -> bool:
    for (where, fn), _ in ALLOWED.items():
        matches = (path == where or where.endswith("/*") and path.startswith(where[:-1]))
        if matches and fn in ("*", function):
            return True
    return False


def test_every_factory_names_its_device():
    root = pathlib.Path(meshtrain.__file__).parent
    found = [v for f in sorted(root.rglob("*.py"))
             for v in violations(f.read_text(), f.relative_to(root).as_posix())]
    assert not found, ("tensor factories without device= (take it from the mesh or a source "
                       "tensor, or add the call to ALLOWED with its reason):\n" + "\n".join(found))


def test_every_allowed_entry_is_still_needed():
    """An entry whose file or function is gone hides nothing: it must go."""
    root = pathlib.Path(meshtrain.__file__).parent
    for (where, fn) in ALLOWED:
        files = (list(root.glob(where)) if "*" in where else [root / where])
        assert files and all(f.exists() for f in files), where
        if fn != "*":
            names = {n.name for f in files for n in ast.walk(ast.parse(f.read_text()))
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            assert fn in names, f"ALLOWED names {where}:{fn}, which no longer exists"


def test_the_checker_finds_a_planted_violation():
    planted = ("import torch\n"
               "class Buckets:\n"
               "    def used_flags(self, params):\n"
               "        ok = torch.zeros(3, device=params[0].device)\n"
               "        ok2 = torch.empty_like(ok)\n"
               "        return torch.tensor([1.0 for p in params])\n"
               "def outer():\n"
               "    return torch.arange(4, dtype=torch.int64)\n")
    assert violations(planted, "strategies/x.py") == [
        "strategies/x.py:6 used_flags: torch.tensor([1.0 for p in params])",
        "strategies/x.py:8 outer: torch.arange(4, dtype=torch.int64)"]
    # the same calls, where ALLOWED lets them stay on the host
    assert violations(planted, "data/corpus.py") == []
    assert violations(planted, "models/spin.py") == [
        "models/spin.py:6 used_flags: torch.tensor([1.0 for p in params])",
        "models/spin.py:8 outer: torch.arange(4, dtype=torch.int64)"]


# ---- a literal "cpu" where the device should be resolved ------------------------------------
# (path under meshtrain/, enclosing function) -> why this place means the host, on any machine
HOST_ON_PURPOSE = {
    ("core/device.py", "rank_device"): "the resolution itself: a rank whose choice is cpu",
    ("strategies/zero/offload.py", "host_device"): "offload's destination is the host by "
                                                   "definition",
    ("strategies/shared/precision.py", "__init__"): "no compute tensors to take a device "
                                                    "from: no master is made",
    ("strategies/shared/gradient_buckets.py", "used_flags"): "flags built from a Python list "
        "on the host (pinned beside a GPU), then copied to the parameters' device",
    ("core/comm.py", "irecv"): "gloo's p2p cannot write CUDA memory: received on the host",
    ("core/comm.py", "batch_isend_irecv"): "gloo's p2p cannot write CUDA memory: staged "
                                           "through the host",
    ("bench/device.py", "gpt_batch"): "the same tokens on every device: a host generator "
                                      "draws them, then they move to the rank's device",
    ("bench/data.py", "_gpt_step"): "the data bench's reference step runs on the host: it "
                                    "prices what a CPU rank's step consumes",
    ("train/checkpoint.py", "read_tensors"): "a checkpoint read tensor by tensor into host "
                                             "memory (export, one process, no device)",
    ("train/checkpoint_regions.py", "set_up_planner"): "a rank's regions of a checkpoint "
        "read into host memory (DCP reads every chunk there); its slots copy them in place",
    ("core/regions.py", "assemble"): "a rank's value assembled where its regions were read: "
                                     "host memory",
    ("core/regions.py", "share"): "a count of elements, on the host",
    ("train/checkpoint_shares.py", "_to_host"): "a rank's share of a checkpoint kept in host "
        "memory as each group is consolidated: device memory holds one group at a time",
}


def literal_cpu_devices(source: str, path: str) -> list[str]:
    """`path:line function: call` for each device named by the literal "cpu" (a mesh of
    init_device_mesh, torch.device, a device= keyword, .to), outside HOST_ON_PURPOSE."""
    found = []

    def is_cpu(node) -> bool:
        return isinstance(node, ast.Constant) and node.value == "cpu"

    def names_cpu(call: ast.Call) -> bool:
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = call.args[0] if call.args else None
        if name in ("init_device_mesh", "device", "to") and is_cpu(first):
            return True
        return any(k.arg in ("device", "device_type") and is_cpu(k.value)
                   for k in call.keywords)

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if (isinstance(child, ast.Call) and names_cpu(child)
                    and (path, function) not in HOST_ON_PURPOSE):
                found.append(f"{path}:{child.lineno} {function}: {ast.unparse(child)}")
            visit(child, function)

    visit(ast.parse(source), "*")
    return found


def test_meshes_benches_and_references_resolve_their_device():
    """A mesh, a benchmark's reference or a buffer built on "cpu" by name runs on the host
    beside a GPU (and hands host tensors to NCCL): the device comes from core/device.py
    (rank_device, device_for_backend) or a source tensor, except where the host is meant."""
    root = pathlib.Path(meshtrain.__file__).parent
    found = [v for f in sorted(root.rglob("*.py"))
             for v in literal_cpu_devices(f.read_text(), f.relative_to(root).as_posix())]
    assert not found, ('a literal "cpu" device (resolve it with core/device.py or take it from '
                       "a tensor, or add the place to HOST_ON_PURPOSE with its reason):\n"
                       + "\n".join(found))
    for where, fn in HOST_ON_PURPOSE:   # an entry whose place is gone hides nothing: it goes
        tree = ast.parse((root / where).read_text())
        assert fn in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, where


def test_the_cpu_checker_finds_a_planted_mesh_and_reference():
    planted = ("def rank(x, device):\n"
               "    mesh = init_device_mesh('cpu', (2,))\n"
               "    ok = init_device_mesh(device.type, (2,))\n"
               "    stage = PipelineStage(m, 0, 2, torch.device('cpu'))\n"
               "    model = GPT(cfg).to('cpu')\n"
               "    buf = torch.zeros(3, device='cpu')\n"
               "    host = x.device.type == 'cpu'\n")
    assert [v.split(": ", 1)[1] for v in literal_cpu_devices(planted, "bench/x.py")] == [
        "init_device_mesh('cpu', (2,))", "torch.device('cpu')", "GPT(cfg).to('cpu')",
        "torch.zeros(3, device='cpu')"]


def test_a_host_tensor_is_refused_by_an_nccl_group(monkeypatch):
    """What CPU can check of "no host tensor reaches NCCL": Comm's check names the problem
    (the backend mocked: no NCCL group can be made without a GPU)."""
    import pytest
    import torch
    import torch.distributed as dist
    from meshtrain.core import comm

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match=r"a cpu tensor of shape \(3,\) was passed to an NCCL "
                                         "group, which carries CUDA tensors only"):
        comm.check_device(torch.zeros(3), None)
    assert not comm._stages_p2p(torch.zeros(3), None)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    comm.check_device(torch.zeros(3), None)   # the default group takes host tensors too


def test_offload_keeps_every_optimizer_tensor_on_one_side():
    """Beside a GPU, offload='disk' keeps masters and states on the host (files), never the
    masters on the GPU with the states on the host; offload='cpu' pins its host tensors.
    On a CPU-only machine both are the host, as before (what CPU can check)."""
    import torch
    import pytest
    from meshtrain.strategies.zero.offload import OffloadNotice, Offloader, host_device

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert host_device("disk", cuda) == cpu and host_device("cpu", cuda) == cpu
    assert host_device("none", cuda) == cuda and host_device("disk", cpu) == cpu
    assert Offloader("cpu", cuda, None, 0, 0).pinned
    with pytest.warns(OffloadNotice, match="nothing moves"):
        assert not Offloader("cpu", cpu, None, 0, 0).pinned
    assert not Offloader("none", cuda, None, 0, 0).pinned
