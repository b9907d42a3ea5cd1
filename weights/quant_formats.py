"""Quantized checkpoint formats: ``quantization_config``, the packed tensors, and how to unpack them.

A quantized checkpoint replaces a linear layer's ``<module>.weight`` [N out, K in] by:

| format | tensors (dtype, shape) | weight[n, k] |
| --- | --- | --- |
| GPTQ | qweight (i32 [K/8, N]), qzeros (i32 [G, N/8]), scales (f16 [G, N]), g_idx (i32 [K]) | (q-z)*s, g = g_idx[k] |
| AWQ GEMM | qweight (i32 [K, N/8]), qzeros (i32 [G, N/8]), scales (f16 [G, N]) | (q - z) * s, group k // group_size |
| FP8 | weight (f8e4m3 [N, K]), weight_scale (f32: [] or [1] per tensor, [N, 1] per channel) | w * s |

(GPTQ as AutoGPTQ / GPTQModel write it; FP8 as ``quant_method: fp8`` or compressed-tensors' float8.)

Eight 4-bit values are packed into one int32, value ``i`` of a pack at bits ``4 * i``:

| format | packed along | nibble ``i`` holds |
| --- | --- | --- |
| GPTQ qweight | K (rows 8p .. 8p+7 in word p) | row ``8p + i`` |
| GPTQ qzeros, AWQ qweight and qzeros | N | column ``8p + ORDER[i]`` (GPTQ: ``i``; AWQ: ``AWQ_ORDER[i]``) |

GPTQ's first format (``checkpoint_format: gptq``, the default) stores ``zero - 1``; ``gptq_v2`` the zero.
G is ``K / group_size`` groups (one group with ``group_size`` -1). GPTQ with ``desc_act`` (act-order)
assigns rows to groups by ``g_idx`` (each group still ``group_size`` rows); without it
``g_idx[k] = k // group_size``. ``quantize_linear`` writes a float weight in a format (round to
nearest, per-group asymmetric 4-bit or per-channel / per-tensor FP8) and ``dequantize_linear`` reads it
back: the tests and ``weights.random_checkpoint`` write quantized checkpoints with them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CheckpointError

GPTQ_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACK = 8                      # 4-bit values per int32
FP8_MAX = 448.0               # largest float8_e4m3fn
METHODS = ("gptq", "awq", "fp8")
# --quantize values: gptq / awq / compressed-tensors must match the checkpoint, fp8 also quantizes a float one
QUANTIZE_FLAGS = ("gptq", "awq", "fp8", "compressed-tensors")
# Quantized linear layers: the 2-D ``*_proj.weight`` (and StarCoder2's ``mlp.c_fc.weight``) tensors of the
# decoder layers; their biases (AutoGPTQ writes one for every layer, zeros where the model has none).
LINEAR_PATTERN = re.compile(r"^model\.layers\.\d+\..*(_proj|\.c_fc)\.weight$")
LINEAR_BIAS = r"^model\.layers\.\d+\..*(_proj|\.c_fc)\.bias$"
# The names a quantized checkpoint may hold beside the ones the engine reads: static activation scales
# (the engine quantizes activations per token, dynamically), GPTQ's g_idx without act-order, and 4-bit
# layers' biases where the model has none (the loader checks that they are zeros: ``unused_biases``).
FP8_IGNORED = (r"\.input_scale$",)
GPTQ_IGNORED = (r"\.g_idx$",)
# Files older GPTQ / AWQ repos keep their quantization config in (config.json without quantization_config)
LEGACY_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's linear layers are quantized (``quantization_config``, or ``--quantize fp8``)."""
    method: str                   # gptq | awq | fp8
    group_size: int = -1          # 4-bit: input rows per scale/zero group; -1: one group over all K rows
    desc_act: bool = False        # GPTQ act-order: rows map to groups through g_idx
    zero_offset: int = 0          # added to a stored zero (GPTQ v1 stores zero - 1)
    per_channel: bool = False     # FP8: weight_scale per output row (else one per tensor)
    at_load: bool = False         # FP8: --quantize fp8 quantizes a float checkpoint while loading it
    skip: tuple[str, ...] = ()    # modules_to_not_convert: layers left in the model dtype (``not_converted``)
    ignore: tuple[str, ...] = ()  # compressed-tensors ignore: layers left in the model dtype (``ignored``)
    only: tuple[str, ...] = ()    # GPTQ modules_in_block_to_quantize: a block's only quantized layers (empty: all)
    dynamic: tuple[tuple[str, bool], ...] = ()  # GPTQModel dynamic: (regex, excluded) rules, the first match decides

    @property
    def bits(self) -> int:
        """Bits of one stored weight (scales and zeros aside)."""
        return 8 if self.method == "fp8" else 4

    def quantizes(self, name: str) -> bool:
        """Whether the dense checkpoint name ``name`` (``...proj.weight``) is a quantized linear layer."""
        if not LINEAR_PATTERN.match(name):
            return False
        module = name.removesuffix(".weight")
        if self.only and not any(module.endswith("." + entry) for entry in self.only):
            return False
        return not (any(not_converted(module, entry) for entry in self.skip)
                    or any(ignored(module, entry) for entry in self.ignore) or dynamic_excludes(self.dynamic, module))

    @property
    def ignored_names(self) -> tuple[str, ...]:
        if self.method == "fp8":
            return FP8_IGNORED
        return (LINEAR_BIAS,) + (GPTQ_IGNORED if self.method == "gptq" and not self.desc_act else ())

    def unused_biases(self, names, expected) -> list[str]:
        """The linear layers' biases in the checkpoint's ``names`` that the model (``expected`` names) has no
        place for (let through the strict check by ``ignored_names``): the loader drops them when they are
        zeros."""
        if self.method == "fp8":
            return []
        pattern = re.compile(LINEAR_BIAS)
        return [n for n in names if pattern.match(n) and n not in expected]


