"""Constrained decoding: TGI's ``grammar`` (a JSON schema or a regex) as a token mask.

The grammar engine is llguidance (chosen by measurement: about 1 ms to compile a schema
and 20-40 us per token for the mask on 4k and 32k vocabularies; see the issue report).

    front end : ``grammar_error(kind, text)``  -> None or the reason it cannot compile (a 422)
    worker    : ``GrammarCompiler.matcher(kind, text)`` -> a ``GrammarMatcher`` per request
                (compiled once per (kind, text), copied per request)
    sampler   : ``fill_bitmasks(matchers)`` on the CPU -> packed int32 [rows, ceil(V / 32)],
                ``apply_bitmask(scores, rows, bitmask)`` unpacks it on the device

A grammar travels as (kind, text): kind "json" with the schema as JSON text, or
"regex" with the pattern. Bit ``v % 32`` of word ``v // 32`` of a row is 1 when token
``v`` is allowed. Once the grammar is complete (nothing but the end can follow), or if
the matcher failed, only EOS is allowed, so the request ends with ``eos_token``.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict

import torch

from engine.transfer import to_device

log = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json", "regex")
# Compact separators as Python's json.dumps writes them; no free whitespace, which small
# models would otherwise be free to repeat forever. A schema's "x-guidance" overrides them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A grammar that does not compile; the message says why."""


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
                  "unevaluatedProperties", "unevaluatedItems", "propertyNames")


def close_objects(schema):
    """The schema with ``additionalProperties: false`` wherever an object lists its
    ``properties`` and says nothing about other keys (as TGI's outlines compiler and
    OpenAI's structured outputs treat them); every output still satisfies the original."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub) for sub in out[key]]
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = close_objects(out[key])
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in out and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def grammar_source(kind: str, text: str) -> str:
    """The llguidance grammar for a (kind, text) pair."""
    from llguidance import LLMatcher, regex_to_lark

    if kind == "json":
        try:
            schema = close_objects(json.loads(text))
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":   # \d means [0-9], as in TGI's outlines (not every Unicode digit)
        return LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(text, 'd')}/")
    raise GrammarError(f"grammar kind {kind!r} is not one of {', '.join(GRAMMAR_KINDS)}")


def grammar_error(kind: str, text: str) -> str | None:
    """None if the grammar compiles, else the compiler's message (no tokenizer needed)."""
    from llguidance import LLMatcher

    try:
        message = LLMatcher.validate_grammar(grammar_source(kind, text))
    except (GrammarError, ValueError) as e:
        return str(e)
    return _user_message(message) if message.strip() else None


def _user_message(message: str) -> str:
    """llguidance's message without its position prefix and the echo of its internal grammar."""
    lines = message.strip().splitlines()
    cut = next((i for i, line in enumerate(lines) if re.match(r"\s*\d+ \| ", line)), len(lines))
    return re.sub(r"^at \d+\(\d+\): ", "", "\n".join(lines[:cut]).strip())


def json_grammar_text(schema) -> str:
    """The JSON text of a schema (key order kept: it is the order properties are generated in)."""
    return json.dumps(schema, ensure_ascii=False)


class GrammarMatcher:
    """The grammar state of one request: which tokens may come next, advanced token by token."""

    def __init__(self, matcher, eos_ids: tuple[int, ...], failure: str | None = None):
        """``matcher`` is an llguidance ``LLMatcher``, or None with the ``failure`` that prevented one."""
        self._matcher = matcher
        self.eos_ids = eos_ids
        self._failure = failure
        if self.error is not None:
            log.error("grammar failed in the worker; the request ends with an error")
            log.debug("grammar failure: %s", self.error)       # may quote the request's grammar

    @property
    def only_eos(self) -> bool:
        """The grammar is complete, or failed: EOS is the one allowed token."""
        return self._matcher is None or self._matcher.is_error() or self._matcher.is_stopped()

    @property
    def raw(self):
        return self._matcher

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a grammar that did not compile, a rejected token), or None."""
        if self._matcher is None:
            return self._failure
        return self._matcher.get_error() if self._matcher.is_error() else None

    def advance(self, token_id: int) -> None:
        """Consume a sampled token; a token after completion (EOS again) is ignored."""
        if self.only_eos:
            return
        if not self._matcher.consume_token(token_id):
            log.error("grammar rejected sampled token %d", token_id)
            log.debug("grammar error: %s", self._matcher.get_error())      # may quote the request's grammar

    def fill_eos_only(self, words: torch.Tensor) -> None:
        words.zero_()
        for token in self.eos_ids:
            words[token // 32] |= _bit(token % 32)


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 word as a Python int in int32 range."""
    return -(2**31) if index == 31 else 1 << index


