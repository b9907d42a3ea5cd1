import math

import pytest
import torch
import torch.nn.functional as F
import triton
from kernel_inputs import ATTENTION_TOL, ON_GPU, build_kv_cache

from kernels._kv_quant import wide_slots
from kernels.prefill_attention import (
    CPU_LAUNCH,
    CUDA_LAUNCHES,
    CUDA_LAUNCHES_FP32,
    CUDA_LAUNCHES_NO_GQA,
    MAX_GRID_REQUESTS,
    MAX_SPLITS,
    PrefillCall,
    PrefillLaunch,
    default_splits,
    launch,
    prefill_attention,
    prefill_attention_ref,
    prefill_launch,
    tile_shape,
)
from kernels.shared_prefix import SHARED_LAUNCH_CPU

# (new tokens per request, cached prefix per request)
LAYOUTS = {
    "single_token": ([1], [0]),
    "ragged": ([5, 1, 33, 17], [0, 0, 0, 0]),
    "chunked": ([7, 1, 20, 3], [9, 40, 31, 0]),
    # several key blocks before the query block (full ones unmasked, then a partial one), a chunk
    # spanning several query blocks, and prefixes of whole key blocks
    "long prefix": ([40, 1, 70], [100, 130, 0]),
    "block aligned": ([32, 64], [64, 32]),
}
if ON_GPU:
    LAYOUTS["long"] = ([300, 1, 129, 64, 1000], [0, 513, 77, 0, 2000])
# group sizes 1, 2, 4, 8 and 3 or 7 (not a power of two: one q head a program)
GQA = [(2, 2), (4, 2), (8, 2), (8, 1), (6, 2)] if not ON_GPU else [(32, 32), (32, 16), (32, 8), (32, 4), (28, 4)]
HEAD_DIMS = [32] if not ON_GPU else [64, 128]


def prefill_inputs(q_lens, prefixes, q_heads, kv_heads, head_dim, dtype, device):
    cache = build_kv_cache([q + p for q, p in zip(q_lens, prefixes)], kv_heads, head_dim, dtype, device)
    tokens = sum(q_lens)
    # q as a strided view of a fused qkv projection
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    b_q_start = torch.tensor([0] + q_lens[:-1], device=device).cumsum(0).int()
    b_q_len = torch.tensor(q_lens, dtype=torch.int32, device=device)
    return (q, cache.kv_layer, cache.req_to_token, cache.b_req_row, b_q_start, b_q_len, cache.b_seq_len,
            1 / math.sqrt(head_dim), max(q_lens))


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def layout_gqa_dtypes():
    """Every layout with every GQA group, the dtypes in turn: each layout and each group (with each head dim) meets
    all three. The dtype enters the kernel only at the loads of q and K/V, the dots (float32 operands for float32,
    and everywhere in the interpreter) and the output's rounding (bfloat16's own), and on CUDA the launch table
    (``prefill_launch`` by dtype, group and head dim); the full product repeated the same walks for each dtype
    (3x the time)."""
    return [pytest.param(layout, q_heads, kv_heads, DTYPES[(i + j) % 3], id=f"{layout}-{q_heads}-{kv_heads}-"
                         f"{str(DTYPES[(i + j) % 3])[6:]}")
            for i, layout in enumerate(LAYOUTS) for j, (q_heads, kv_heads) in enumerate(GQA)]


@pytest.mark.parametrize("layout,q_heads,kv_heads,dtype", layout_gqa_dtypes())
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prefill_attention_matches_reference(device, dtype, q_heads, kv_heads, layout, head_dim):
    args = prefill_inputs(*LAYOUTS[layout], q_heads, kv_heads, head_dim, dtype, device)
    out = prefill_attention(*args)
    expected = prefill_attention_ref(*args)
    assert out.shape == args[0].shape and out.dtype == dtype and out.is_contiguous()
    assert out.isfinite().all()  # every row written, no read of a NaN-poisoned slot
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("params", [PrefillLaunch(16, 16, 4, 1), PrefillLaunch(64, 16, 4, 1),
                                    PrefillLaunch(32, 64, 4, 1), PrefillLaunch(16, 16, 4, 1, prefetch=True)])
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (6, 2)])
def test_other_launch_parameters_give_the_same_result(device, params, q_heads, kv_heads):
    """Other tiles (as the bench sweeps): 16 rows (4 tokens x 4 heads, or 16 tokens of one head), key
    blocks as long as, and longer than, the query block; with and without the slots loaded a block ahead
    (CPU_LAUNCH, which the other tests take, has it)."""
    args = prefill_inputs([19, 1, 40], [37, 5, 0], q_heads, kv_heads, HEAD_DIMS[-1], torch.float32, device)
    out = launch(*args, params=params)
    torch.testing.assert_close(out, prefill_attention_ref(*args), atol=1e-4, rtol=1e-4)


