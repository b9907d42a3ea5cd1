"""TGI's request validation (validation.rs `validate`): same checks, order and messages.

    1 best_of/sampling  2 temperature  3 repetition_penalty  4 frequency_penalty  5 top_p
    6 typical_p  7 top_k  8 max_new_tokens == 0  9 stop count  10 seed vs best_of
    11 top_n_tokens  12 empty inputs  13 truncate  14 tokenize, total tokens, input length
    15 grammar (compiled here: an invalid schema or regex is a 422, never an engine error)

The first failure wins. ``validate_best_of`` runs before, where TGI runs it (the
best_of path of the non-stream routes). Token limits use the pre-3.0 rule
``input_length + max_new_tokens <= max_total_tokens``; a null ``max_new_tokens`` takes
the whole remaining budget.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, replace

from engine.protocol.messages import SamplingParams
from engine.sampling.grammar import grammar_error, json_grammar_text

from .errors import InputValidationError
from .schema import GenerateParameters, GenerateRequest
from .settings import ServerSettings
from .tokenization import Encoding, TokenizerAdapter


@dataclass(frozen=True)
class ValidRequest:
    inputs: str
    input_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop_sequences: tuple[str, ...]
    best_of: int
    details: bool
    decoder_input_details: bool
    return_full_text: bool

    @property
    def input_length(self) -> int:
        return len(self.input_ids)


def validate_best_of(best_of: int | None, max_best_of: int) -> int:
    best_of = 1 if best_of is None else best_of
    if max_best_of == 1 and best_of != 1:
        raise InputValidationError("`best_of` != 1 is not allowed for this endpoint")
    if best_of == 0 or best_of > max_best_of:
        raise InputValidationError(f"`best_of` must be > 0 and <= {max_best_of}. Given: {best_of}")
    return best_of


def _sampling_requested(p: GenerateParameters) -> bool:
    """The router's notion of "sampling" for best_of (any warper set)."""
    return p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))


def _check_open_unit(name: str, value: float | None) -> float:
    if value is None:
        return 1.0
    if value <= 0.0 or value >= 1.0:
        raise InputValidationError(f"`{name}` must be > 0.0 and < 1.0")
    return value


def check_parameters(p: GenerateParameters, s: ServerSettings) -> SamplingParams:
    """Checks 1-11; the engine's sampling parameters (without prompt logprobs)."""
    best_of = 1 if p.best_of is None else p.best_of
    if best_of > 1 and not _sampling_requested(p):
        raise InputValidationError("you must use sampling when `best_of` is > 1")
    temperature = 1.0 if p.temperature is None else p.temperature
    if temperature <= 0.0:
        raise InputValidationError("`temperature` must be strictly positive")
    repetition_penalty = 1.0 if p.repetition_penalty is None else p.repetition_penalty
    if repetition_penalty <= 0.0:
        raise InputValidationError("`repetition_penalty` must be strictly positive")
    frequency_penalty = 0.0 if p.frequency_penalty is None else p.frequency_penalty
    if not -2.0 <= frequency_penalty <= 2.0:
        raise InputValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    top_p = _check_open_unit("top_p", p.top_p)
    typical_p = _check_open_unit("typical_p", p.typical_p)
    if p.top_k is not None and p.top_k <= 0:
        raise InputValidationError("`top_k` must be strictly positive")
    top_k = p.top_k or 0
    if p.max_new_tokens == 0:
        raise InputValidationError("`max_new_tokens` must be strictly positive")
    if len(p.stop) > s.max_stop_sequences:
        raise InputValidationError(
            f"`stop` supports up to {s.max_stop_sequences} stop sequences. Given: {len(p.stop)}")
    if p.seed is not None and best_of > 1:
        raise InputValidationError("`seed` must not be set when `best_of` > 1")
    top_n_tokens = p.top_n_tokens or 0
    if top_n_tokens > s.max_top_n_tokens:
        raise InputValidationError(
            f"`top_n_tokens` must be >= 0 and <= {s.max_top_n_tokens}. Given: {top_n_tokens}")
    sampled = p.do_sample or temperature != 1.0 or top_k != 0 or top_p < 1.0 or typical_p < 1.0
    return SamplingParams(
        do_sample=sampled, temperature=temperature, top_k=top_k, top_p=top_p, typical_p=typical_p,
        repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
        seed=p.seed, top_n_tokens=top_n_tokens)


