"""The default AdamW: fused on CUDA, foreach elsewhere, and the same numbers as the plain loop."""
import torch

from meshtrain.train.optimizers import fastest_implementation, default_adamw, run_optimizer


def test_cpu_params_get_foreach_and_match_the_loop_implementation():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt = default_adamw(a, lr=1e-2, weight_decay=0.1)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        for ps, o in ((a, opt), (b, ref)):
            for p in ps:
                p.grad = torch.sin(p.detach() * 3)
            o.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)   # foreach: fp32 round-off
    assert fastest_implementation([{"params": a}]) == {"foreach": True}
    assert fastest_implementation([]) == {"foreach": True}


def test_cuda_params_get_fused():
    class FakeCuda:   # is_cuda is what the choice reads; no CUDA on a CPU runner
        is_cuda = True

        def is_floating_point(self):
            return True
    assert fastest_implementation([FakeCuda(), {"params": [FakeCuda()]}]) == {"fused": True}


def test_the_run_optimizer_is_adamw_or_sgd_with_momentum_and_no_weight_decay():
    p = [torch.nn.Parameter(torch.ones(3))]
    adamw = run_optimizer(p, "adamw", lr=1e-3, weight_decay=0.1, momentum=0.9)
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["weight_decay"] == 0.1
    sgd = run_optimizer(p, "sgd", lr=0.1, weight_decay=0.1, momentum=0.8)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["foreach"] is True
    assert (sgd.defaults["momentum"], sgd.defaults["weight_decay"], sgd.defaults["lr"]) == (0.8, 0, 0.1)


def test_train_takes_the_optimizers_own_default_learning_rate():
    from meshtrain.cli.main import build_parser
    from meshtrain.cli.train_cmd import build_config
    for argv, optimizer, lr in ((["train"], "adamw", 3e-3),
                                (["train", "--optimizer", "sgd"], "sgd", 0.1),
                                (["train", "--optimizer", "sgd", "--lr", "0.05"], "sgd", 0.05)):
        config = build_config(build_parser().parse_args(argv + ["--device", "cpu"]))
        assert (config.optimizer, config.lr, config.momentum) == (optimizer, lr, 0.9)


def test_a_short_run_reaches_its_learning_rate():
    from meshtrain.cli.main import build_parser
    from meshtrain.cli.train_cmd import build_config
    from meshtrain.train.config import learning_rate
    for argv, warmup in (([], 30), (["--steps", "4"], 1), (["--steps", "40"], 10),
                         (["--steps", "4", "--warmup", "10"], 10)):
        config = build_config(build_parser().parse_args(["train", "--device", "cpu", *argv]))
        assert config.warmup == warmup, argv
    short = build_config(build_parser().parse_args(["train", "--device", "cpu", "--steps", "4"]))
    assert learning_rate(short, short.steps - 1) == short.lr