def test_prefill_attention_odd_head_dim(device):
    args = prefill_inputs([3, 18], [5, 0], 4, 2, 80 if ON_GPU else 24, torch.float16, device)
    torch.testing.assert_close(prefill_attention(*args), prefill_attention_ref(*args), atol=4e-3, rtol=4e-3)


def test_prefill_reference_matches_causal_sdpa_in_chunks(device):
    """Prefilling a prompt in two chunks gives the rows of full causal attention."""
    q_heads, kv_heads, head_dim, length, prefix = 4, 2, 16, 23, 9
    args = list(prefill_inputs([length], [0], q_heads, kv_heads, head_dim, torch.float32, device))
    q, kv_layer, req_to_token, b_req_row = args[:4]
    slots = req_to_token[b_req_row[0], :length].long()
    k = kv_layer[slots, :kv_heads].repeat_interleave(2, 1).transpose(0, 1)
    v = kv_layer[slots, kv_heads:].repeat_interleave(2, 1).transpose(0, 1)
    full = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True).transpose(0, 1)
    chunk = q[prefix:]
    b_q_len = torch.tensor([length - prefix], dtype=torch.int32, device=device)
    out = prefill_attention_ref(chunk, kv_layer, req_to_token, b_req_row, args[4], b_q_len, args[6],
                                args[7], length - prefix)
    torch.testing.assert_close(out, full[prefix:], atol=1e-5, rtol=1e-5)


def test_prefill_attention_rejects_bad_arguments(device):
    args = prefill_inputs([3, 4], [0, 2], 4, 2, 16, torch.float16, device)
    q, kv_layer, table, rows, starts, lens, seq_lens, scale, max_len = args
    with pytest.raises(ValueError, match=r"q heads \(3\) must be a multiple of kv heads \(2\)"):
        prefill_attention(q[:, :3], *args[1:])
    with pytest.raises(ValueError, match="kv_layer has dtype torch.bfloat16 but must match torch.float16"):
        prefill_attention(q, kv_layer.bfloat16(), *args[2:])
    with pytest.raises(ValueError, match="b_seq_len has dtype torch.int64"):
        prefill_attention(q, kv_layer, table, rows, starts, lens, seq_lens.long(), scale, max_len)
    with pytest.raises(ValueError, match=r"b_q_len has shape \(1,\); expected \(2,\)"):
        prefill_attention(q, kv_layer, table, rows, starts, lens[:1], seq_lens, scale, max_len)
    with pytest.raises(ValueError, match="max_q_len must be a host int"):
        prefill_attention(q, kv_layer, table, rows, starts, lens, seq_lens, scale, lens.max())
    many = torch.zeros(MAX_GRID_REQUESTS + 1, dtype=torch.int32, device=device)    # the grid's z holds the requests
    with pytest.raises(ValueError, match=f"{MAX_GRID_REQUESTS + 1} requests in one prefill attention call; at most"):
        prefill_attention(q, kv_layer, table, many, many, many, many, scale, max_len)


@pytest.mark.parametrize("splits", [1, 2])
def test_out_takes_the_result_in_place(device, splits):
    """``out=``: a piecewise graph's static buffer (a slice of it) gets the result, rows past it untouched; the
    reference writes it the same way."""
    args = prefill_inputs([7, 1, 20], [40, 45, 0], 4, 2, HEAD_DIMS[-1], torch.float32, device)
    q = args[0]
    buffer = torch.full((q.shape[0] + 5, *q.shape[1:]), 7.0, dtype=q.dtype, device=q.device)
    params = prefill_launch(q.shape[2], q.device, q.dtype)
    result = launch(*args, params=params, splits=splits, out=buffer[: q.shape[0]])
    assert result.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[: q.shape[0]], prefill_attention_ref(*args), atol=1e-4, rtol=1e-4)
    assert (buffer[q.shape[0]:] == 7.0).all()
    reference_buffer = torch.empty_like(buffer[: q.shape[0]])
    assert prefill_attention_ref(*args, out=reference_buffer) is reference_buffer
    torch.testing.assert_close(reference_buffer, buffer[: q.shape[0]], atol=1e-4, rtol=1e-4)


