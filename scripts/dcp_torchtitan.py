#!/usr/bin/env python3
"""torchtitan-format DCP checkpoints with the venv's PyTorch, for ctitan's DCP tests.

The model is bench/eager_llama.py's Llama (torchtitan's parameter names, ctitan's debug
shapes), trained with AdamW under FSDP2 on Gloo and saved as torchtitan's CheckpointManager
saves it: model FQNs at the top level, then "optimizer" (get_optimizer_state_dict with
flatten_optimizer_state_dict), "lr_scheduler" (LambdaLR.state_dict), "train_state"
({step, ntokens_seen}) and "dataloader" ({dp_rank_<r>: pickled loader state, world_size}),
which torch.distributed.checkpoint flattens to "optimizer.state.<fqn>.exp_avg", ...

  save       spawns --ranks Gloo ranks, trains --steps steps on random tokens, dcp.save()s
             to --out and writes --out/../reference.pt (the full tensors, torch.save).
             --tp T: tensor parallelism as torchtitan's Llama plan applies it (parallelize_module
             on a "tp" mesh dimension: ColwiseParallel wq/wk/wv/w1/w3 and the output,
             RowwiseParallel wo/w2 (weights split along dim 1) and the embedding (dim 0),
             SequenceParallel norms); with --dp-shard D too, a D x T mesh ("dp_shard", "tp")
             and FSDP2 over dp_shard on top, so wo/w2 are split along dims 0 and 1. The world
             is D x T ranks (--ranks is ignored); tp ranks of one dp rank see the same batch.
  continue   one process: dcp.load()s --ckpt into a fresh model / optimizer / scheduler and
             trains on the windows a ctitan run traced (CTITAN_TRACE_WINDOWS prefix, all of
             its ranks' files); prints one JSON line {"losses": [...], "lrs": [...]}.
  evil       rewrites a folder's .metadata so that unpickling it would run a shell command.
  compare    dcp.load()s a folder ctitan wrote (checkpoint.format = "dcp") into a state dict
             of the keys its .metadata lists and compares with --ref (a torch.save dict);
             prints one JSON line, exit 1 on any difference.
"""
import argparse
import functools
import glob
import importlib.util
import json
import math
import os
import pickle
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("eager_llama", os.path.join(HERE, "..", "bench", "eager_llama.py"))
eager = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eager)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def model_args(a):
    return argparse.Namespace(dim=256, layers=6, heads=16, kv_heads=16, vocab=2048, seq=a.seq, norm_eps=1e-5,
                              rope_theta=500000.0)


def lr_factor(current, steps, warmup, decay_ratio, min_lr):
    """torchtitan's linear warmup -> stable -> linear decay (ctitan's components/lr_scheduler)."""
    warmup = min(warmup, steps)
    decay = round(steps * decay_ratio)
    if warmup + decay > steps:
        decay = steps - warmup
    stable = steps + 1 - warmup - decay
    if current < warmup:
        return (current + 1) / warmup
    if current < warmup + stable:
        return 1.0
    progress = (current + 1 - warmup - stable) / decay
    return min_lr + (1.0 - min_lr) * (1.0 - progress)


def build(a):
    model = eager.Llama(model_args(a))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, functools.partial(lr_factor, steps=a.total_steps, warmup=a.warmup, decay_ratio=a.decay_ratio,
                               min_lr=a.min_lr))
    return model, opt, sched


def step(model, opt, sched, inputs, labels, clip=torch.nn.utils.clip_grad_norm_):
    opt.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    clip(list(model.parameters()), 1.0)
    lr = opt.param_groups[0]["lr"]
    opt.step()
    sched.step()
    return loss.item(), lr


def apply_tp(model, tp_mesh):
    """torchtitan's Llama tensor-parallel plan (parallelize_llama's apply_tp, loss not parallel):
    activations between blocks are sequence-sharded (Shard(1)), each block's attention and
    feed-forward get whole sequences."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for blk in model.layers:
        parallelize_module(blk, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def clip_grads(params, max_norm):
    """Gradient-norm clipping over DTensor gradients: the norm made whole (a plain tensor) first,
    as torchtitan's clip_grad_norm_ does, so sharded and replicated gradients mix."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


def world_size(a):
    """Ranks of a save: --ranks (FSDP), or the dp_shard x tp mesh."""
    return a.dp_shard * a.tp if a.tp > 1 else a.ranks


