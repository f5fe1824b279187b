"""Bad input, table-driven, across the commands: each exits non-zero with a short message
naming the problem (and the option), no Python traceback, before any rank starts."""
import json

import pytest

from meshtrain.cli.main import main

# (argv, a piece of the message)
CASES = [
    # train: counts and numbers
    ("train --nproc 0", "--nproc 0: give the number of local ranks"),
    ("train --nproc -1", "--nproc -1"),
    ("train --nproc abc", "invalid int value: 'abc'"),
    ("train --steps 0", "--steps 0: give a whole number >= 1"),
    ("train --steps -5", "--steps -5"),
    ("train --batch 0", "--batch 0: give a whole number >= 1"),
    ("train --batch 3", "global batch 3 does not split over dp=2"),
    ("train --lr -1", "--lr -1: the learning rate must be a positive number"),
    ("train --lr abc", "invalid float value: 'abc'"),
    ("train --optimizer adam", "invalid choice: 'adam'"),
    ("train --optimizer sgd --momentum 1", "--momentum 1: give a number in [0, 1)"),
    ("train --momentum -0.5", "--momentum -0.5: give a number in [0, 1)"),
    ("train --warmup -1", "--warmup -1"),
    ("train --seed -1", "--seed -1"),
    ("train --eval-every 0", "--eval-every 0"),
    ("train --ckpt-every 0", "--ckpt-every 0"),
    ("train --max-grad-norm 0", "max_grad_norm=0.0: must be a positive number"),
    ("train --max-grad-norm -1", "max_grad_norm=-1.0"),
    ("train --max-restarts -1", "--max-restarts -1"),
    ("train --collective-timeout 0", "--collective-timeout 0: give a positive number"),
    ("train --bucket-mb 0", "bucket_mb=0.0: must be a positive size"),
    ("train --microbatches 0", "microbatches=0: must be a whole number >= 1"),
    # train: data, folders, models
    ("train --data nowhere/file.txt", "--data nowhere/file.txt: no such file or folder"),
    ("train --data empty.txt", "--data empty.txt: the file is empty"),
    ("train --run-dir afile", "--run-dir afile: a file of that name exists"),
    ("train --zero 1 --offload disk --offload-dir afile/o",
     "--offload-dir afile/o: cannot create the offload folder there"),
    ("train --resume nowhere", "nowhere is not a meshtrain run folder"),
    ("train --resume notarun", "notarun is not a meshtrain run folder"),
    ("train --model nosuchpreset", "--model 'nosuchpreset' is unknown"),
    ("train --model nosuch.module:fn", "cannot import it"),
    ("train --init-from amodel/config.json", "amodel/config.json is a file; give the folder "
                                             "holding it and its weights: amodel"),
    ("train --layers 0", "n_layer=0: must be a whole number >= 1"),
    ("train --seq 0", "seq_len=0"),
    ("train --model hf-gpt2-tiny --seq 256", "--seq 256 is longer than the 128 positions "
                                             "GPT2LMHeadModel learned (transformer.wpe"),
    ("train --heads 3 --d-model 32", "d_model=32 is not divisible by n_head=3"),
    # train: plans
    ("train --tp 3 --nproc 3", "tp=3 does not divide the GPT's n_head=4"),
    ("train --dp 3 --nproc 2", "needs dp*pp*tp = 3 ranks but the world has 2"),
    ("train --zero 4", "invalid choice: 4"),
    ("train --precision fp8", "a CPU has no float8 matmuls; emulate them"),
    ("train --compile cudagraphs --device cpu", "--compile cudagraphs replays CUDA graphs, "
                                                "which need a GPU, and this run is on the CPU"),
    ("train --offload cpu", "offload='cpu' needs ZeRO"),
    ("train --offload-dir somewhere", "offload_dir (--offload-dir) is where offload='disk' writes"),
    ("train --sequence-parallel", "sequence_parallel=True splits activations over the tp axis"),
    ("train --dp-mode nonsense", "invalid choice: 'nonsense'"),
    ("train --schedule nonsense", "schedule='nonsense': choose one of"),
    ("train --nproc 2 --pp 2 --schedule interleaved --virtual-stages 2 --microbatches 3",
     "microbatches=3 must be a multiple of pp=2"),
    ("train --nproc 2 --tp 2 --sequence-parallel --seq 15",
     "use a sequence length that is a multiple of 2"),
    # context parallel (issue 45)
    ("train --nproc 2 --cp 2 --seq 14", "cuts each sequence into 2*cp = 4 equal chunks, but the "
                                        "sequence has 14 tokens"),
    ("train --nproc 4 --cp 4 --cp-style all-to-all --heads 2 --d-model 32",
     "scatters the attention heads over cp=4, but the model has 2 heads"),
    ("train --nproc 2 --cp 2 --model tests.multirank.own_model:build",
     "Recurrent exposes none meshtrain can replace"),
    ("train --nproc 2 --cp 2 --compile", "cp with compile is not built yet"),
    ("train --nproc 2 --cp 2 --link dp=1Gb/s", "--link with --cp 2 is not built yet"),
    ("train --nproc 8 --cp 4 --tp 2 --cp-style all-to-all",
     "the model has 2 heads and 2 key/value heads on each of tp=2 ranks"),
    ("train --nproc 8 --cp 2 --tp 4 --sequence-parallel --seq 20",
     "use a sequence length that is a multiple of 4"),
    ("train --nproc 2 --cp 2 --cp-style mesh", "invalid choice: 'mesh'"),
    # the data-parallel family
    ("train --dp-mode dp --nproc 2", "runs its 2 replicas as threads of one process"),
    ("train --nproc 2 --dp-mode ps-sync --ps-shards 3",
     "ps_shards=3 is more server shards than the dp=2 ranks"),
    ("train --nproc 2 --dp-mode ps-sync --staleness 1",
     "staleness=1 only applies to dp_mode='ps-async'"),
    ("train --nproc 2 --dp-mode ps-async --staleness -1", "staleness=-1"),
    ("train --nproc 2 --straggler 2:0.1", "rank 2 does not exist in a world of 2"),
    ("train --nproc 2 --straggler 1", "expected RANK:SECONDS"),
    ("train --nproc 2 --link xp=1Gb/s", "unknown axis 'xp'; use one of dp, pp, tp"),
    ("train --nproc 2 --link dp=fast", "bandwidth 'fast' does not start with a number"),
    ("train --nproc 2 --dp-mode ps-async --max-grad-norm 1",
     "max_grad_norm with dp_mode='ps-async'"),
    # slow links: DiLoCo and local SGD (issue 30)
    ("train --nproc 2 --dp-mode diloco --sync-every 0", "sync_every=0: must be a whole number"),
    ("train --nproc 2 --dp-mode diloco --outer-lr 0", "outer_lr=0.0: must be a number > 0"),
    ("train --nproc 2 --dp-mode diloco --outer-momentum 1", "outer_momentum=1.0: must be in"),
    ("train --nproc 1 --dp-mode local-sgd", "no other workers to sync with; set dp >= 2"),
    ("train --nproc 2 --dp-mode diloco --zero 1", "use zero=0"),
    ("train --nproc 2 --sync-every 8", "only applies to dp_mode='diloco'"),
    ("train --nproc 2 --compression powersgd --compression-rank 0",
     "compression_rank=0: must be a whole number >= 1"),
    ("train --nproc 2 --compression topk", "invalid choice: 'topk'"),
    ("train --nproc 2 --sync-warmup-steps 8", "delays a slow-link method"),
    ("train --nproc 2 --dp-mode diloco --sync-warmup-steps -1", "sync_warmup_steps=-1"),
    ("train --nproc 2 --compression powersgd --zero 1",
     "Plan(compression='powersgd') with zero=1"),
    ("train --nproc 2 --dp-mode local-sgd --max-grad-norm 1",
     "max_grad_norm with dp_mode='local-sgd' is not built"),
    ("train --nproc 2 --dp-mode diloco --precision bf16",
     "DiLoCo and local SGD run in fp32 for now"),
    # train: 3D plans (issue 13), refused before any rank starts
    ("train --dp 2 --pp 2 --tp 2 --nproc 4", "needs dp*pp*tp = 8 ranks but the world has 4"),
    ("train --dp 2 --pp 2 --tp 2 --nproc 8 --heads 3 --d-model 48",
     "tp=2 does not divide the GPT's n_head=3"),
    ("train --pp 2 --nproc 2 --layers 1 --schedule interleaved --virtual-stages 2 "
     "--microbatches 2", "--pp 2 x --virtual-stages 2 = 4 stages, but 'tiny' has 3 layers"),
    ("train --dp 2 --pp 2 --nproc 4 --batch 4 --microbatches 4",
     "each dp rank's batch of 2 does not split into --microbatches 4"),
    ("train --dp 2 --pp 2 --nproc 4 --dp-mode ps-sync",
     "dp_mode='ps-sync' with pp=2, tp=1: DP and the parameter server run with pp = tp = 1"),
    # plan
    ("plan", "no model: give --model PRESET"),
    ("plan --model nosuch", "unknown model preset 'nosuch'"),
    ("plan --model tiny --gpu-mem 80", "size '80' has no unit"),
    ("plan --model tiny --nodes 0", "--nodes 0"),
    ("plan --model tiny --global-batch 0", "--global-batch 0"),
    ("plan --model tiny --gpu NOSUCH", "unknown GPU preset 'NOSUCH'"),
    ("plan --model tiny --intra-bw fast", "bandwidth 'fast' does not start with a number"),
    ("plan --model tiny --top 0", "--top 0"),
    ("plan --model tiny --seq 0", "--seq 0"),
    ("plan --model tiny --efficiency 2", "efficiency=2.0: must be in (0, 1]"),
    ("plan --model tiny --optimizer nadam", "--optimizer 'nadam'"),
    ("plan --calibrate --nproc 0", "--nproc 0"),
    ("plan --verify --profile nowhere/profile.json", "no calibrated profile at"),
    # bench
    ("bench nosuch", "invalid choice: 'nosuch'"),
    ("bench zero --world 1", "world 1 needs to be >= 2"),
    ("bench ddp --world 3", "world 3 needs to be >= 2 and divide the global batch 16"),
    ("bench ddp --reps 0", "--reps 0"),
    ("bench slowlink --methods ddp nosuch", "unknown slowlink method(s) ['nosuch']"),
    ("bench slowlink --sync-warmup-steps 128", "--sync-warmup-steps 128: give 0 or more"),
    ("bench slowlink --eval-every 0", "--eval-every 0: give a whole number of steps"),
    ("bench slowlink --seq 0", "--seq 0: give a sequence length >= 1"),
    ("bench slowlink --batch 6", "--batch 6: give a multiple of the 4 ranks (--world)"),
    ("bench pp --microbatches 0", "--microbatches 0: each must be >= 1"),
    ("bench tp --model nosuch", "--model 'nosuch': the benchmarks run a GPT preset"),
    ("bench survival --runs 0", "--runs 0: give a whole number >= 1"),
    ("bench ep --model tiny", "--model 'tiny': bench ep runs a MoE preset"),
    ("bench ep --world 3 --batch 6", "--world 3: ep = world must divide mixtral-tiny's 4"),
    ("bench harness --world 1", "world 1 needs to be >= 2"),
    ("bench startup --against nowhere/bin/meshtrain", "--against nowhere/bin/meshtrain: no such"),
    ("bench single --device cuda", "--device cuda: no CUDA GPU is visible"),
    # schedule
    ("schedule --pp 0 --microbatches 4", "--pp 0: a pipeline needs at least 2 ranks"),
    ("schedule --pp 4 --microbatches 0", "microbatches=0: must be a whole number >= 1"),
    ("schedule --pp 4", "the following arguments are required: --microbatches"),
    ("schedule --pp 4 --microbatches 6 --schedule interleaved --virtual-stages 2",
     "microbatches=6 must be a multiple of pp=4"),
    ("schedule --pp 4 --microbatches 4 --virtual-stages 2",
     "virtual_stages=2 needs schedule='interleaved'"),
    ("schedule --pp 2 --microbatches 4 --schedule nosuch", "invalid choice: 'nosuch'"),
    ("schedule --pp 2 --microbatches 4 --out nowhere/x.png", "nowhere is not a writable folder"),
    ("schedule --pp 2 --microbatches 4 --out x.jpg", "--out x.jpg: give a file name ending in .png"),
    # train: pipeline plans
    ("train --pp 2 --nproc 2 --virtual-stages 2", "virtual_stages=2 needs schedule='interleaved'"),
    ("train --pp 2 --nproc 2 --microbatches 3 --batch 8",
     "each dp rank's batch of 8 does not split into --microbatches 3"),
    ("train --pp 9 --nproc 9 --layers 2", "stages, but 'tiny' has 4 layers"),
    # train: expert parallel
    ("train --nproc 4 --ep 3", "Plan(ep=3, dp=4): expert parallel takes its ranks"),
    ("train --nproc 3 --ep 3 --batch 6 --model mixtral-tiny",
     "4 experts do not split over 3 ranks"),
    ("train --nproc 2 --ep 2", "'tiny' has none; use --ep 1"),
    ("train --nproc 2 --ep 2 --model llama-tiny", "LlamaForCausalLM has none; use ep=1"),
    ("train --nproc 2 --model topk5.json", "num_experts_per_tok=5 is more than its 4 experts"),
    # the GPT's experts (gpt-moe-tiny: 4, top-2)
    ("train --model gpt-moe-tiny --top-k 5", "top_k=5 routes each token to more experts than "
                                             "the 4 each block has"),
    ("train --experts -1", "GPTConfig.experts=-1: must be a whole number >= 0"),
    ("train --top-k 2", "'tiny' has none (dense MLPs); add --experts N"),
    ("train --nproc 3 --ep 3 --batch 6 --model gpt-moe-tiny", "4 experts do not split over 3"),
    ("train --nproc 4 --ep 4 --experts 6", "6 experts do not split over 4 ranks"),
    ("train --nproc 2 --pp 2 --model gpt-moe-tiny --compile aot_eager",
     "compiled mixture-of-experts layers are not built under pipeline stages"),
    ("train --nproc 2 --tp 2 --sequence-parallel --model gpt-moe-tiny", "drop sequence_parallel"),
    ("train --model mixtral-tiny --experts 8", "whose config says 4 experts per layer, top-2"),
    ("train --nproc 2 --model mixtral-tiny --capacity-factor 0",
     "Plan.capacity_factor=0.0: must be a number > 0"),
    ("train --nproc 2 --capacity-factor 1", "'tiny' has none; drop --capacity-factor"),
    ("train --nproc 2 --model llama-tiny --capacity-factor 1.25",
     "LlamaForCausalLM has none; drop capacity_factor"),
    # export, generate, report
    ("export nowhere out.safetensors", "nowhere is not a meshtrain run folder"),
    ("export notarun out.txt", "out.txt: give a file name ending in .safetensors"),
    ("generate nowhere", "nowhere is not a meshtrain run folder"),
    ("report notarun", "notarun is not a meshtrain run folder"),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "notarun").mkdir()
    (tmp_path / "amodel").mkdir()   # a model folder, as save_pretrained writes one
    (tmp_path / "amodel" / "config.json").write_text(json.dumps(dict(model_type="llama")))
    (tmp_path / "topk5.json").write_text(json.dumps(dict(   # a MoE with top-k above its experts
        model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=5)))
    return tmp_path


