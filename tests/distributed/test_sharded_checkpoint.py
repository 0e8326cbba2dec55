"""Resuming with another world size (`hf_sparse_cp.resharding.checkpoint`): FSDP2 training state
(weights with AdamW, and a tiny Llama with SMET) saved by 4 gloo processes resumes on 2, and saved by 2
resumes on 4 (what the 2 processes resumed, saved again; AdamW), each continuing as the uninterrupted run
does (losses and final weights, fp64)."""

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from hf_sparse_cp.resharding.boxes import TargetLayout
from hf_sparse_cp.resharding.checkpoint import load_sharded_state, read_layout, save_sharded_state

BEFORE, AFTER = 3, 2  # steps before the save, steps after it (the SMET topology updates at step 2 and 4)
ROWS = 8  # global batch rows, split evenly over 2 or 4 ranks


def _smet_config():
    from hf_sparse_cp.smet import SMETConfig

    return SMETConfig(density=0.5, block_size=1, update_interval=2)


def _build(kind: str, world: int, seed: int):
    """(model, optimizer) FSDP2-sharded over `world` ranks: an MLP with AdamW, or a tiny Llama with SMET
    (attached after a checkpoint would be loaded, as the Trainer's callback does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if kind == "smet":
        from smet_common import fsdp2_smet, tiny_llama

        model = tiny_llama(seed=seed, dtype=torch.float64, vocab_size=65, intermediate_size=99)  # uneven shards
        return model, fsdp2_smet(model, _smet_config(), world, lr=1e-2, attach=False)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).double()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(kind: str, model, opt, rank: int, world: int, step: int) -> float:
    """One optimizer step on this rank's rows of the step's global batch; the global mean loss."""
    from smet_common import lm_loss, markov_tokens

    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    if kind == "smet":
        loss = lm_loss(model, markov_tokens(ROWS, 16, seed=step, vocab=65)[rows])
    else:
        torch.manual_seed(step)
        loss = model(torch.randn(ROWS, 7, dtype=torch.float64)[rows]).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world


def _ordered(opt) -> list:
    return [p for group in opt.param_groups for p in group["params"]]


def _state(model, opt) -> dict:
    """Weights and the optimizer's `state_dict` tensors (DTensors by rows like their parameter; the step a
    plain tensor) by name."""
    state = {f"model/{n}": p.detach() for n, p in model.named_parameters()}
    for pid, entries in opt.state_dict()["state"].items():
        state.update({f"optim/{pid}/{key}": value for key, value in entries.items() if torch.is_tensor(value)})
    return state


def _target(model, opt, world: int):
    params, ordered = dict(model.named_parameters()), _ordered(opt)

    def target(name: str, tensor: torch.Tensor) -> TargetLayout:
        kind, key, *_ = name.split("/")
        param = params[key] if kind == "model" else ordered[int(key)]
        if tensor.dim() == 0:  # a step counter: every rank holds it
            return TargetLayout(torch.arange(world), (Replicate(),))
        mesh = param.device_mesh
        return TargetLayout(mesh.mesh, tuple(param.placements), mesh)

    return target


def _load(model, opt, loaded: dict) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.to_local().copy_(loaded.pop(f"model/{n}").to_local())
    state = {}
    for name, value in loaded.items():
        _, pid, key = name.split("/")
        state.setdefault(int(pid), {})[key] = value
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


def _weights(model) -> dict:
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


def _run(kind: str, rank: int, world: int, folder: str, resume_from: str | None) -> dict:
    """Train from scratch, or resume from `resume_from`; save the state after BEFORE steps into `folder`
    (a resumed run saves what it loaded, on its own number of processes); train on to BEFORE + AFTER steps."""
    model, opt = _build(kind, world, seed=0 if resume_from is None else 1)
    losses, read = [], None
    if resume_from is None:
        if kind == "smet":
            opt.attach()
        losses = [_step(kind, model, opt, rank, world, s) for s in range(BEFORE)]
    else:
        from hf_sparse_cp.resharding.checkpoint import ReadCounter

        read = ReadCounter()
        loaded = load_sharded_state(resume_from, _target(model, opt, world), counter=read)
        held = sum(v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * v.element_size()
                   for v in loaded.values())
        read = {"bytes": read.bytes, "held": held, "slices": read.slices}
        _load(model, opt, loaded)
        if kind == "smet":
            opt.attach()
    save_sharded_state(_state(model, opt), folder)
    losses += [_step(kind, model, opt, rank, world, s) for s in range(BEFORE, BEFORE + AFTER)]
    return {"losses": losses, "weights": _weights(model), "read": read}


def _worker(rank: int, world: int, folder: str, resume_from: str | None, kinds: tuple[str, ...]) -> dict:
    return {kind: _run(kind, rank, world, f"{folder}/{kind}", resume_from and f"{resume_from}/{kind}")
            for kind in kinds}


def _assert_continues(resumed: dict, reference: dict) -> None:
    for kind in resumed:
        got, want = resumed[kind], reference[kind]
        assert got["losses"] == pytest.approx(want["losses"][BEFORE:], rel=1e-10, abs=1e-12), kind
        for name, w in want["weights"].items():
            assert torch.allclose(got["weights"][name], w, rtol=1e-10, atol=1e-12), (kind, name)
        # each rank read exactly the bytes of what it holds now: only the slices that meet its new boxes
        assert got["read"]["bytes"] == got["read"]["held"], (kind, got["read"])


def test_fsdp2_adamw_and_smet_state_resume_from_4_processes_on_2_and_adamw_from_2_on_4(tmp_path):
    from hf_sparse_cp.testing.spawn import run_gloo

    both = ("adamw", "smet")
    four = run_gloo(_worker, 4, str(tmp_path / "w4"), None, both, timeout_s=300)
    saved_world, tensors = read_layout(tmp_path / "w4" / "adamw")
    assert saved_world == 4 and len({len(t.boxes) for t in tensors.values() if len(t.shape)}) > 1  # some shards empty
    two = run_gloo(_worker, 2, str(tmp_path / "w2"), str(tmp_path / "w4"), both, timeout_s=300)
    for resumed in two:
        _assert_continues(resumed, four[0])
    # back to 4 with AdamW alone (no transformers to import: the cheap way to cover growing the world)
    back = run_gloo(_worker, 4, str(tmp_path / "w4b"), str(tmp_path / "w2"), ("adamw",), timeout_s=300)
    for resumed in back:
        _assert_continues(resumed, four[0])


def test_a_layout_for_other_ranks_or_a_missing_file_is_refused(tmp_path):
    save_sharded_state({"w": torch.arange(6.0).view(2, 3), "step": torch.tensor(4.0)}, tmp_path)
    whole = TargetLayout(torch.arange(1), (Replicate(),))
    loaded = load_sharded_state(tmp_path, lambda *_: whole)
    assert torch.equal(loaded["w"], torch.arange(6.0).view(2, 3)) and float(loaded["step"]) == 4.0
    # one process reads the rows of a 2-rank layout's rank 0: asking for rank 1 names the fix
    with pytest.raises(ValueError, match="names ranks \\[1\\]"):
        load_sharded_state(tmp_path, lambda *_: TargetLayout(torch.arange(2), (Shard(0),)))
    (tmp_path / "shard-00000-of-00001.safetensors").unlink()
    with pytest.raises(ValueError, match="lacks shard-00000-of-00001.*copy every node's shard-\\* files into one"):
        load_sharded_state(tmp_path, lambda *_: whole)
    (tmp_path / "layout.json").unlink()
    with pytest.raises(ValueError, match="not a complete sharded state"):
        load_sharded_state(tmp_path, lambda *_: whole)



@pytest.mark.parametrize("state, named", [
    ({"step": 4}, "'step' is int, not a tensor: store it as a tensor, e.g. torch.tensor(4)."),
    ({"w": None}, "'w' is None, not a tensor: keep only tensors in the sharded state"),
    ({"w": [1.0, 2.0]}, "'w' is list, not a tensor"),
    ({3: torch.zeros(2)}, "key 3 (int) must be a string (the tensor's name in the files), e.g. '3'."),
])
def test_a_state_of_other_values_than_named_tensors_is_refused_naming_the_key(tmp_path, state, named):
    """Issue #50: a non-tensor value ended in an AttributeError ('int' object has no attribute 'shape'), a key that is
    no string in safetensors' error naming neither; each is a TypeError naming the key and the fix, before any file
    is written."""
    with pytest.raises(TypeError, match=re.escape(named)):
        save_sharded_state({"x": torch.zeros(2), **state}, tmp_path / "state")
    assert not (tmp_path / "state").exists()


def test_a_target_that_returns_no_layout_is_refused_naming_the_tensor(tmp_path):
    """Issue #50: a target function returning None (one that forgot a tensor) ended in an AttributeError at
    `.boxes`; it is a TypeError naming the tensor and what to return."""
    save_sharded_state({"w": torch.zeros(2, 3)}, tmp_path)
    with pytest.raises(TypeError, match=re.escape("target('w', ...) returned NoneType, not a TargetLayout: return one "
                                                  "for every saved tensor")):
        load_sharded_state(tmp_path, lambda name, tensor: None)

def _node_worker(rank: int, world: int, folder: str) -> dict:
    """Each rank a node of its own without shared storage (`save_on_each_node`): it saves into its own folder, which
    only it reads back, the layout written by every node's first process."""
    model, opt = _build("adamw", world, seed=0)
    _step("adamw", model, opt, rank, world, 0)
    own = f"{folder}/node{rank}"
    save_sharded_state(_state(model, opt), own, writes_layout=True)
    want = {name: (v.to_local() if hasattr(v, "to_local") else v).clone() for name, v in _state(model, opt).items()}
    fresh, fresh_opt = _build("adamw", world, seed=1)
    _step("adamw", fresh, fresh_opt, rank, world, 0)  # (the optimizer state exists)
    loaded = load_sharded_state(own, _target(fresh, fresh_opt, world))
    got = {name: (v.to_local() if hasattr(v, "to_local") else v) for name, v in loaded.items()}
    return {"same": sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)}


def test_every_node_resumes_from_its_own_folder_without_shared_storage(tmp_path):
    """With `save_on_each_node` and no shared storage, rank 0 alone wrote layout.json and the step counters: the
    second node's folder was no sharded state (a resume there refused the checkpoint as saved without FSDP)."""
    from hf_sparse_cp.testing.spawn import run_gloo

    for result in run_gloo(_node_worker, 2, str(tmp_path), timeout_s=300):
        assert result["same"]
