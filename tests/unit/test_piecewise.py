"""Piecewise steps (``engine.worker.piecewise``): the padded forward, split at every layer's attention, gives
what the ragged eager forward gives. On a CPU the pieces run eagerly (graphs need CUDA) through the same
padding, inputs and attention hook that the graphs replay; tests/gpu/test_piecewise.py replays the graphs."""
import pytest
import torch

from engine.protocol.messages import StepRow
from engine.worker.forward_batch import ragged_inputs
from engine.worker.model_worker import ModelWorker, WorkerConfig
from engine.worker.piecewise import PiecewiseGraphs, row_inputs
from tests.step_scenarios import assert_same, run_pipelined, run_steps, scenario
from tests.tiny_models import save_tiny_model

LOGPROB_TOL = 1e-4


def new_worker(path, backend: str) -> ModelWorker:
    return ModelWorker(WorkerConfig(model_dir=str(path), dtype=torch.float32, device=torch.device("cpu"),
                                    kernel_backend=backend, max_requests=8, max_seq_len=256, num_slots=1024))


# a rope scaling that reads every token's sequence length (phi3's longrope), no rotary at all (bloom's
# ALiBi), sliding windows and soft-caps (gemma2), experts (qwen3_moe), GQA with llama3's rope
@pytest.mark.parametrize("family", ["llama3", "phi3", "bloom", "gemma2", "qwen3_moe"])
def test_piecewise_steps_give_the_eager_steps_tokens_and_logprobs(tmp_path, family):
    path = save_tiny_model(family, tmp_path / family)
    steps = scenario()
    eager = run_steps(new_worker(path, "torch"), steps)
    worker = new_worker(path, "torch")
    worker.piecewise = PiecewiseGraphs(worker.model, worker.ops, worker.kv_cache, worker.last_tokens, max_tokens=64,
                                       use_graphs=False)
    used, original = [], worker.piecewise.run
    worker.piecewise.run = lambda step, meanwhile=None: (used.append(sum(len(r.input_ids) for r in step.rows))
                                                         or original(step, meanwhile))
    assert worker.piecewise.buckets == [16, 32, 64]
    assert_same(run_steps(worker, steps), eager, LOGPROB_TOL)
    # every step but the 76-token one (no decoder on a CPU: its decode steps come here too)
    assert used == [14, 9, 9, 16, 25, 7, 7, 7]


@pytest.mark.parametrize("family,plans", [("llama3", 1), ("gemma2", 2)])
def test_the_kernels_write_the_attention_into_the_buffer_the_next_piece_reads(tmp_path, monkeypatch, family, plans):
    """Under the Triton interpreter the kernels themselves take ``out=`` (the graphs' attention output). A step
    checks and plans its attention once for the layers alike (gemma2: its sliding-window layers and its global
    ones), then runs it on every layer."""
    import kernels.prefill_attention as module
    path = save_tiny_model(family, tmp_path / family)
    steps = scenario()[:4]
    eager = run_steps(new_worker(path, "torch"), steps)
    worker = new_worker(path, "triton")
    worker.piecewise = PiecewiseGraphs(worker.model, worker.ops, worker.kv_cache, worker.last_tokens, max_tokens=32,
                                       use_graphs=False)
    counts = []
    original_init, original_call = module.PrefillCall.__init__, module.PrefillCall.__call__
    monkeypatch.setattr(module.PrefillCall, "__init__",
                        lambda self, *a, **k: counts[-1].__setitem__(0, counts[-1][0] + 1) or original_init(self, *a, **k))
    monkeypatch.setattr(module.PrefillCall, "__call__",
                        lambda self, *a, **k: counts[-1].__setitem__(1, counts[-1][1] + 1) or original_call(self, *a, **k))
    run = worker.piecewise.run
    worker.piecewise.run = lambda step, meanwhile=None: counts.append([0, 0]) or run(step, meanwhile)
    assert_same(run_steps(worker, steps), eager, LOGPROB_TOL)
    layers = worker.model_config.num_layers
    assert counts and all(c == [plans, layers] for c in counts), counts