# transformers' end of a modules_to_not_convert match: a module name boundary ("layers.1" is not "layers.11")
NAME_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


def not_converted(module: str, entry: str) -> bool:
    """Whether the ``modules_to_not_convert`` entry ``entry`` leaves the layer ``module`` (its full name) in the
    model dtype: AutoAWQ, vLLM and transformers 4 skip every layer whose name contains it (``layers.0.mlp``);
    transformers 5 also reads it as a regex matching from the name's start to a name boundary
    (``model.layers.*.mlp``)."""
    return entry in module or re.match(rf"(?:{entry}){NAME_BOUNDARY}", module) is not None


def ignored(module: str, entry: str) -> bool:
    """Whether the compressed-tensors ``ignore`` entry ``entry`` leaves the layer ``module`` unquantized:
    ``re:`` and a regex matching from the name's start (``re:.*mlp.down_proj``), else the exact name."""
    if entry.startswith("re:"):
        return re.match(entry.removeprefix("re:"), module) is not None
    return entry == module


def dynamic_excludes(rules: tuple[tuple[str, bool], ...], module: str) -> bool:
    """Whether GPTQModel's ``dynamic`` rules leave ``module`` unquantized: the first rule whose regex matches from
    the name's start decides, a ``-:`` rule excludes it (a positive one keeps the base settings: ``_dynamic_rules``
    refuses any other)."""
    return next((excluded for pattern, excluded in rules if re.match(pattern, module)), False)