def test_a_bad_out_is_refused(device):
    args = prefill_inputs([3, 4], [0, 2], 4, 2, 16, torch.float16, device)
    q = args[0]
    with pytest.raises(ValueError, match=r"out has shape \(6, 4, 16\); expected \(7, 4, 16\)"):
        prefill_attention(*args, out=torch.empty(6, 4, 16, dtype=q.dtype, device=q.device))
    with pytest.raises(ValueError, match="out has dtype torch.float32"):
        prefill_attention(*args, out=torch.empty(q.shape, dtype=torch.float32, device=q.device))
    with pytest.raises(ValueError, match="out must be contiguous"):
        prefill_attention(*args, out=torch.empty(4, 7, 16, dtype=q.dtype, device=q.device).transpose(0, 1))


SHARED_PREFILL = {
    # new tokens, cached prefix per request, members, shared prefix length
    "chunks and decode rows behind one prefix": ([7, 1, 20, 3, 1], [40, 45, 31, 50, 12], [0, 1, 2, 3], 30),
    "more tokens than one program's tile": ([40, 33, 1], [35, 35, 60], [0, 1, 2], 35),
    "no group": ([4, 2], [10, 3], [0], 0),
}
if ON_GPU:
    SHARED_PREFILL["3k prefix, 100 chunks"] = ([16 + i % 48 for i in range(100)], [3000] * 100, list(range(100)), 3000)


