"""Prompt chunks' long contexts through cuDNN (the CPU: its torch stand-in), then the prefill kernel from there
(``kernels.context_attention``): the same attention as the prefill kernel's walk of every key."""
import pytest
import torch
from kernel_inputs import ATTENTION_TOL, ON_GPU
from test_prefill_attention_kernel import prefill_inputs

from kernels.context_attention import ContextAttention, piece_starts, tail_walks
from kernels.prefill_attention import PrefillCall, launch, prefill_attention, prefill_attention_ref, prefill_launch
from kernels.score_mods import ScoreMods

# (bucket, piece) small enough for the interpreter; on the GPU cuDNN builds a graph per shape (a few)
BUCKET, PIECE = (32, 16) if not ON_GPU else (256, 128)
DTYPE = torch.float32 if not ON_GPU else torch.bfloat16
S = PIECE // 16     # the layouts below in units of PIECE / 16 tokens
# (new tokens, cached keys) per request: a chunk behind two buckets and a bit (two pieces and a tail of half a piece,
# which walks its context in the kernel), one behind exactly one bucket (one piece), one too short for a piece, a
# decode row, a chunk behind less than a bucket, a chunk behind a bucket and a bit (a piece and a tail of more than
# half a piece: a second piece overlapping the first): the first two and the last take the context path
LAYOUT = ([40 * S, 16 * S, 8 * S, 1, 20 * S, 28 * S], [70 * S, 32 * S, 100 * S, 50 * S, 10 * S, 40 * S])


def context_for(args, bucket=BUCKET, piece=PIECE, max_keys=1 << 20, max_tokens=None):
    q = args[0]
    kv_heads = args[1].shape[1] // 2
    return ContextAttention(q.shape[1], kv_heads, q.shape[2], q.dtype, q.device, max_keys,
                            max_tokens or q.shape[0], bucket, piece)


def plan_for(context, args):
    q, _, _, rows, q_start, q_len, seq_len = args[:7]
    return context.plan(rows.tolist(), q_start.tolist(), q_len.tolist(), seq_len.tolist())


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 1), (4, 2), (2, 2)])
def test_long_contexts_through_cudnn_give_the_prefill_attention(device, q_heads, kv_heads):
    args = prefill_inputs(*LAYOUT, q_heads, kv_heads, 64 if ON_GPU else 32, DTYPE, device)
    plan = plan_for(context_for(args), args)
    q_start = args[4].tolist()
    rows = args[3].tolist()
    assert [(r.req_row, r.q_start, r.q_len, r.keys) for r in plan.rows] == [
        (rows[0], q_start[0], 32 * S, 64 * S), (rows[1], q_start[1], 16 * S, 32 * S),
        (rows[5], q_start[5], 28 * S, 32 * S)]
    # the kernel's rows (req_row, q_start, q_len, seq_len, first): the first row's tail first, as a row of its own
    assert [tuple(r) for r in plan.kernel_rows.t().tolist()] == [
        (rows[0], q_start[0] + 32 * S, 8 * S, 110 * S, 0), (rows[0], q_start[0], 32 * S, 102 * S, 64 * S),
        (rows[1], q_start[1], 16 * S, 48 * S, 32 * S), (rows[2], q_start[2], 8 * S, 108 * S, 0),
        (rows[3], q_start[3], 1, 50 * S + 1, 0), (rows[4], q_start[4], 20 * S, 30 * S, 0),
        (rows[5], q_start[5], 28 * S, 68 * S, 32 * S)]
    assert plan.max_walk == 110 * S     # the tail's keys
    out = prefill_attention(*args, context=plan)
    expected = prefill_attention_ref(*args)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, **tolerance())


def tolerance():
    atol, rtol = ATTENTION_TOL[DTYPE]
    return {"atol": atol, "rtol": rtol}


@pytest.mark.parametrize("splits", [2, 3])
def test_context_rows_with_split_keys_give_the_prefill_attention(device, splits):
    """The kernel's keys after the context split in parts (merged after): only split 0 starts from cuDNN's result."""
    args = prefill_inputs([16 * S, 1], [40 * S, 90 * S], 4, 1, 64 if ON_GPU else 32, DTYPE, device)
    context = context_for(args)
    plan = plan_for(context, args)
    assert [r.keys for r in plan.rows] == [32 * S]
    out = launch(*args, params=prefill_launch(args[0].shape[2], device, DTYPE), splits=splits, context=plan)
    torch.testing.assert_close(out, prefill_attention_ref(*args), **tolerance())


def calls_recorded(monkeypatch) -> list[tuple[int, int]]:
    """(queries, keys) of each cuDNN call (the CPU: its torch stand-in) from now on."""
    import kernels.context_attention as module
    name = "_attend_piece" if ON_GPU else "_attend_piece_ref"
    real, seen = getattr(module, name), []
    record = lambda q, keys, *a: seen.append((q.shape[0], keys.shape[0])) or real(q, keys, *a)  # noqa: E731
    monkeypatch.setattr(module, name, record)
    return seen