def _dynamic_rules(spec: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
    """GPTQModel's ``dynamic``: ``{"-:regex": {}}`` leaves the matching layers unquantized; ``{"+:regex": {...}}``
    (or a bare regex) overrides the base settings for them, which this engine cannot do unless they equal the
    base ones (one bit width and group size for the whole model)."""
    dynamic = spec.get("dynamic") or {}
    if not isinstance(dynamic, dict) or not all(isinstance(v, dict) for v in dynamic.values()):
        raise CheckpointError(f"quantization_config dynamic is {dynamic!r}: expected a map of module regexes to "
                              f"settings (GPTQModel's format)")
    base = {"bits": int(spec.get("bits", 4)), "group_size": spec.get("group_size", 128),
            "desc_act": bool(spec.get("desc_act")), "sym": bool(spec.get("sym", True))}
    rules = []
    for key, settings in dynamic.items():
        excluded = key.startswith("-:")
        pattern = key.removeprefix("-:").removeprefix("+:")
        _check_regex(pattern, f"dynamic rule {key!r}")
        differing = {k: v for k, v in settings.items() if k in base and v != base[k]} if not excluded else {}
        if differing:
            raise CheckpointError(f"quantization_config dynamic rule {key!r} overrides {settings} for the layers it "
                                  f"matches, but this engine runs one GPTQ setting for every layer ({base}): serve "
                                  f"a checkpoint quantized without per-layer overrides (\"-:\" rules that leave "
                                  f"layers unquantized are fine)")
        rules.append((pattern, excluded))
    return tuple(rules)


def _block_modules(spec: dict[str, Any]) -> tuple[str, ...]:
    """GPTQ's ``modules_in_block_to_quantize`` (lists of a block's layer names, as optimum writes it, or one
    list): the only layers quantized; the others stay in the model dtype."""
    groups = spec.get("modules_in_block_to_quantize") or []
    names = [name for group in groups for name in (group if isinstance(group, list) else [group])] \
        if isinstance(groups, list) else None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise CheckpointError(f"quantization_config modules_in_block_to_quantize is {groups!r}: expected lists of "
                              f"a block's layer names (\"self_attn.q_proj\", ...)")
    return tuple(names)


def _module_entries(spec: dict[str, Any], key: str, regex_prefix: str = "") -> tuple[str, ...]:
    """The layers ``spec[key]`` leaves unquantized; a clear error unless it is a list of names whose regexes
    compile (with ``regex_prefix``, only the entries that start with it are regexes: compressed-tensors' ``re:``)."""
    entries = spec.get(key) or ()
    if isinstance(entries, str) or not all(isinstance(e, str) for e in entries):
        raise CheckpointError(f"quantization_config {key} is {entries!r}: expected a list of module names")
    for entry in entries:
        if entry.startswith(regex_prefix):
            _check_regex(entry.removeprefix(regex_prefix), f"{key} entry {entry!r}")
    return tuple(entries)


def _check_regex(pattern: str, what: str) -> None:
    """A clear error unless ``pattern`` (``what`` of quantization_config says where it is) compiles."""
    try:
        re.compile(pattern)
    except re.error as err:
        raise CheckpointError(f"quantization_config {what} is not a valid regular expression ({err}): "
                              f"fix it in config.json") from None


# ---- quantization_config ----------------------------------------------------------------------

def parse_quantization(raw: dict[str, Any], requested: str | None = None,
                       model_dir: str | Path | None = None) -> QuantConfig | None:
    """The checkpoint's ``quantization_config`` combined with ``--quantize`` (``requested``). Without one in
    config.json, older repos' own files in ``model_dir`` are read (``LEGACY_FILES``)."""
    spec = raw.get("quantization_config") or (legacy_spec(Path(model_dir)) if model_dir is not None else None)
    found = _from_spec(spec) if spec else None
    method_name = spec.get("quant_method") if spec else None
    if requested is None:
        return found
    if requested not in QUANTIZE_FLAGS:
        raise CheckpointError(f"--quantize {requested} is not supported; supported: {', '.join(QUANTIZE_FLAGS)} "
                              f"(gptq / awq / compressed-tensors load checkpoints in that format, fp8 also "
                              f"quantizes a float16/bfloat16 checkpoint at load)")
    if requested == "fp8":
        if found is None:
            return QuantConfig("fp8", per_channel=True, at_load=True)
        if found.method == "fp8":
            return found
    elif found is not None and requested == method_name:
        return found
    what = f"a {method_name} checkpoint" if spec else "a checkpoint without quantization_config"
    raise CheckpointError(f"--quantize {requested} does not match {what}: leave --quantize unset (the "
                          f"checkpoint's quantization_config is read without it) or serve a {requested} checkpoint")


def legacy_spec(model_dir: Path) -> dict[str, Any] | None:
    """AutoGPTQ's ``quantize_config.json`` or AutoAWQ's ``quant_config.json`` as a ``quantization_config``."""
    for name, method in LEGACY_FILES.items():
        path = model_dir / name
        if path.is_file():
            try:
                spec = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                raise CheckpointError(f"{path} is not valid JSON ({err}): re-download it") from err
            return {"quant_method": method, **spec}
    return None


def _from_spec(spec: dict[str, Any]) -> QuantConfig:
    method = str(spec.get("quant_method", "")).lower()
    if spec.get("lm_head"):
        raise CheckpointError(f"quantization_config has lm_head: {spec['lm_head']!r}: the checkpoint's LM head is "
                              f"quantized (GPTQModel / AutoGPTQ lm_head=True), but this engine runs the LM head in "
                              f"the model dtype only: serve a checkpoint quantized with lm_head=False")
    if method == "gptq":
        return _gptq(spec)
    if method == "awq":
        return _awq(spec)
    if method == "fp8":
        if spec.get("weight_block_size"):
            raise CheckpointError(f"block-wise FP8 (weight_block_size {spec['weight_block_size']}) is not "
                                  f"supported; supported FP8 weights have per-tensor or per-channel scales")
        return QuantConfig("fp8", per_channel=False, skip=_module_entries(spec, "modules_to_not_convert"))
    if method == "compressed-tensors":
        return _compressed_tensors(spec)
    raise CheckpointError(f"quantization_config quant_method {method!r} is not supported; supported: GPTQ and "
                          f"AWQ (GEMM) 4-bit, FP8 (fp8, compressed-tensors float8)")


def _group_size(spec: dict[str, Any], key: str) -> int:
    group = int(spec.get(key, -1))
    if group != -1 and (group <= 0 or group % PACK):
        raise CheckpointError(f"quantization_config {key}={group} is not supported: expected -1 or a positive "
                              f"multiple of {PACK}")
    return group


def _gptq(spec: dict[str, Any]) -> QuantConfig:
    if int(spec.get("bits", 4)) != 4:
        raise CheckpointError(f"GPTQ bits={spec.get('bits')} is not supported; only 4-bit GPTQ is")
    fmt = str(spec.get("checkpoint_format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
    return QuantConfig("gptq", group_size=_group_size(spec, "group_size"), desc_act=bool(spec.get("desc_act")),
                       zero_offset=1 if fmt == "gptq" else 0, skip=_module_entries(spec, "modules_to_not_convert"),
                       only=_block_modules(spec), dynamic=_dynamic_rules(spec))


def _awq(spec: dict[str, Any]) -> QuantConfig:
    bits = int(spec.get("bits", spec.get("w_bit", 4)))
    version = str(spec.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not spec.get("zero_point", True):
        raise CheckpointError(f"AWQ bits={bits} version={version!r} zero_point={spec.get('zero_point', True)} "
                              f"is not supported; supported: 4-bit GEMM format with zero points")
    group = _group_size(spec, "group_size" if "group_size" in spec else "q_group_size")
    return QuantConfig("awq", group_size=group, skip=_module_entries(spec, "modules_to_not_convert"))


def _compressed_tensors(spec: dict[str, Any]) -> QuantConfig:
    groups = list((spec.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise CheckpointError(f"compressed-tensors with {len(groups)} config_groups is not supported; expected "
                              f"one group of float8 weights")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    strategy = weights.get("strategy")
    if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8 or strategy not in ("tensor", "channel"):
        raise CheckpointError(f"compressed-tensors weights {weights} are not supported; supported: float 8-bit "
                              f"weights with per-tensor or per-channel scales")
    if inputs and inputs.get("type", "float") != "float":
        raise CheckpointError(f"compressed-tensors input_activations {inputs} are not supported; supported: "
                              f"float8 (quantized per token at run time) or none")
    ignore = _module_entries(spec, "ignore", "re:")
    targets = groups[0].get("targets") or ()
    if any(t == "Linear" or ignored("lm_head", t) for t in targets) and not any(ignored("lm_head", e) for e in ignore):
        raise CheckpointError(f"compressed-tensors targets {targets} with ignore {list(ignore)} quantize the LM head "
                              f"(lm_head), but this engine runs the LM head in the model dtype only: serve a "
                              f"checkpoint quantized with \"lm_head\" in its ignore list")
    return QuantConfig("fp8", per_channel=strategy == "channel", ignore=ignore)


def config_json(q: QuantConfig) -> dict[str, Any]:
    """The ``quantization_config`` a checkpoint of ``q`` carries (what the writers put in config.json)."""
    skip = {"modules_to_not_convert": list(q.skip)} if q.skip else {}
    if q.method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": q.group_size, "desc_act": q.desc_act, "sym": True,
                "checkpoint_format": "gptq" if q.zero_offset else "gptq_v2", **skip,
                **({"modules_in_block_to_quantize": [list(q.only)]} if q.only else {}),
                **({"dynamic": {("-:" if excluded else "+:") + pattern: {} for pattern, excluded in q.dynamic}}
                   if q.dynamic else {})}
    if q.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": q.group_size, "zero_point": True, "version": "gemm",
                **skip}
    if not q.per_channel:
        return {"quant_method": "fp8", "activation_scheme": "dynamic", **skip}
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                 "symmetric": True, "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                    "dynamic": True}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": scheme},
            "ignore": ["lm_head", *(entry for entry in q.ignore if entry != "lm_head")]}


# ---- names and shapes ----------------------------------------------------------------------------

def num_groups(q: QuantConfig, in_features: int) -> int:
    return 1 if q.group_size == -1 else in_features // q.group_size


def linear_shapes(q: QuantConfig, module: str, out_features: int, in_features: int) -> dict[str, Any]:
    """The checkpoint tensors that stand for ``module.weight`` [out, in], with their shapes (FP8 scales:
    the list of shapes producers write, e.g. [] or [1] per tensor)."""
    n, k = out_features, in_features
    if q.method == "fp8":
        return {module + ".weight": (n, k), module + ".weight_scale": [(n, 1), (n,)] if q.per_channel else [(1,), ()]}
    if k % PACK or n % PACK or (q.group_size != -1 and k % q.group_size):
        raise CheckpointError(f"{module} [{n}, {k}] cannot be 4-bit packed with group_size {q.group_size}: the "
                              f"sizes must be multiples of {PACK} and the input size of the group size")
    g = num_groups(q, k)
    if q.method == "awq":
        return {module + ".qweight": (k, n // PACK), module + ".qzeros": (g, n // PACK), module + ".scales": (g, n)}
    shapes = {module + ".qweight": (k // PACK, n), module + ".qzeros": (g, n // PACK), module + ".scales": (g, n)}
    if q.desc_act:
        shapes[module + ".g_idx"] = (k,)
    return shapes


def quantized_shapes(shapes: dict[str, tuple[int, ...]], q: QuantConfig | None) -> dict[str, tuple[int, ...]]:
    """A dense checkpoint's names and shapes as the quantized checkpoint of ``q`` spells them (fp8 at load:
    unchanged, the checkpoint is a float one)."""
    if q is None or q.at_load:
        return dict(shapes)
    out = {}
    for name, shape in shapes.items():
        if q.quantizes(name):
            out.update(linear_shapes(q, name.removesuffix(".weight"), *shape))
        else:
            out[name] = shape
    return out


# ---- packing -----------------------------------------------------------------------------------

def pack_int4(values: torch.Tensor, dim: int, order: tuple[int, ...] = GPTQ_ORDER) -> torch.Tensor:
    """Integers 0..15 -> int32 words of 8 along ``dim`` (a 2-D tensor): nibble ``i`` of word ``p`` holds
    element ``8p + order[i]``."""
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % PACK or v.min() < 0 or v.max() > 15:
        raise ValueError(f"pack_int4 needs values in 0..15 and a size along dim {dim} divisible by {PACK}")
    v = v.reshape(*v.shape[:-1], v.shape[-1] // PACK, PACK)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64, device=v.device)
    for i, source in enumerate(order):
        words |= v[..., source] << (4 * i)
    words = torch.where(words >= 2**31, words - 2**32, words)     # the bits as a signed int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int4(words: torch.Tensor, dim: int, order: tuple[int, ...] = GPTQ_ORDER) -> torch.Tensor:
    """The inverse of ``pack_int4``: int32 words -> int32 values 0..15, 8 per word along ``dim``."""
    w = words.movedim(dim, -1)
    shifts = torch.tensor([4 * order.index(j) for j in range(PACK)], dtype=torch.int32, device=w.device)
    values = (w.unsqueeze(-1) >> shifts) & 0xF
    return values.reshape(*w.shape[:-1], w.shape[-1] * PACK).movedim(-1, dim).contiguous()


def input_name(name: str) -> str:
    """The layers that read one input share a key: q/k/v (``...self_attn.qkv``), gate/up (``...mlp.gate_up``)."""
    parent, module = name.removesuffix(".weight").rsplit(".", 1)
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    return f"{parent}.{shared.get(module, module)}"


def act_order_g_idx(in_features: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """A GPTQ act-order ``g_idx``: rows in a random order, ``group_size`` consecutive ones of it per group."""
    perm = torch.randperm(in_features, generator=generator, device=generator.device)
    g_idx = torch.empty(in_features, dtype=torch.int32, device=perm.device)
    g_idx[perm] = torch.arange(in_features, device=perm.device, dtype=torch.int32) // group_size
    return g_idx


# ---- writing a float weight in a format, and reading it back ---------------------------------------

def quantize_linear(weight: torch.Tensor, q: QuantConfig, scale_dtype=torch.float16,
                    g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``weight`` [N, K] in the format of ``q`` (tensor name suffix -> tensor): round to nearest, 4-bit per
    group with zeros (GPTQ act-order: rows grouped by ``g_idx``, e.g. ``act_order_g_idx``; layers that read
    the same input, q/k/v and gate/up, share it as GPTQ's act-order gives them), FP8 per channel or tensor."""
    w = weight.float()
    if q.method == "fp8":
        fp8, scale = fp8_quantize(w, q.per_channel)
        return {"weight": fp8, "weight_scale": scale[:, None] if q.per_channel else scale.reshape(1)}
    n, k = w.shape
    group = k if q.group_size == -1 else q.group_size
    if not q.desc_act:
        g_idx = torch.arange(k, device=w.device, dtype=torch.int32) // group
    elif g_idx is None:
        raise ValueError("an act-order GPTQ layer needs its g_idx (act_order_g_idx)")
    order = torch.argsort(g_idx, stable=True)               # the rows of group 0, then group 1, ...
    grouped = w[:, order].reshape(n, num_groups(q, k), group)  # every group has ``group`` rows
    lo, hi = grouped.amin(-1).clamp(max=0).T, grouped.amax(-1).clamp(min=0).T           # [G, N]
    scales = ((hi - lo) / 15).clamp(min=1e-6).to(scale_dtype).contiguous()              # [G, N]
    zeros = (-lo / scales.float()).round().clamp(q.zero_offset, 15).to(torch.int32)      # [G, N] (v1: >= 1)
    s, z = scales.float()[g_idx.long()].T, zeros[g_idx.long()].T                        # [N, K]
    values = (w / s).round().add(z).clamp(0, 15).to(torch.int32)                        # [N, K]
    if q.method == "awq":
        return {"qweight": pack_int4(values.T, 1, AWQ_ORDER), "qzeros": pack_int4(zeros, 1, AWQ_ORDER),
                "scales": scales}
    return {"qweight": pack_int4(values.T, 0), "qzeros": pack_int4(zeros - q.zero_offset, 1), "scales": scales,
            "g_idx": g_idx.clone()}     # its own copy: layers that share g_idx are saved side by side


def fp8_quantize(weight: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scales [N] or [1]) with ``weight ~= fp8 * scale`` per row or tensor."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    fp8 = (w / (scale[:, None] if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8, scale


def dequantize_linear(tensors: dict[str, torch.Tensor], q: QuantConfig) -> torch.Tensor:
    """float32 [N, K] of a linear layer's checkpoint tensors (suffix -> tensor) in format ``q``."""
    if q.method == "fp8":
        scale = tensors["weight_scale"].float()
        return tensors["weight"].float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
    if q.method == "awq":
        values = unpack_int4(tensors["qweight"], 1, AWQ_ORDER)                # [K, N]
        zeros = unpack_int4(tensors["qzeros"], 1, AWQ_ORDER)
        k = values.shape[0]
        g_idx = torch.arange(k, device=values.device) // (k if q.group_size == -1 else q.group_size)
    else:
        values = unpack_int4(tensors["qweight"], 0)
        zeros = unpack_int4(tensors["qzeros"], 1) + q.zero_offset
        k = values.shape[0]
        g_idx = (tensors["g_idx"].long() if q.desc_act
                 else torch.arange(k, device=values.device) // (k if q.group_size == -1 else q.group_size))
    scales = tensors["scales"].float()
    return ((values.float() - zeros.float()[g_idx]) * scales[g_idx]).T.contiguous()