def save_rank(rank, a, port):
    world = world_size(a)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(a.seed)  # the same initial weights on every rank; FSDP keeps each rank's rows
    model, _, _ = build(a)
    dp_rank, dp, fsdp_mesh = rank, world, None
    if a.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (a.dp_shard, a.tp), mesh_dim_names=("dp_shard", "tp"))
        apply_tp(model, mesh["tp"])
        dp_rank, dp = mesh["dp_shard"].get_local_rank(), a.dp_shard
        fsdp_mesh = mesh["dp_shard"] if a.dp_shard > 1 else None
    if a.tp == 1 or fsdp_mesh is not None:
        for blk in model.layers:
            fully_shard(blk, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    # The optimizer over the sharded (DTensor) parameters, as torchtitan builds it after FSDP.
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, functools.partial(lr_factor, steps=a.total_steps, warmup=a.warmup, decay_ratio=a.decay_ratio,
                               min_lr=a.min_lr))
    g = torch.Generator().manual_seed(1000 + dp_rank)
    clip = clip_grads if a.tp > 1 else torch.nn.utils.clip_grad_norm_
    for _ in range(a.steps):
        toks = torch.randint(0, 2048, (a.batch, a.seq + 1), generator=g)
        step(model, opt, sched, toks[:, :-1], toks[:, 1:], clip)
    state = dict(get_model_state_dict(model))
    state["optimizer"] = get_optimizer_state_dict(model, opt, options=FLAT)
    state["lr_scheduler"] = sched.state_dict()
    state["train_state"] = {"step": a.steps, "ntokens_seen": a.steps * dp * a.batch * a.seq}
    # torchtitan's ParallelAwareDataloader: a pickled StatefulDataLoader state per dp rank.
    state["dataloader"] = {f"dp_rank_{dp_rank}": pickle.dumps({"_num_yielded": a.steps, "dp_rank": dp_rank}),
                           "world_size": dp}
    dcp.save(state, checkpoint_id=a.out)
    # The reference: every tensor whole, under its flattened key.
    ref = {}
    for k, v in get_model_state_dict(model).items():
        ref[k] = v.full_tensor().clone()
    for k, v in get_optimizer_state_dict(model, opt, options=FLAT).items():
        if k.startswith("state."):
            ref["optimizer." + k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    if rank == 0:
        ref["lr_scheduler.last_epoch"] = torch.tensor(sched.last_epoch)
        ref["lr"] = torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float64)
        torch.save(ref, os.path.join(os.path.dirname(os.path.abspath(a.out)), "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


def cmd_save(a):
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = world_size(a)
    mp.spawn(save_rank, args=(a, port), nprocs=world, join=True)
    print(json.dumps({"saved": a.out, "ranks": world, "tp": a.tp, "steps": a.steps}))


def read_traced(prefix, seq):
    """Every rank's CTITAN_TRACE_WINDOWS lines, rank order: {step: (inputs [B, T], labels [B, T])}."""
    by_step = {}
    for path in sorted(glob.glob(prefix + ".rank*"), key=lambda p: int(p.rsplit("rank", 1)[1])):
        with open(path) as f:
            for line in f:
                vals = [int(v) for v in line.split()]
                by_step.setdefault(vals[0], []).append(vals[1:])
    out = {}
    for s, rows in by_step.items():
        toks = torch.tensor(rows, dtype=torch.long)
        assert toks.shape[1] == seq + 1, toks.shape
        out[s] = (toks[:, :seq].contiguous(), toks[:, 1:].contiguous())
    return out


def cmd_continue(a):
    torch.set_num_threads(1)
    model, opt, sched = build(a)
    state = dict(get_model_state_dict(model))
    state["optimizer"] = get_optimizer_state_dict(model, opt, options=FLAT)
    state["lr_scheduler"] = sched.state_dict()
    state["train_state"] = {"step": -1, "ntokens_seen": -1}  # torchtitan's trainer: Python ints
    dcp.load(state, checkpoint_id=a.ckpt)
    set_model_state_dict(model, {k: v for k, v in state.items()
                                 if k not in ("optimizer", "lr_scheduler", "train_state")})
    set_optimizer_state_dict(model, opt, state["optimizer"], options=FLAT)
    sched.load_state_dict(state["lr_scheduler"])
    windows = read_traced(a.windows, a.seq)
    losses, lrs = [], []
    for s in sorted(windows):
        if s <= state["train_state"]["step"]:
            continue  # steps the checkpoint already holds
        loss, lr = step(model, opt, sched, *windows[s])
        losses.append({"step": s, "loss": loss})
        lrs.append(lr)
    print(json.dumps({"train_state": state["train_state"], "last_epoch": state["lr_scheduler"]["last_epoch"],
                      "losses": losses, "lrs": lrs}))


def cmd_compare(a):
    md = dcp.FileSystemReader(a.ckpt).read_metadata()
    ref = torch.load(a.ref)
    state = {}
    for k, m in md.state_dict_metadata.items():
        # A tensor to load into; a bytes item (RNG, data-loader state) is replaced by what it holds.
        state[k] = torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else b""
    dcp.load(state, checkpoint_id=a.ckpt)
    diffs, extra = [], []
    for k, v in state.items():
        want = ref.get(k)
        if want is None:  # torchtitan's keys ctitan adds (param_groups, LambdaLR state)
            extra.append(k)
            continue
        if isinstance(v, bytes):  # the reference holds byte strings as uint8 tensors
            ok = bytes(want.numpy().tobytes()) == v
        elif isinstance(v, int):  # torchtitan's Python ints (train_state.*, dataloader.world_size)
            ok = want.dim() == 0 and want.item() == v
        else:
            ok = v.dtype == want.dtype and torch.equal(v, want)
        if not ok:
            diffs.append(k)
    missing = [k for k in ref if k not in state]
    print(json.dumps({"keys": len(ref), "equal": len(ref) - len(diffs) - len(missing), "differ": diffs[:5],
                      "missing": missing[:5], "extra": len(extra)}))
    sys.exit(1 if diffs or missing else 0)


def cmd_evil(a):
    """Rewrites --ckpt/.metadata with storage_meta replaced by an object whose unpickling
    would run os.system(--command): a reader that executes pickles creates --marker."""
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {a.marker}",))
    path = os.path.join(a.ckpt, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    md.storage_meta = Evil()
    with open(path, "wb") as f:
        pickle.dump(md, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["save", "continue", "compare", "evil"])
    p.add_argument("--marker")
    p.add_argument("--out")
    p.add_argument("--ckpt")
    p.add_argument("--ref")
    p.add_argument("--windows")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="save: tensor-parallel degree (torchtitan's Llama plan)")
    p.add_argument("--dp-shard", type=int, default=1, help="save with --tp: FSDP degree of the 2-D mesh")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--total-steps", type=int, default=5, help="training.steps of the run the schedule is for")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--decay-ratio", type=float, default=0.6)
    p.add_argument("--min-lr", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    {"save": cmd_save, "continue": cmd_continue, "compare": cmd_compare, "evil": cmd_evil}[a.cmd](a)


if __name__ == "__main__":
    main()
