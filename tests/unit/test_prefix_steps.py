"""bench.prefix_steps --profile: the profiled ops (kernels on CUDA), largest first."""
import torch

from bench import prefix_steps


def test_print_kernels_lists_the_profiled_ops_largest_first(capsys):
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiler.start()
    a = torch.randn(256, 256)
    for _ in range(5):
        a = torch.tanh(a @ a)
    profiler.stop()
    ops = prefix_steps.print_kernels(profiler, top=3)
    assert "aten::mm" in ops and all(ms > 0 for ms in ops.values())
    assert list(ops.values()) == sorted(ops.values(), reverse=True)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("ops until every first token") and len(printed) == 4
