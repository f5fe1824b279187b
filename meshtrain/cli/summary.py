"""The summary `meshtrain train` prints when a run ends: the data (and its validation split),
losses, speed and MFU, bytes sent, memory per rank (and per GPU where there is one), and the
emulated link if any; the run's picture; what a failed run leaves to continue from."""
from __future__ import annotations


def _beyond(m: dict) -> str:
    """The training peak taken apart: the runtime's fixed cost, what is accounted, the rest."""
    if m.get("runtime") is None or m.get("unaccounted") is None:
        return ""
    return (f" = runtime {_mib(m['runtime'])} + accounted {_mib(m['accounted'])} + "
            f"unaccounted {_mib(m['unaccounted'])}")


def _mib(n) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _loss_parts(parts: dict | None) -> list[str]:
    """The last step's loss in its parts, where it has several (a mixture of experts)."""
    if not parts:
        return []
    return [f"  its parts   cross-entropy {parts['cross_entropy']:.4f}, router load-balancing "
            f"{parts['router_aux']:.4f} (x router_aux_loss_coef)"]


def _expert_load(load: dict | None) -> list[str]:
    """The last step's tokens per expert (expert parallel): each layer's, and the imbalance;
    the choices a capacity factor dropped."""
    lines = []
    if load and "expert_tokens" in load:
        layers = "; ".join(" ".join(str(n) for n in layer) for layer in load["expert_tokens"])
        lines.append(f"experts       tokens per expert, last step, by layer: {layers} "
                     f"(imbalance max/mean {load['expert_imbalance']:.2f})")
    if load and "expert_dropped" in load:
        lines.append(f"dropped       choices over capacity, last step, by layer: "
                     f"{' '.join(map(str, load['expert_dropped']))} "
                     f"({load['expert_drop_fraction']:.2%} of the top-k choices)")
    return lines


def print_summary(s: dict) -> None:
    ratio = s["val_loss_end"] / s["val_loss_start"]
    lines = [
        "",
        f"plan          {s['plan']}, {s['steps']} steps"
        + (f" (resumed at step {s['resumed_from']})" if s["resumed_from"] else "")
        + (f"; restarted {s['restarts']}x after a rank failed" if s.get("restarts") else ""),
        *([f"data          {s['data']}"] if s.get("data") else []),
        f"train loss    {s['train_loss_start']:.4f} -> {s['train_loss_end']:.4f}",
        *_loss_parts(s.get("train_loss_parts_end")),
        *_expert_load(s.get("expert_load_end")),
        f"val loss      {s['val_loss_start']:.4f} -> {s['val_loss_end']:.4f} ({ratio:.2f}x)",
        f"throughput    {s['tokens_per_s']:,.0f} tokens/s (median step {s['median_step_s'] * 1e3:.1f} ms; "
        f"first step done {s['first_step_after_s']:.1f} s after the command started)",
        f"MFU           {s['mfu']:.2%} ({s['flops_per_token']:.3g} FLOPs/token; peak "
        f"{s['peak_flops'] / 1e12:.3g} TFLOP/s per device, {s['peak_source']})",
        f"communicated  {_mib(s['bytes_sent_per_step'])} sent per rank per step",
    ]
    for rank, m in enumerate(s["memory_per_rank"]):
        act = _mib(m["activations"]) if m["activations"] is not None else "n/a"
        extra = "".join([f", on disk {_mib(m['offloaded'])}" if m.get("offloaded") else "",
                         f", gathered at most {_mib(m['gathered_peak'])}"
                         if m.get("gathered_peak") else "",
                         f", gradient buckets at most {_mib(m['gradients_in_flight'])}"
                         if m.get("gradients_in_flight") else "",
                         f", staging at most {_mib(m['staging'])}" if m.get("staging") else ""])
        host = (f" ({_mib(m['optimizer_on_host'])} of it in host memory)"
                if m.get("optimizer_on_host") else "")
        lines.append(f"memory rank {rank}  params {_mib(m['parameters'])}, grads "
                     f"{_mib(m['gradients'])}, optimizer {_mib(m['optimizer_states'])}{host}"
                     f"{extra}, activations {act}, process peak {_mib(m['peak_process'])}")
        if m.get("build_peak") is not None:
            lines.append(f"  rank {rank} peaks  building {_mib(m['build_peak'])}; training "
                         f"{_mib(m['peak_process'])}" + _beyond(m))
        if m.get("checkpoint_peak"):
            lines.append(f"  rank {rank} peak   checkpointing {_mib(m['checkpoint_peak'])} (its "
                         f"share of the state {_mib(m['checkpoint_share'])})")
        if m.get("device_peak") is not None:
            lines.append(f"  GPU rank {rank}   allocated {_mib(m['device_allocated'])}, peak "
                         f"allocated {_mib(m['device_peak'])}; host pinned "
                         f"{_mib(m.get('host_pinned') or 0)}")
    if s.get("link_emulation"):
        lines.append(f"link          {s['link_emulation']}")
    lines += [f"run folder    {s['run_dir']}",
              f"checkpoint    {s['checkpoint']}", ""]
    print("\n".join(lines))


def after_failure(run_dir, failed: bool = True) -> str:
    """What a failed (or, `failed` False, interrupted) run leaves to continue from: its last
    checkpoint, or nothing (a run stopped before its first checkpoint is started again)."""
    from meshtrain.train.config import latest_checkpoint
    from meshtrain.train.errors import CheckpointError

    try:
        kept = latest_checkpoint(run_dir)
    except CheckpointError:
        kept = None
    if kept is None or not kept.is_dir():
        over = f" (--resume {run_dir} starts it over in its folder)"
        return (f"It wrote no checkpoint: fix the cause and start the run again{over}." if failed
                else f"It wrote no checkpoint: start the run again{over}.")
    restarts = " (or add --max-restarts K to restart on a failure)" if failed else ""
    return (f"The run folder keeps its last checkpoint ({kept.name}): continue with --resume "
            f"{run_dir}{restarts}.")


def failure_cause(exc) -> str:
    """A failed launch's cause in a line: each rank's (launch.LaunchError.culprits), or, where
    a rank ran out of disk (a checkpoint, metrics), that and what to do."""
    if any("No space left on device" in info.get("traceback", "")
           for info in exc.raised.values()):
        return ("the disk holding the run folder is full (No space left on device): free "
                "space there, or move the run folder to a larger disk")
    return "; ".join(exc.culprits) or "a rank failed"


def fall_back(refusal, run_dir) -> str:
    """How to resume from an earlier checkpoint when the latest cannot be loaded (the
    refusal says to use one): the ones the run keeps, and the pointer to move."""
    from pathlib import Path

    if "use an earlier checkpoint" not in str(refusal):
        return ""
    folder = Path(run_dir) / "checkpoints"
    latest = folder / "latest"
    newest = latest.read_text().strip() if latest.is_file() else "step_99999999"
    earlier = sorted(p.name for p in folder.glob("step_*") if p.is_dir() and p.name < newest)
    if not earlier:
        return " (the run keeps none earlier: start it again)"
    return (f" (the run keeps {', '.join(earlier)}: `echo {earlier[-1]} > {latest}`, then "
            "resume)")


def print_report(run_dir) -> None:
    """Draw the run's picture beside its summary; a failure to draw never fails the run."""
    from meshtrain.cli.report_cmd import write_report
    try:
        out, _ = write_report([run_dir])
    except Exception as exc:   # noqa: BLE001 - the training itself succeeded
        print(f"report        not drawn ({type(exc).__name__}: {exc})")
        return
    print(f"report        {out}")