def check_truncate(truncate: int | None, s: ServerSettings) -> None:
    if truncate is not None and (truncate == 0 or truncate > s.max_input_tokens):
        raise InputValidationError(
            f"`truncate` must be strictly positive and less than {s.max_input_tokens}. Given: {truncate}")


def check_lengths(input_length: int, max_new_tokens: int | None, s: ServerSettings) -> int:
    """Check 14 after tokenization; returns the effective max_new_tokens."""
    if max_new_tokens is None:
        max_new_tokens = max(0, s.max_total_tokens - input_length)
    if input_length + max_new_tokens > s.max_total_tokens:
        raise InputValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {s.max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`")
    if input_length > s.max_input_tokens:
        raise InputValidationError(
            f"`inputs` must have less than {s.max_input_tokens} tokens. Given: {input_length}")
    return max_new_tokens


GRAMMAR_CACHE_SIZE = 1024


def grammar_text(grammar: dict) -> tuple[str, str]:
    """TGI's ``GrammarType`` -> the engine's (kind, text): ("json", schema as JSON) or ("regex", pattern).

    json and its alias json_object take a schema (an object, or a string holding one);
    json_schema takes ``{"name": ..., "schema": {...}}``. TGI's messages for what is wrong.
    """
    kind, value = grammar["type"], grammar["value"]
    if kind == "regex":
        return "regex", value
    schema = value["schema"] if kind == "json_schema" else value
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InputValidationError(f"grammar is not valid: {e}") from None
    elif not isinstance(schema, dict):
        raise InputValidationError("grammar is not supported")
    if not isinstance(schema, dict) or "properties" not in schema:
        raise InputValidationError("grammar is not valid: Grammar must have a 'properties' field")
    return "json", json_grammar_text(schema)


class GrammarChecker:
    """Compiles grammars (off the event loop) and remembers the verdict per (kind, text)."""

    def __init__(self, size: int = GRAMMAR_CACHE_SIZE):
        self.size = size
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        grammar_error("regex", "a")     # import and warm the grammar engine now, not on a request's thread

    async def check(self, kind: str, text: str) -> None:
        key = (kind, text)
        if key not in self._verdicts:
            self._verdicts[key] = await asyncio.to_thread(grammar_error, kind, text)
            if len(self._verdicts) > self.size:
                self._verdicts.popitem(last=False)
        error = self._verdicts[key]
        if error is not None:
            raise InputValidationError(f"grammar is not valid: {error}")


async def check_grammar(p: GenerateParameters, s: ServerSettings, checker: GrammarChecker) -> dict:
    """Check 15: the grammar compiles; the SamplingParams fields that carry it."""
    if p.grammar is None:
        return {}
    if s.disable_grammar_support:
        raise InputValidationError("grammar is not supported")
    kind, text = grammar_text(p.grammar)
    await checker.check(kind, text)
    return {"grammar_type": kind, "grammar": text}


def check_unsupported(p: GenerateParameters, s: ServerSettings) -> None:
    """Features this server does not implement fail loudly instead of being ignored."""
    if p.adapter_id not in (None, "", s.model_id):
        raise InputValidationError(
            f"`adapter_id` {p.adapter_id!r} is not available: this server only serves {s.model_id!r}")


# A prompt of more characters than this many times --max-input-tokens times the longest token
# cannot fit (even where a normalizer drops some characters): refused before it is tokenized.
CHARS_MARGIN = 2


class Validator:
    def __init__(self, settings: ServerSettings, tokenizer: TokenizerAdapter,
                 whole_turn: asyncio.Semaphore | None = None):
        self.settings = settings
        self.tokenizer = tokenizer
        self.grammars = GrammarChecker()
        self.max_chars = settings.max_input_tokens * tokenizer.longest_token_chars * CHARS_MARGIN
        # the turn of a text no prompt could be to be tokenized whole (shared by the validators of a front end)
        self._whole_turn = whole_turn or asyncio.Semaphore(1)

    def start_tokenizing(self, request: GenerateRequest) -> Future | None:
        """Begin tokenizing a prompt as soon as its body is parsed; ``validate(..., started=)`` takes
        the result at check 14, after checks 1-13 as ever (a stream's checks run once its response
        has started, behind every request parsed before it: under a burst the worker threads would
        wait for the event loop). None for a text check 14 refuses untokenized (or an empty one).
        The caller cancels it when validation does not run."""
        inputs = request.inputs
        if not inputs or len(inputs) > self.max_chars:
            return None
        return self.tokenizer.submit(inputs)

    async def tokenize(self, inputs: str, truncate: int | None, offsets: bool = False,
                       started: Future | None = None) -> Encoding:
        """The tokens of ``inputs`` (the last ``truncate`` of them; ``offsets``: with their byte
        offsets; ``started``: ``start_tokenizing``'s encoding of them); a text far too long for
        --max-input-tokens without ``truncate`` is refused first, in constant time."""
        if truncate is None and len(inputs) > self.max_chars:
            longest = self.tokenizer.longest_token_chars
            raise InputValidationError(
                f"`inputs` must have less than {self.settings.max_input_tokens} tokens. Given: {len(inputs)} "
                f"characters, at least {len(inputs) // (longest * CHARS_MARGIN)} tokens")
        return (await self._encode(inputs, offsets, started)).keep_last(truncate)

    @contextlib.asynccontextmanager
    async def whole_tokens(self, inputs: str):
        """/tokenize and /chat_tokenize (TGI `Validation::tokenize`): every token of ``inputs``, with offsets,
        while the caller writes its answer. No prompt limit applies and `truncate` is not applied (TGI's
        `prepare_input` ignores it); --payload-limit bounds the text. A text no prompt could be (over
        ``max_chars``) waits for the one before it: its encoding takes about 0.25 KB a character (1.9 MB
        of text, 450 MB), so that many at once could exhaust the front end's memory."""
        async with self._whole_turn if len(inputs) > self.max_chars else contextlib.nullcontext():
            yield await self._encode(inputs, offsets=True)

    async def _encode(self, inputs: str, offsets: bool, started: Future | None = None) -> Encoding:
        try:
            if started is None:
                started = self.tokenizer.submit(inputs, offsets=offsets)
            return await asyncio.wrap_future(started)
        except Exception as e:   # the Rust tokenizer's errors are not a fixed set
            raise InputValidationError(f"tokenizer error {e}") from e

    async def validate(self, request: GenerateRequest, return_full_text_default: bool,
                       started: Future | None = None) -> ValidRequest:
        """``started``: ``start_tokenizing(request)``, or None to tokenize at check 14."""
        p, s = request.parameters, self.settings
        params = check_parameters(p, s)
        if not request.inputs:
            raise InputValidationError("`inputs` cannot be empty")
        check_truncate(p.truncate, s)
        encoding = await self.tokenize(request.inputs, p.truncate, started=started)
        max_new_tokens = check_lengths(len(encoding.ids), p.max_new_tokens, s)
        grammar = await check_grammar(p, s, self.grammars)
        check_unsupported(p, s)
        params = replace(params, watermark=p.watermark, **grammar)
        if p.decoder_input_details and s.enable_prefill_logprobs:
            params = replace(params, prompt_logprobs=True)
        return ValidRequest(
            inputs=request.inputs, input_ids=encoding.ids, max_new_tokens=max_new_tokens, params=params,
            stop_sequences=p.stop, best_of=1 if p.best_of is None else p.best_of, details=p.details,
            decoder_input_details=p.decoder_input_details,
            return_full_text=return_full_text_default if p.return_full_text is None else p.return_full_text)