def shared_prefill_params():
    """Every case with every GQA group, but in the interpreter "more tokens than one program's tile" only with the
    groups whose programs the first case keeps in one tile: of the shared-prefix kernel (its 32 tokens against
    64 // next_power_of_2(group) a program: groups 1 and 2) or of this kernel (its longest request's 20 tokens
    against ``tile_shape``'s: groups 1 and 3). Groups 4 and 8 cross both in the first case already."""
    def crosses_both_in_the_first_case(group):
        q_lens = SHARED_PREFILL["chunks and decode rows behind one prefix"][0]
        shared_rows = SHARED_LAUNCH_CPU[0] // triton.next_power_of_2(group)
        return sum(q_lens) > shared_rows and max(q_lens) > tile_shape(CPU_LAUNCH, group)[1]
    return [pytest.param(case, q_heads, kv_heads, id=f"{q_heads}-{kv_heads}-{case}") for case in SHARED_PREFILL
            for q_heads, kv_heads in GQA if ON_GPU or case != "more tokens than one program's tile"
            or not crosses_both_in_the_first_case(q_heads // kv_heads)]


@pytest.mark.parametrize("case,q_heads,kv_heads", shared_prefill_params())
def test_a_shared_prefix_gives_the_same_prefill_attention(device, case, q_heads, kv_heads):
    """Cascade attention in prefill: members' new tokens take the shared prefix from the shared-prefix
    kernel, the rest (their own positions, causal) from the prefill kernel."""
    q_lens, prefixes, members, prefix = SHARED_PREFILL[case]
    q, kv_layer, table, rows, q_start, q_len, seq_len, scale, max_q_len = prefill_inputs(
        q_lens, prefixes, q_heads, kv_heads, HEAD_DIMS[-1], torch.bfloat16, device)
    source_row = int(rows[members[0]])
    for m in members[1:]:
        table[rows[m], :prefix] = table[source_row, :prefix]
    first = torch.zeros(len(q_lens), dtype=torch.int32, device=device)
    first[members] = prefix
    shared = (first, torch.tensor([source_row, prefix], dtype=torch.int32, device=device))
    args = (q, kv_layer, table, rows, q_start, q_len, seq_len, scale, max_q_len)
    out = prefill_attention(*args, shared=shared)
    expected = prefill_attention_ref(*args)
    assert out.isfinite().all()
    atol, rtol = ATTENTION_TOL[torch.bfloat16]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


SPLIT_LAYOUTS = {
    # new tokens, cached prefix per request: chunks late in a long context (the 20-token one in three query blocks of
    # 8 tokens, one with a diagonal of two key blocks), a split with no keys
    "late chunks": ([5, 1, 20], [200, 97, 150]),
    "a fresh prompt beside a late chunk": ([33, 4], [0, 130]),
}


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("layout", list(SPLIT_LAYOUTS))
def test_split_keys_give_the_same_prefill_attention(device, splits, layout):
    """Split-KV: each query block's keys before its first token cut into parts (merged by the
    decode attention's merge kernel); GQA group 4 (one kv head: the merge kernel runs a program per token and q
    head, most of the interpreter's time here)."""
    args = prefill_inputs(*SPLIT_LAYOUTS[layout], 4, 1, HEAD_DIMS[-1], torch.float32, device)
    out = launch(*args, params=prefill_launch(args[0].shape[2], args[0].device, args[0].dtype), splits=splits)
    assert out.isfinite().all()
    torch.testing.assert_close(out, prefill_attention_ref(*args), atol=1e-4, rtol=1e-4)


def test_slots_whose_offsets_pass_int32_are_read_right(device):
    """A cache layer of 2**31 elements or more: offsets of slots near its end pass int32's range, so the kernel
    computes them in int64 there (``wide_slots``; int32 below). The requests' K/V moved to the last slots of such
    a layer (left unwritten elsewhere: its untouched pages take no memory) give the small layer's result."""
    args = prefill_inputs(*LAYOUTS["long prefix"], 2, 1, 32, torch.float16, device)
    q, small, table = args[0], args[1], args[2]
    slots = 2 ** 31 // (small.shape[1] * small.shape[2]) + 64
    big = torch.empty((slots, *small.shape[1:]), dtype=small.dtype, device=device)
    assert wide_slots(big) and not wide_slots(small)
    moved = torch.where(table > 0, slots - table, 0)                # slot s -> slots - s, past 2**31 / stride
    used = table[table > 0].long()
    big[slots - used] = small[used]
    expected = prefill_attention(*args)
    out = prefill_attention(q, big, moved, *args[3:])
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_wide_slots_from_the_largest_slot_offset():
    """int32 holds every slot's offset (slot * stride) while slots * stride <= 2**31 - 1."""
    per_slot = 2 * 8 * 128
    assert not wide_slots(torch.empty((2 ** 31 // per_slot - 1, 16, 128), device="meta"))
    assert wide_slots(torch.empty((2 ** 31 // per_slot, 16, 128), device="meta"))
    assert wide_slots(torch.empty((2 ** 30, 16, 128), device="meta")[:2 ** 20:2])     # a view: its stride counts


@pytest.mark.parametrize("splits", [1, 4])
def test_a_planned_call_runs_each_layer_as_prefill_attention_does(device, monkeypatch, splits):
    """``PrefillCall``: checked and planned on one layer (split buffers included), then run on other layers' q
    and K/V of those shapes, each result the reference's on that layer, into the one ``out``; a layer of another
    shape or dtype is refused."""
    import kernels.prefill_attention as module
    monkeypatch.setattr(module, "default_splits", lambda *a, **k: splits)
    args = prefill_inputs(*SPLIT_LAYOUTS["late chunks"], 4, 2, HEAD_DIMS[-1], torch.float32, device)
    q, first = args[0], args[1]
    layers = [first, torch.randn_like(first), torch.randn_like(first)]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    call = PrefillCall(*args, max_seq_len=300, out=out)
    assert call.splits == splits and (call.split_out is None) == (splits == 1)
    for layer in layers:
        width = q.shape[1] * q.shape[2]                 # another view of a fused qkv projection, as q is
        layer_q = torch.randn(q.shape[0], q.stride(0), device=q.device).to(q.dtype)[:, :width].view(q.shape)
        assert call(layer_q, layer) is out
        expected = prefill_attention_ref(layer_q, layer, *args[2:])
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="is not the layer this call was planned for"):
        call(q, first[:, :2])
    with pytest.raises(ValueError, match="is not the layer this call was planned for"):
        call(q, first.half())
    with pytest.raises(ValueError, match="is not the layer this call was planned for"):
        call(q[:-1], first)


def specialisation(kernel, unspecialised, args) -> list:
    """The class Triton compiles a launch's integer arguments by (1, a multiple of 16, other), but those
    the kernel does not specialise."""
    skipped = {kernel.arg_names.index(name) for name in unspecialised}
    return [(a == 1, a % 16 == 0) for i, a in enumerate(args) if i not in skipped and type(a) is int]


def test_every_split_count_launches_the_kernels_the_warm_up_compiled(monkeypatch):
    """The worker's warm-up runs 2 splits (engine.worker.model_worker). Every other count must launch both
    kernels with their integer arguments in the same classes, or Triton compiles them while requests wait
    (16 and 32 splits did: the lse rows were ``splits`` wide)."""
    import kernels.prefill_attention as module
    from kernels.decode_attention import MERGE_UNSPECIALISED
    unspecialised = {"_prefill_attention_kernel": module.UNSPECIALISED, "_decode_merge_kernel": MERGE_UNSPECIALISED}
    kernels = {name: getattr(module, name) for name in unspecialised}
    seen = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def record(*args, **kwargs):
                seen.setdefault(self.name, []).append(specialisation(kernels[self.name], unspecialised[self.name], args))
            return record

    for name in kernels:
        monkeypatch.setattr(module, name, Recorder(name))
    args = prefill_inputs([40, 1, 70], [100, 130, 0], 32, 8, 128, torch.float32, torch.device("cpu"))
    for splits in (2, 4, 8, 16, 32):
        launch(*args, params=CPU_LAUNCH, splits=splits)
    for name, classes in seen.items():
        assert len(classes) == 5 and all(c == classes[0] for c in classes), f"{name}: {classes}"


def test_split_keys_with_a_shared_prefix(device):
    q_lens, prefixes, members, prefix = [7, 3, 20], [150, 150, 90], [0, 1, 2], 64
    q, kv_layer, table, rows, q_start, q_len, seq_len, scale, max_q_len = prefill_inputs(
        q_lens, prefixes, 4, 2, HEAD_DIMS[-1], torch.float32, device)
    for m in members[1:]:
        table[rows[m], :prefix] = table[rows[0], :prefix]
    shared = (torch.full((3,), prefix, dtype=torch.int32, device=device),
              torch.tensor([int(rows[0]), prefix], dtype=torch.int32, device=device))
    args = (q, kv_layer, table, rows, q_start, q_len, seq_len, scale, max_q_len)
    out = launch(*args, params=prefill_launch(q.shape[2], q.device, q.dtype), splits=3, shared=shared)
    torch.testing.assert_close(out, prefill_attention_ref(*args), atol=1e-4, rtol=1e-4)


def test_launch_parameters_on_cuda_are_the_tables():
    """Pure Python: what ``prefill_attention`` launches with on a CUDA device, and how a group splits a tile."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert prefill_launch(128, cuda) == CUDA_LAUNCHES[128] == prefill_launch(128, cuda, torch.float16)
    assert prefill_launch(128, cuda, group=1) == CUDA_LAUNCHES_NO_GQA[128] == (64, 64, 4, 2, False)   # no GQA
    assert prefill_launch(128, cuda, torch.float32, group=1) == CUDA_LAUNCHES_FP32[128]._replace(block_m=64)
    assert prefill_launch(80, cuda) == CUDA_LAUNCHES[128]              # head dims round up to a power of two
    assert prefill_launch(64, cuda) == prefill_launch(32, cuda) == CUDA_LAUNCHES[64]
    assert prefill_launch(256, cuda) == prefill_launch(512, cuda) == CUDA_LAUNCHES[256]
    assert prefill_launch(128, cuda, torch.float32) == CUDA_LAUNCHES_FP32[128]
    assert prefill_launch(128, cpu) == prefill_launch(128, cpu, torch.float32) == CPU_LAUNCH
    for table in (CUDA_LAUNCHES, CUDA_LAUNCHES_NO_GQA, CUDA_LAUNCHES_FP32):
        for params in table.values():       # tl.dot shapes: powers of two, at least 16
            assert all(n >= 16 and n & (n - 1) == 0 for n in (params.block_m, params.block_n))
    rows = CUDA_LAUNCHES[128].block_m
    assert tile_shape(CUDA_LAUNCHES[128], 1) == (1, rows)                 # Llama-2-7B: 32 / 32 heads
    assert tile_shape(CUDA_LAUNCHES[128], 4) == (4, rows // 4)            # Llama-3.1-8B: 32 / 8 heads
    assert tile_shape(CUDA_LAUNCHES[128], 8) == (8, rows // 8)
    assert tile_shape(CUDA_LAUNCHES[128], 7) == (1, rows)                 # an odd group: one head, no padding
    assert tile_shape(CUDA_LAUNCHES[128], 6) == (2, rows // 2)            # its largest power-of-two divisor
    assert tile_shape(PrefillLaunch(16, 16, 4, 1), 32) == (16, 1)         # never fewer than one token


def test_splits_are_asked_only_when_the_blocks_leave_the_gpu_idle():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    params = CUDA_LAUNCHES[128]
    assert default_splits(1, 32, 8, 200, 100_000, params, cpu) == 1          # the interpreter: never
    if not ON_GPU:
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tokens = params.block_m // 4
    assert default_splits(1, 32, 8, 64 * tokens, 100_000, params, cuda) == 1     # 512 programs fill it
    assert default_splits(1, 32, 8, tokens, 100_000, params, cuda) == MAX_SPLITS   # 8 programs, 100 splits
    expected = min(MAX_SPLITS, 1 << (-(-2 * sms // 32) - 1).bit_length())          # 32 programs: a power of two
    assert default_splits(1, 32, 8, 4 * tokens, 100_000, params, cuda) == expected
    assert default_splits(1, 32, 8, tokens, 1_500, params, cuda) == 1           # a short context: no split
    assert default_splits(1, 32, 8, tokens, None, params, cuda) == 1