def test_the_table_is_large_enough():
    assert len(CASES) >= 40
    assert {argv.split()[0] for argv, _ in CASES} >= {"train", "plan", "bench", "schedule",
                                                      "export"}


@pytest.mark.parametrize("argv, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_with_a_message(argv, message, workdir, capsys):
    try:
        code = main(argv.split())
    except SystemExit as exc:   # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code not in (0, None), f"{argv!r} was accepted"
    assert "Traceback" not in err
    assert message in err, err
    assert len(err.strip().splitlines()) <= 3 or "usage:" in err   # short
    assert not (workdir / "runs").exists()   # refused before a run folder was made


def test_a_failed_run_offers_resume_only_from_a_checkpoint_it_wrote(tmp_path):
    from meshtrain.cli.summary import after_failure

    assert "wrote no checkpoint" in after_failure(tmp_path)   # failed before its first save
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000004\n")
    assert f"(step_00000004): continue with --resume {tmp_path}" in after_failure(tmp_path)


def test_a_refused_checkpoint_names_the_earlier_ones_to_fall_back_on(tmp_path):
    from meshtrain.cli.summary import fall_back

    refusal = "checkpoint step_00000006: __0_0.distcp is corrupted; use an earlier checkpoint"
    (tmp_path / "checkpoints").mkdir()
    assert fall_back(refusal, tmp_path) == " (the run keeps none earlier: start it again)"
    for step in (2, 4, 6):
        (tmp_path / "checkpoints" / f"step_0000000{step}").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000006\n")
    assert fall_back(refusal, tmp_path) == (
        f" (the run keeps step_00000002, step_00000004: `echo step_00000004 > "
        f"{tmp_path / 'checkpoints' / 'latest'}`, then resume)")
    assert fall_back("the run's data differs", tmp_path) == ""


def test_the_same_error_on_every_rank_is_said_once_and_whole():
    from types import SimpleNamespace

    from meshtrain.launch import _culprits

    why = ("offload='disk' cannot write to /proc/nope (No such file or directory); give a "
           "writable folder (Plan(offload_dir=...), --offload-dir)")
    raised = {1: dict(type="PlanError", message=why), 0: dict(type="PlanError", message=why),
              2: dict(type="ValueError", message="other\nTraceback ...")}
    assert _culprits(SimpleNamespace(failures={}), raised, []) == [
        f"ranks 0, 1 raised PlanError: {why}", "rank 2 raised ValueError: other"]


def test_a_new_run_into_a_folder_holding_a_run_is_refused(workdir, capsys):
    run = workdir / "runs" / "old"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_00000030\n")
    code = main(["train", "--steps", "2", "--run-dir", str(run), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (f"--run-dir {run} holds a run already (config.json, last checkpoint step_00000030): "
            f"continue it with --resume {run}") in err
    assert sorted(p.name for p in run.rglob("*")) == ["checkpoints", "config.json", "latest"]
    (workdir / "fresh").mkdir()   # an empty folder made beforehand is a new run's to fill
    from meshtrain.cli.train_cmd import check_new_run_dir
    check_new_run_dir(workdir / "fresh")


def test_a_full_disk_is_named_and_the_errors_kept_when_failure_log_cannot_be(tmp_path, capsys):
    from meshtrain.cli.summary import failure_cause
    from meshtrain.cli.train_cmd import _keep_failure
    from meshtrain.launch import LaunchError

    full = LaunchError("rank 0 failed: ...", {0: {
        "type": "CheckpointException", "message": "CheckpointException ranks:dict_keys([0])",
        "traceback": "OSError: [Errno 28] No space left on device\n"}},
        ["rank 0 raised CheckpointException: CheckpointException ranks:dict_keys([0])"])
    assert failure_cause(full).startswith("the disk holding the run folder is full")
    other = LaunchError("rank 1 failed", {}, ["rank 1 died without an error of its own"])
    assert failure_cause(other) == "rank 1 died without an error of its own"
    (tmp_path / "file").write_text("")
    said = _keep_failure(full, tmp_path / "file" / "failure.log")   # cannot be written
    assert said == ("Each rank's error in full above (" + str(tmp_path / "file" / "failure.log")
                    + " could not be written: Not a directory).")
    assert "rank 0 failed: ..." in capsys.readouterr().err
    assert _keep_failure(full, tmp_path / "failure.log").startswith("Each rank's error in full: ")
    assert (tmp_path / "failure.log").read_text() == "rank 0 failed: ...\n"


def test_an_export_that_cannot_be_written_leaves_nothing_and_says_why(tmp_path):
    from safetensors import SafetensorError

    from meshtrain.cli.export_cmd import _writing

    for tmp in (tmp_path / "model.tmp", tmp_path / "w.safetensors.tmp"):   # folder, file
        with pytest.raises(OSError, match=r"cannot write .*out: I/O error: No space left on "
                                          r"device \(os error 28\); free space there"):
            with _writing(tmp, tmp_path / "out"):
                if tmp.suffix == ".tmp" and "model" in tmp.name:
                    tmp.mkdir()
                    (tmp / "config.json").write_text("{}")
                else:
                    tmp.write_bytes(b"half")
                raise SafetensorError("I/O error: No space left on device (os error 28)")
        assert not tmp.exists()


def test_a_folder_export_shows_the_bytes_written_on_a_terminal(tmp_path, monkeypatch):
    import io
    import sys

    import torch

    from meshtrain.cli.export_cmd import write_shards

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    shown = Terminal()
    monkeypatch.setattr(sys, "stderr", shown)
    entries = {"a": ((64, 64), torch.float32), "b": ((64,), torch.float32)}
    write_shards(tmp_path, entries, lambda group: {k: torch.zeros(shape, device="cpu")
                                                  for k, (shape, _) in group.items()},
                 shard_bytes=64 * 64 * 4, progress=True)
    assert "export: 100%" in shown.getvalue() and "16.6k/16.6k" in shown.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir())[:2] == ["model-00001-of-00002.safetensors",
                                                             "model-00002-of-00002.safetensors"]