@pytest.mark.parametrize("decode_rows,tail", [(0, 0), (1, 0), (0, PIECE // 2)])
def test_a_row_of_a_whole_bucket_takes_one_call(device, monkeypatch, decode_rows, tail):
    """A chunk of exactly a bucket's tokens (and a tail, a kernel row of its own): one cuDNN call of them all. Alone
    at token 0 the kernel starts from that call's output as it is; behind a decode row (at token 1) the output is
    copied into the buffers, as a piece's."""
    args = prefill_inputs([1] * decode_rows + [BUCKET + tail], [50 * S] * decode_rows + [2 * BUCKET + 5], 4, 2,
                          64 if ON_GPU else 32, DTYPE, device)
    context = context_for(args)
    plan = plan_for(context, args)
    seen = calls_recorded(monkeypatch)
    _, mid_out, _ = plan.start(*args[:3], args[7])
    assert seen == [(BUCKET, 2 * BUCKET)]
    assert (mid_out.data_ptr() == context.mid_out.data_ptr()) is bool(decode_rows)
    torch.testing.assert_close(prefill_attention(*args, context=plan), prefill_attention_ref(*args), **tolerance())


def test_a_row_longer_than_a_bucket_or_buffers_short_of_one_take_pieces(device, monkeypatch):
    args = prefill_inputs([BUCKET + PIECE], [BUCKET], 2, 1, 32, DTYPE, device)
    seen = calls_recorded(monkeypatch)
    plan_for(context_for(args), args).start(*args[:3], args[7])
    assert seen == [(PIECE, BUCKET)] * (BUCKET // PIECE + 1)
    assert context_for(args).calls(BUCKET) == [(0, BUCKET)]
    pieces = [(start, PIECE) for start in range(0, BUCKET, PIECE)]
    assert context_for(args, max_tokens=BUCKET - 1).calls(BUCKET) == pieces


def test_the_plan_leaves_steps_it_cannot_hold_and_caps_the_keys(device):
    args = prefill_inputs([16 * S], [100 * S], 2, 1, 32, DTYPE, device)
    assert plan_for(context_for(args, max_tokens=16 * S - 1), args) is None          # more tokens than its buffers
    context = context_for(args, max_keys=40 * S)
    assert context.max_keys == 32 * S       # whole buckets
    plan = plan_for(context, args)
    assert [r.keys for r in plan.rows] == [32 * S] and plan.max_walk == 116 * S - 32 * S
    torch.testing.assert_close(prefill_attention(*args, context=plan), prefill_attention_ref(*args), **tolerance())
    assert not context_for(args, max_keys=BUCKET - 1).enabled
    assert context.plan([0, 1], [0, 1], [1, 1], [90 * S, 90 * S]) is None     # decode rows only, long contexts
    assert context.plan([0, 1], [0, PIECE - 1], [PIECE - 1, 1], [90 * S, 90 * S]) is None


def test_score_mods_a_shared_prefix_or_a_quantized_cache_set_the_context_aside(device):
    """Their rows walk every key in the kernel (the result of a window is the window's, not the plain one)."""
    args = prefill_inputs(*LAYOUT, 4, 2, 32, DTYPE, device)
    plan = plan_for(context_for(args), args)
    window = ScoreMods(window=9 * S)
    call = PrefillCall(*args, mods=window, context=plan)
    assert call.context is None
    torch.testing.assert_close(call(args[0], args[1]), prefill_attention_ref(*args, mods=window), **tolerance())
    assert PrefillCall(*args, context=plan).context is plan
    params = prefill_launch(args[0].shape[2], device, DTYPE)
    torch.testing.assert_close(launch(*args, params=params, mods=window, context=plan),
                               prefill_attention_ref(*args, mods=window), **tolerance())


@pytest.mark.parametrize("q_len,piece,starts", [(16, 16, [0]), (40, 16, [0, 16, 24]), (48, 16, [0, 16, 32]),
                                                (17, 16, [0, 1])])
def test_pieces_cover_a_row_and_end_at_its_last_token(q_len, piece, starts):
    assert piece_starts(q_len, piece) == starts


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_the_kernels_rows_start_16_byte_aligned(device, rows):
    """Each of the plan's five row arrays starts 16-byte aligned, whatever the row count (a chunk with a tail is two
    rows): Triton compiles a kernel per pointer alignment class, and the step's own arrays are aligned."""
    args = prefill_inputs([20 * S] + [1] * (rows - 1), [32 * S] * rows, 2, 1, 32, DTYPE, device)
    plan = plan_for(context_for(args), args)
    assert plan.kernel_rows.shape == (5, rows + 1)     # the chunk's tail is a row of its own
    assert [t.data_ptr() % 16 for t in plan.start(*args[:3], args[7])[0]] == [0] * 5


@pytest.mark.parametrize("tail,walks", [(0, False), (1, True), (512, True), (513, False), (1023, False)])
def test_a_tail_of_up_to_half_a_piece_walks_its_context_in_the_kernel(tail, walks):
    assert tail_walks(tail, 1024) is walks


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"bucket \(0\) and piece \(16\) must be positive"):
        ContextAttention(4, 2, 32, torch.float32, "cpu", 1024, 64, bucket=0, piece=16)
    with pytest.raises(ValueError, match=r"q heads \(3\) a multiple of kv heads \(2\)"):
        ContextAttention(3, 2, 32, torch.float32, "cpu", 1024, 64)


def test_the_warm_up_runs_every_shape_once(device, monkeypatch):
    import kernels.context_attention as module
    seen = []
    real = module._attend_piece_ref if not ON_GPU else module._attend_piece
    monkeypatch.setattr(module, "_attend_piece_ref" if not ON_GPU else "_attend_piece",
                        lambda q, keys, *a: seen.append((q.shape[0], keys.shape[0])) or real(q, keys, *a))
    context = ContextAttention(4, 2, 32, DTYPE, device, 3 * BUCKET + 5, PIECE, BUCKET, PIECE)
    assert context.warm() == 3      # buffers short of a bucket's tokens: pieces only
    assert seen == [(PIECE, BUCKET), (PIECE, 2 * BUCKET), (PIECE, 3 * BUCKET)]
    seen.clear()
    context = ContextAttention(4, 2, 32, DTYPE, device, 2 * BUCKET, BUCKET, BUCKET, PIECE)
    assert context.warm() == 4
    assert seen == [(PIECE, BUCKET), (PIECE, 2 * BUCKET), (BUCKET, BUCKET), (BUCKET, 2 * BUCKET)]