class GrammarCompiler:
    """Rank 0's grammar engine: the tokenizer and compiled grammars.

    The tokenizer (seconds for a large vocabulary) loads on a background thread from the
    start, so the first grammar request does not stall every stream's step while it loads.

    ``vocab_size`` is the width of the logits (the model's vocabulary, which may exceed
    the tokenizer's); ``eos_ids`` the tokens that end a request.
    """

    def __init__(self, model_dir: str, vocab_size: int, eos_ids: tuple[int, ...]):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self._tokenizer = None
        self._executor = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._load_error: BaseException | None = None
        self._loading = threading.Thread(target=self._load_in_background, name="grammar-tokenizer", daemon=True)
        self._loading.start()

    def _load_in_background(self) -> None:
        try:
            self._load()
            self._warm_masks()
        except BaseException as e:   # noqa: BLE001  (reported to the first grammar request)
            self._load_error = e

    def _warm_masks(self) -> None:
        """The first mask builds llguidance's token tables (0.8 s on the demo's vocabulary): once, here."""
        from llguidance import LLMatcher

        warm = LLMatcher(self._tokenizer, grammar_source("json", json_grammar_text({"type": "object"})), log_level=0)
        _fill_row(warm, torch.empty((1, self.words), dtype=torch.int32), 0)

    def wait_loaded(self) -> None:
        """Block until the background load ends (a failure is reported to grammar requests only)."""
        self._loading.join()

    def _ready(self) -> None:
        """Wait for the background load (done long before the first grammar request, mostly)."""
        self._loading.join()
        if self._load_error is not None:
            raise RuntimeError(f"the grammar engine could not load the tokenizer: {self._load_error}")

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _load(self) -> None:
        import llguidance
        import llguidance.hf
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if not self.eos_ids:
            self.eos_ids = (hf_tokenizer.eos_token_id,)
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size,
                                                       eos_token=list(self.eos_ids))
        self._executor = llguidance.LLExecutor()

    def matcher(self, kind: str, text: str) -> GrammarMatcher:
        """A fresh matcher for a request; the grammar compiles once per (kind, text).

        Never raises: whatever fails (no tokenizer, a grammar the front end should have
        refused) gives a matcher that allows only EOS, so the worker and its slots live on."""
        try:
            return GrammarMatcher(self._template(kind, text).deep_copy(), self.eos_ids)
        except Exception as e:  # noqa: BLE001  (a shard must survive any grammar)
            return GrammarMatcher(None, self.eos_ids, f"{type(e).__name__}: {e}")

    def _template(self, kind: str, text: str):
        from llguidance import LLMatcher

        self._ready()
        key = (kind, text)
        template = self._compiled.get(key)
        if template is None:
            template = LLMatcher(self._tokenizer, grammar_source(kind, text), log_level=0)
            self._compiled[key] = template
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return template

    def fill_bitmasks(self, matchers: list[GrammarMatcher], pin: bool = False) -> torch.Tensor:
        """Packed masks [len(matchers), words] int32 on the CPU, one row per matcher."""
        bitmask = torch.empty((len(matchers), self.words), dtype=torch.int32, pin_memory=pin)
        live = []
        for i, m in enumerate(matchers):
            if m.only_eos:
                m.fill_eos_only(bitmask[i])
            else:
                live.append((m.raw, i))
        if len(live) == 1:
            _fill_row(live[0][0], bitmask, live[0][1])
        elif live:
            self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), self.words * 4, len(matchers))
        return bitmask


# llguidance's own torch helpers (llguidance.torch) do what these two lines do, but importing that
# module compiles a torch.compile decorator's machinery (torch._dynamo, inductor): 3.4 s of every
# shard's start on a 2-core CPU, on the path to ready.
def _fill_row(matcher, bitmask: torch.Tensor, row: int) -> None:
    """Row ``row`` of a contiguous int32 CPU ``bitmask``: the tokens ``matcher`` allows next."""
    view = bitmask[row]
    matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True: allowed), on the bitmask's device."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(scores: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set the disallowed tokens of ``scores[rows]`` to -inf; ``bitmask`` is on the CPU."""
    device_mask = bitmask.to(scores.device, non_blocking=True)
    allowed = unpack_bitmask(device_mask, scores.shape[1])
    index = to_device(rows, torch.int64, scores.device)
    scores[index] = scores[index].masked_fill(~allowed, float("-inf"))