def test_the_previous_steps_result_taken_between_the_layers_of_the_next_launch_is_the_same(tmp_path):
    """``launch(step, meanwhile)``: the shard process sends the previous step's result from between the layers of
    the next step's launch once the device finished it (``engine.worker.process``). Taken there, every step's
    tokens and logprobs are those of steps run one at a time; ``meanwhile`` runs after each layer's attention."""
    path = save_tiny_model("llama3", tmp_path / "llama3")
    steps = scenario()
    eager = run_steps(new_worker(path, "torch"), steps)
    worker = new_worker(path, "torch")
    worker.piecewise = PiecewiseGraphs(worker.model, worker.ops, worker.kv_cache, worker.last_tokens, max_tokens=64,
                                       use_graphs=False)
    rows, calls = run_pipelined(worker, steps)
    assert_same(rows, eager, LOGPROB_TOL)
    layers = worker.model_config.num_layers
    assert calls == [layers, layers, layers, layers, layers, 0, layers, layers, layers]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_every_per_row_input_of_the_attention_starts_16_byte_aligned(rows):
    """Triton compiles a kernel per pointer alignment class: per-row inputs packed back to back (an odd row count)
    compiled the prefill attention anew mid-serving, 4.2 s on one H100."""
    x = ragged_inputs([StepRow(i, i, 3, [5] * (i + 1), list(range(i + 1)), sample=True) for i in range(rows)])
    inputs = row_inputs(x, None, torch.device("cpu"))
    for t in inputs[:4]:
        assert t.data_ptr() % 16 == 0 and t.shape == (rows,) and t.dtype == torch.int32
    assert inputs.req_rows.tolist() == list(range(rows)) and inputs.q_len.tolist() == [i + 1 for i in range(rows)]
    assert inputs.seq_len.tolist() == [i + 4 for i in range(rows)] and inputs.q_start.tolist() == x.q_start
    assert (inputs.max_q_len, inputs.max_seq_len, inputs.tokens) == (rows, rows + 3, len(x.input_ids))


def test_captures_that_do_not_fit_leave_the_steps_eager_with_one_warning(tmp_path, monkeypatch, caplog):
    from engine.worker import model_worker

    worker = new_worker(save_tiny_model("llama", tmp_path / "llama"), "torch")

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(model_worker, "PiecewiseGraphs", out_of_memory)
    with caplog.at_level("WARNING", logger=model_worker.__name__):
        assert worker._piecewise_graphs(capture=True) is None
    assert [r.getMessage() for r in caplog.records] == [
        "piecewise CUDA graphs not captured (CUDA out of memory. Tried to allocate 2.00 GiB): steps with prompt "
        "tokens run eagerly; a lower --cuda-memory-fraction leaves them room"]


def test_piecewise_steps_take_long_contexts_through_the_context_path(tmp_path):
    """A prompt's later chunks (beside decode rows) behind 16+ keys attend to them through
    ``kernels.context_attention`` (bucket 16, piece 8; the CPU's torch stand-in for cuDNN) inside the piecewise
    steps, under the Triton interpreter: the eager torch worker's tokens and logprobs."""
    from engine.protocol.messages import Step
    from tests.step_scenarios import Requests, prompt

    path = save_tiny_model("llama3", tmp_path / "llama3")
    r = Requests()
    steps = [Step([r.chunk(0, prompt(6, 0), True), r.chunk(1, prompt(20, 1), False)]),
             Step([r.decode(0), r.chunk(1, prompt(20, 2), False)]),
             Step([r.decode(0), r.chunk(1, prompt(12, 3), True, logprob_targets=prompt(12, 4))]),
             Step([r.decode(0), r.decode(1)])]
    eager = run_steps(new_worker(path, "torch"), steps)
    worker = ModelWorker(WorkerConfig(model_dir=str(path), dtype=torch.float32, device=torch.device("cpu"),
                                      kernel_backend="triton", max_requests=8, max_seq_len=256, num_slots=1024,
                                      context_attention=(16, 8)))
    worker.piecewise = PiecewiseGraphs(worker.model, worker.ops, worker.kv_cache, worker.last_tokens, max_tokens=32,
                                       use_graphs=False, context=worker.context_attention)
    sent, attend = [], worker.context_attention.attend
    worker.context_attention.attend = lambda rows, *a: sent.append([(x.q_len, x.keys) for x in rows]) or attend(rows,
                                                                                                                *a)
    assert_same(run_steps(worker, steps), eager, LOGPROB_TOL)
    layers = worker.model_config.num_layers
    assert sent == [[(16, 16)]] * layers + [[(8, 32)]] * layers      # whole pieces: each chunk's last 4 tokens walk
    #                                                                  their context in the kernel
