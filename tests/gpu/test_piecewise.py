"""Piecewise CUDA graphs (``engine.worker.piecewise``) on the GPU: steps with prompt chunks replayed from the
captured pieces, their attention run eagerly between them, give the tokens of the same padded forward run
eagerly (``--cuda-graphs 0``: the same kernels on the same shapes) and of the ragged eager forward."""
import torch

from engine.worker.model_worker import ModelWorker, WorkerConfig
from tests.step_scenarios import assert_same, run_pipelined, run_steps, scenario
from tests.tiny_models import save_tiny_model

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32)


def new_worker(path, graphs) -> ModelWorker:
    return ModelWorker(WorkerConfig(model_dir=str(path), dtype=torch.float32, device=torch.device("cuda"),
                                    kernel_backend="triton", max_requests=8, max_seq_len=256, num_slots=4096,
                                    warmup_tokens=64,
                                    cuda_graphs=graphs))


def test_piecewise_graph_steps_equal_the_padded_eager_steps_and_the_ragged_forward(tmp_path):
    path = save_tiny_model("llama3", tmp_path / "llama3", **SHAPE)
    steps = scenario()
    captured = new_worker(path, None)
    assert captured.piecewise is not None and sorted(captured.piecewise.graphs) == [16, 32, 64]
    replays, original = [], captured.piecewise.run
    captured.piecewise.run = lambda step, meanwhile=None: replays.append(len(step.rows)) or original(step, meanwhile)
    with_graphs = run_steps(captured, steps)
    assert len(replays) == 5          # the steps with prompt tokens, but the one over 64 tokens
    padded_eager = new_worker(path, ())
    assert padded_eager.piecewise is not None and not padded_eager.piecewise.graphs
    assert_same(with_graphs, run_steps(padded_eager, steps), 1e-5)
    ragged = new_worker(path, ())
    ragged.piecewise = None
    assert_same(with_graphs, run_steps(ragged, steps), 1e-3)


def test_results_taken_between_the_replayed_pieces_of_the_next_step_are_the_same(tmp_path):
    """The shard process takes a step's result between the pieces of the next step's launch once the device
    finished it (``engine.worker.process``): the same tokens and logprobs as steps run one at a time."""
    path = save_tiny_model("llama3", tmp_path / "llama3", **SHAPE)
    steps = scenario()
    worker = new_worker(path, None)
    rows, calls = run_pipelined(worker, steps)
    assert_same(rows, run_steps(new_worker(path, None), steps), 1e-5)
    assert sorted(set(calls)) == [0, SHAPE["num_hidden_layers"]] and calls.count(SHAPE["num_hidden_layers"]) == 5
