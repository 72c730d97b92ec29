"""`opencann.llm.compile(model, max_seq_len=...) -> Generator`: text generation for a
transformers causal LM with a preallocated KV cache, prefill and decode step graphs
(`opencann.llm.steps`) and transformers-compatible ``generate``.

How a call runs: the prompts (a padded LongTensor with its left-padding attention_mask,
or a list of prompts) are stripped of their padding and right-padded to a prefill bucket;
the prefill graph writes every layer's cache from position 0 and returns each row's
last-token logits; then one decode graph per batch size runs a step per new token, each
row at its own position (positions and live lengths are data). Tokens are chosen by
`opencann.llm.sampling` (transformers' logits processors); rows stop at a stop token and
are then filled with the pad token, as transformers' ``generate`` does, and the call
returns the prompts as given followed by the new tokens. ``Generator.stats``
(`GenerationStats`) reports TTFT, prefill and decode rates, graphs built, recompiles,
memory plans and KV-cache bytes.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch

from ..devices import parse_device
from ..devices.cpu import memory_bytes
from ..engine.guards import AttributeChanged, WeightChanged
from .arch import LLMArch
from .builder import DecoderLM, new_caches
from .prompts import PromptBatch, mask_pad_id, prepare
from .sampling import UNSET, Sampler, resolve
from .stats import GenerationStats
from .steps import BACKENDS, StepGraphs, batch_sizes, prefill_buckets, smallest

#: new tokens when neither the call nor the model's generation_config sets a length
#: (transformers' generate: its default max_length of 20 counts new tokens)
DEFAULT_NEW_TOKENS = 20

#: keys of ``options`` taken by opencann.llm; the others are opencann.compile options
LLM_OPTIONS = ("backend", "prefill_buckets", "batch_sizes")
#: the step-graph backend when ``options`` names none
DEFAULT_BACKEND = "opencann"


def _split_options(options: Optional[Dict[str, Any]]) -> "tuple[Dict[str, Any], Dict[str, Any]]":
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"options must be a dict such as {{'prefill_buckets': [32, 128]}}, got "
                         f"{type(options).__name__}")
    ours = {k: v for k, v in (options or {}).items() if k in LLM_OPTIONS}
    rest = {k: v for k, v in (options or {}).items() if k not in LLM_OPTIONS}
    backend = ours.get("backend", DEFAULT_BACKEND)
    if backend not in BACKENDS:
        raise ValueError(f"option 'backend' takes {' or '.join(map(repr, BACKENDS))}, got {backend!r}")
    if rest:   # every option error now, not at the first generate (graphs build then)
        from ..engine import check_compile_options
        check_compile_options(rest)
    return ours, rest


def compile(model: torch.nn.Module, max_seq_len: int, max_batch: int = 1, device: str = "cpu",
            options: Optional[Dict[str, Any]] = None) -> "Generator":
    """A `Generator` for ``model``, a transformers causal LM in float32 (GPT-2, Llama,
    Mistral, Qwen2 families; `opencann.llm.arch`), with KV caches for ``max_batch``
    prompts of up to ``max_seq_len`` cache positions (prompt + generated; the last new
    token takes none, so a row may end max_seq_len + 1 long): 2 * layers * max_batch *
    kv_heads * max_seq_len * head_dim * 4 bytes, allocated here.

    ``options``: ``backend`` ("eager": torch runs the step graphs; "opencann": each is
    compiled by ``opencann.compile``), ``prefill_buckets`` (prompt lengths prefill graphs
    are built for; default multiples of 8 up to 64, then four per octave, and
    max_seq_len: `steps.prefill_buckets`), ``batch_sizes``
    (default powers of two up to max_batch); any other key is an ``opencann.compile``
    option. Graphs are built on first use (`Generator.stats` counts them).
    The model's train/eval mode is left as it is and does not matter: the generator
    computes the eval-mode logits (no dropout) in either. Under ``torch.inference_mode()``
    or not, and whatever torch's default dtype, the caches, weights and graphs it makes
    are ordinary float32 tensors: the model stays trainable.
    ``max_seq_len`` and ``max_batch``: Python or NumPy ints.
    Raises ValueError (one line) for an unsupported architecture or dtype, a model
    without an LM head, max_seq_len beyond the model's positions or sliding window, a
    device other than "cpu", a bad option, KV caches larger than the machine's memory
    (checked before they are allocated)."""
    if not isinstance(device, str) or (device != "cpu" and device.split(":")[0] != "vnpu"):
        raise ValueError(f"opencann.llm runs on device 'cpu' or 'vnpu[:<preset>]' (where its decode "
                         f"attention and KV-cache kernels exist), got {device!r}")
    parse_device(device)     # DeviceError (one line) for an unknown vnpu preset
    # NumPy (or 0-d tensor) integers as Python ints, as the bucket and batch options take
    # them: the sizes reach the model file's JSON metadata (`Generator.save`)
    max_seq_len, max_batch = _as_id(max_seq_len), _as_id(max_batch)
    ours, rest = _split_options(options)
    # the model's train/eval mode is left as it is: DecoderLM never applies dropout
    return Generator(DecoderLM(model), max_seq_len, max_batch, device, ours, rest,
                     getattr(model, "generation_config", None))


class Generator:
    """Generation over preallocated KV caches (built by `compile`).

    Attributes: ``lm`` (`DecoderLM`; None when loaded from a file), ``arch``,
    ``max_seq_len``, ``max_batch``, ``caches`` (2 * L tensors [max_batch, Hkv,
    max_seq_len, D] float32), ``buckets`` (prefill prompt lengths), ``batch_sizes``,
    ``backend``, ``stats`` (`GenerationStats`), ``generation_config`` (the model's,
    defaults for `generate`), ``tokenizer`` (None unless set, or loaded with the file:
    `save` stores it).

    A generator loaded by `opencann.llm.load` is built with ``lm=None``, the file's
    ``arch`` and its compiled step ``graphs`` ((batch, tokens) -> CompiledModel) and
    never compiles."""

    @torch.inference_mode(False)   # caches and step graphs outlive the caller's mode
    def __init__(self, lm: Optional[DecoderLM], max_seq_len: int, max_batch: int, device: str,
                 llm_options: Dict[str, Any], compile_options: Dict[str, Any],
                 generation_config: Any = None, arch: Optional[LLMArch] = None,
                 graphs: Optional[Dict[Any, Any]] = None, source: str = ""):
        self.lm, self.arch = lm, lm.arch if lm is not None else arch
        self.arch.check_max_seq_len(max_seq_len)
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        if lm is not None:
            lm.rope_table(max_seq_len)   # each step gathers its cos/sin rows
        self.batch_sizes = batch_sizes(max_batch, llm_options.get("batch_sizes"))
        _check_cache_fits(self.arch, max_batch, max_seq_len, loaded=lm is None)
        self.buckets = prefill_buckets(max_seq_len, llm_options.get("prefill_buckets"))
        self.backend = llm_options.get("backend", DEFAULT_BACKEND)
        self.generation_config = generation_config
        self.tokenizer: Any = None
        self.caches = new_caches(self.arch, max_batch, max_seq_len)
        self.stats = GenerationStats(kv_cache_bytes=sum(c.nbytes for c in self.caches))
        self.steps = StepGraphs(lm, self.caches, self.backend, device, compile_options,
                                self.stats, loaded=graphs, source=source)
        self._lock = threading.Lock()
        self._owner: Optional[int] = None   # the thread whose call holds the lock

    def save(self, path: str, tokenizer: Any = None, graphs: str = "all") -> Dict[str, Any]:
        """Write this generator to ONE model file ``path`` (``*.ocm``, format 4: a bundle,
        `opencann.llm.saving`): its compiled step graphs with the weights stored once,
        the KV-cache layout, the architecture, the generation defaults (the model's
        generation_config: eos, pad, sampling settings) and ``tokenizer`` (default
        ``self.tokenizer``; a transformers tokenizer, its files stored inside). ``graphs``:
        ``"all"`` builds first every step graph a call can need (a prefill graph per bucket
        and batch size, a decode graph per batch size: the loaded generator never
        compiles), ``"built"`` saves those built so far. `opencann.llm.load` or
        `opencann.load` reads it back. Returns the file's sections (name, offset, size,
        sha256). Raises ValueError (one line) on the eager backend, for a bad
        ``graphs``, for a weight or module attribute of the model changed since the step
        graphs were built (the error `generate` gives: the file would hold weights the
        generator refuses), or when called from the streamer of this generator's
        running `generate`; ModelFileError for a bad path, OSError when writing fails."""
        from .saving import save
        return save(self, path, tokenizer=tokenizer, graphs=graphs)

    def __repr__(self) -> str:
        a = self.arch
        return (f"Generator({a.model_type}, {a.num_layers} layers, max_seq_len={self.max_seq_len}, "
                f"max_batch={self.max_batch}, backend={self.backend!r}, buckets={list(self.buckets)})")

    def report(self) -> str:
        """What this generator is and built: the architecture, cache, buckets and batch
        sizes, each step graph (with its compile report's fusions and memory on the
        opencann backend), and `GenerationStats.summary`."""
        a = self.arch
        head = (f"opencann.llm generator: {a.model_type}, {a.num_layers} layer{'s' * (a.num_layers != 1)}, hidden "
                f"{a.hidden_size}, heads {a.num_heads}/{a.num_kv_heads} (q/kv), vocab {a.vocab_size}; "
                f"backend {self.backend}\n  KV cache: {self.max_batch} x {self.max_seq_len} "
                f"positions, {self.stats.kv_cache_bytes / 2**20:.2f} MiB\n  prefill buckets: "
                f"{list(self.buckets)}; batch sizes: {list(self.batch_sizes)}")
        graphs = self.steps.report()
        return "\n".join([head, "  graphs built:" + ("" if graphs else " none yet")]
                         + ["    " + ln for ln in graphs.splitlines()]
                         + ["  last call: " + self.stats.summary()])

    def _stop_tokens(self, eos: Any, given: bool) -> List[int]:
        """Stop token ids; one outside the vocabulary raises ValueError when ``given``
        in the call, and is dropped when it comes from the model's generation_config
        (it can never be generated)."""
        if isinstance(eos, (torch.Tensor, np.ndarray)):   # transformers takes a tensor of ids too
            eos = eos.tolist()
        eos = _as_id(eos)
        ids = ([] if eos is None else [_as_id(t) for t in eos] if isinstance(eos, (list, tuple, set))
               else [eos])
        for t in ids:
            if given and (isinstance(t, bool) or not isinstance(t, int)):
                raise ValueError(f"stop token {t!r} (eos_token_id) is not an integer id; pass an "
                                 f"int or a list of ints in [0, {self.arch.vocab_size})")
            if given and not 0 <= t < self.arch.vocab_size:
                raise ValueError(f"stop token {t!r} (eos_token_id) is outside the vocabulary "
                                 f"[0, {self.arch.vocab_size}); pass ids the model can generate")
        return [t for t in ids if isinstance(t, int) and not isinstance(t, bool)
                and 0 <= t < self.arch.vocab_size]

    def _pad_token(self, pad: Any, given: bool, stops: List[int]) -> int:
        """The id rows are padded and filled with after their stop token: ``pad`` when it
        is in the vocabulary (the decode step embeds it), else the first stop token, else
        0 (as transformers for a pad of None). One outside the vocabulary raises
        ValueError when ``given`` in the call."""
        pad = _as_id(pad)
        ok = isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < self.arch.vocab_size
        if given and not ok and pad is not None:
            if not isinstance(pad, int) or isinstance(pad, bool):
                raise ValueError(f"pad_token_id {pad!r} is not an integer id: pass an int in "
                                 f"[0, {self.arch.vocab_size}) or None")
            raise ValueError(f"pad_token_id {pad!r} is outside the vocabulary "
                             f"[0, {self.arch.vocab_size}); pass an id the model can embed")
        return pad if ok else (stops[0] if stops else 0)

    def _length(self, gc, batch: PromptBatch, given: Dict[str, Any]) -> "tuple[Any, str]":
        """(new tokens, where the count came from) of a call: ``max_new_tokens``, else a
        ``max_length`` (counting the prompt), else transformers' default
        (GenerationMixin._prepare_generated_length: `DEFAULT_NEW_TOKENS` new tokens, the
        whole sequence capped at the config's ``max_position_embeddings``, RoPE scaling not
        counted: `LLMArch.default_length_cap`). Raises ValueError (one line) where that cap
        or ``max_length`` leaves no new token after the prompt, as transformers does."""
        new = _as_id(gc.max_new_tokens)
        if new is not None:
            return new, f"max_new_tokens={new}"
        L = batch.sequences.shape[1]
        if gc.max_length is None:
            limit = self.arch.default_length_cap
            if limit and limit - L < 1:
                raise ValueError(f"max_new_tokens not given, and transformers' default length "
                                 f"({DEFAULT_NEW_TOKENS} new tokens, the sequence capped at the "
                                 f"config's max_position_embeddings {limit}) leaves none after a "
                                 f"prompt of {L} tokens: pass max_new_tokens")
            new = min(DEFAULT_NEW_TOKENS, limit - L) if limit else DEFAULT_NEW_TOKENS
            return new, f"transformers' default of {new} new tokens (no max_new_tokens given)"
        length = _as_id(gc.max_length)
        if isinstance(length, bool) or not isinstance(length, int):
            raise ValueError(f"max_length must be a positive int (prompt + new tokens), got "
                             f"{length!r:.40}")
        src = "max_length=" if "max_length" in given else "the generation_config's max_length "
        if length - L < 1:
            raise ValueError(f"max_new_tokens not given, and {src}{length} leaves none after a "
                             f"prompt of {L} tokens: pass max_new_tokens")
        return length - L, f"{src}{length} ({length - L} new tokens; no max_new_tokens given)"

    def _budget(self, gc, batch: PromptBatch, given: Dict[str, Any]) -> int:
        """The call's new-token count (`_length`); raises ValueError (one line) when it
        is not a positive int or the prompt and it do not fit the cache, naming what
        applies to this generator (`_larger_cache`)."""
        longest = int(batch.lengths.max())
        if longest > self.max_seq_len:
            raise ValueError(f"a prompt of {longest} tokens exceeds max_seq_len {self.max_seq_len}"
                             f"; shorten the prompt or {self._larger_cache()}")
        new, asked = self._length(gc, batch, given)
        if isinstance(new, bool) or not isinstance(new, int) or new < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {new!r:.40}")
        if longest + new - 1 > self.max_seq_len:
            raise ValueError(f"a prompt of {longest} tokens plus {asked} needs "
                             f"{longest + new - 1} cache positions but max_seq_len is "
                             f"{self.max_seq_len}; {self._larger_cache()} or ask for "
                             f"at most {self.max_seq_len - longest + 1} new tokens")
        return new

    def _larger_cache(self) -> str:
        """How to get a longer cache: compile again, or, for a generator loaded from a
        file (its cache length is the file's), save one compiled with a larger one."""
        if self.lm is None:
            return (f"save a generator compiled with a larger max_seq_len (the cache length of "
                    f"{self.steps.source or 'a loaded file'} is fixed)")
        return "compile with a larger max_seq_len"

    def generate(self, input_ids, max_new_tokens: Any = UNSET,
                 attention_mask: Optional[torch.Tensor] = None, do_sample: Any = UNSET,
                 temperature: Any = UNSET, top_k: Any = UNSET, top_p: Any = UNSET,
                 min_p: Any = UNSET, seed: Optional[int] = None, repetition_penalty: Any = UNSET,
                 eos_token_id: Any = UNSET, pad_token_id: Any = UNSET,
                 streamer: Any = None, **settings: Any) -> torch.Tensor:
        """Generate up to ``max_new_tokens`` tokens per prompt; returns LongTensor
        [B, L + n] (the prompts as given, left-padded, then n <= max_new_tokens new
        tokens; rows that stopped early are filled with the pad token), as transformers'
        ``generate`` does.

        ``input_ids``: LongTensor [B, L] (or [L]) with ``attention_mask`` [B, L] (0 on
        the left for padding; without one, as transformers' generate, a set
        ``pad_token_id`` that is no stop token marks padding where it occurs:
        `prompts.mask_pad_id`), or a list of prompts of any lengths. Settings not given
        come from the model's generation_config (`opencann.llm.sampling.resolve`; one
        given as None sets None, as in transformers: ``eos_token_id=None`` stops at no
        token): ``do_sample`` (False: greedy), ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, ``repetition_penalty``, ``eos_token_id`` (stop token id or list of
        ids), ``pad_token_id`` (default: the first stop token, else 0), and in
        ``settings`` ``max_length``, ``min_length``, ``min_new_tokens`` or any other
        transformers GenerationConfig field left at its default; ``seed`` (int: a
        private torch.Generator, reproducible; None: the global RNG). ``streamer``: a
        callable taking each step's new tokens (LongTensor [B]), or a transformers
        streamer (``put``/``end``, e.g. TextStreamer).
        Raises ValueError (one line) for a bad prompt, batch over max_batch, prompt +
        max_new_tokens over max_seq_len, a stop or pad token outside the vocabulary, a bad
        setting, or a transformers setting it does not apply (num_beams, top_h, ...; in
        the call or the generation_config); the generator stays usable. Calls from
        several threads run one at a time (the caches are the generator's state). The step graphs' guards (weights and module
        attributes unchanged since compile) run at each call's prefill and first decode
        step, not at every token: a weight changed by a streamer mid-call raises at the
        next call."""
        settings.update(max_new_tokens=max_new_tokens, do_sample=do_sample, top_k=top_k,
                        temperature=temperature, top_p=top_p, min_p=min_p, pad_token_id=pad_token_id,
                        repetition_penalty=repetition_penalty, eos_token_id=eos_token_id)
        given = {k: v for k, v in settings.items() if v is not UNSET}
        gc = resolve(self.generation_config, **given)
        stops = self._stop_tokens(gc.eos_token_id, "eos_token_id" in given)
        pad = self._pad_token(gc.pad_token_id, "pad_token_id" in given, stops)
        batch = prepare(input_ids, attention_mask, vocab_size=self.arch.vocab_size,
                        max_batch=self.max_batch, pad_token_id=pad,
                        mask_pad=mask_pad_id(gc.pad_token_id, gc.eos_token_id))
        new = self._budget(gc, batch, given)
        sampler = Sampler(gc, batch.padding if bool(batch.padding.any()) else None, seed,
                          stops=stops, prompt_len=batch.sequences.shape[1])
        emit = _streamer(streamer, batch.sequences)
        with self._locked("generate()"):
            try:
                out = self._run(batch, new, sampler, stops, pad, emit)
            except (WeightChanged, AttributeChanged) as e:
                raise self._changed(e) from None
        if hasattr(streamer, "end"):
            streamer.end()
        return out

    @contextlib.contextmanager
    def _locked(self, what: str) -> Iterator[None]:
        """Hold the generator (its caches and step graphs) for one call of ``what``
        (``"generate()"``, ``"Generator.save()"``): calls from other threads wait their
        turn; a call from the streamer of this thread's running generate is one
        ValueError line (the lock is not re-entrant: it would wait for itself). Inside,
        grad is off and inference mode too, whatever the caller's: what the call builds
        or writes (graphs built on first use, the weights laid out for them, the caches)
        stays usable outside it (``torch.inference_mode()`` tensors refuse in-place
        writes and graph capture there)."""
        if self._owner == threading.get_ident():   # the streamer of this thread's call
            raise ValueError(f"{what} was called from its own streamer: the running "
                             f"generate() owns the KV caches and step graphs until it "
                             f"returns; call {what} after it")
        with self._lock, torch.inference_mode(False), torch.no_grad():
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def _check_unchanged(self) -> None:
        """Run the built step graphs' guards over the model (weights, module attributes)
        as the next call's would: `WeightChanged` / `AttributeChanged` (`_changed` makes
        them the user's one line). Every step graph watches the same weights and
        attributes, so one built graph's guards answer for all."""
        cm = next(iter(self.steps.compiled().values()), None)
        for g in (cm.guards if cm is not None else ()):
            if g.name in ("frozen_weights", "unrecorded_writes", "module_attributes"):
                g.check(None)

    def _step(self, batch: int, tokens: int) -> Callable:
        """`StepGraphs.step`, the built graphs' guards run first (`_check_unchanged`)
        when it builds a new graph: that one would bake in a weight or attribute changed
        since, where the built ones refuse it (another prompt bucket or batch size would
        then serve what the first refuses)."""
        if (batch, tokens) not in self.steps.keys():
            self._check_unchanged()
        return self.steps.step(batch, tokens)

    def _changed(self, e: Exception) -> ValueError:
        """The one-line error for a weight (`WeightChanged`: a parameter, or a buffer such
        as a rotary module's ``inv_freq``) or module attribute (`AttributeChanged`) of the
        compiled model changed after `compile` (``e`` from a step graph's guards), naming
        the user's parameter, buffer or attribute."""
        again = (f"compile it again after changing {{}}: opencann.llm.compile(model, "
                 f"max_seq_len={self.max_seq_len}, max_batch={self.max_batch})")
        if isinstance(e, AttributeChanged):
            name = self.lm.source_attribute(e.name) if self.lm is not None else repr(e.name)
            return ValueError(f"module attribute {name} was {e.was!r} at opencann.llm.compile "
                              f"and is {e.now} now: the generator's step graphs baked its "
                              f"value in; " + again.format("it"))
        name = self.lm.source_name(e.name) if self.lm is not None else repr(e.name)
        detail = f" ({e.detail})" if e.detail else ""
        if self.lm is not None and e.name in dict(self.lm.named_buffers()):
            return ValueError(
                f"buffer {name} {e.how} after opencann.llm.compile{detail}: the generator's "
                f"step graphs were built from the model's buffers as they were then (the RoPE "
                f"cos/sin table from a rotary module's inv_freq); " + again.format("it"))
        return ValueError(
            f"parameter {name} {e.how} after opencann.llm.compile{detail}: the generator's "
            f"step graphs hold packed copies of the weights made at compile time; "
            + again.format("weights"))

    def _prefill(self, batch: PromptBatch) -> torch.Tensor:
        """Logits [B, vocab] of each prompt's last token; writes the caches. Each row is
        right-padded to the bucket with its own last token, and a batch padded to its
        batch size with copies of the first row: padding computes what real tokens do,
        finite wherever they are (an id the prompts never hold may embed to NaN), and
        `attend` zeroes the padded keys and values whatever they are."""
        B, bs = batch.batch, smallest(self.batch_sizes, batch.batch)
        T = smallest(self.buckets, int(batch.lengths.max()))
        ids = torch.empty(bs, T, dtype=torch.long)
        lengths = torch.empty(bs, dtype=torch.long)
        for b, row in enumerate(batch.rows):
            ids[b, :len(row)], ids[b, len(row):] = row, row[-1]
        ids[B:], lengths[:B], lengths[B:] = ids[0], batch.lengths, batch.lengths[0]
        return self._step(bs, T)(ids, torch.zeros(bs, dtype=torch.long), lengths)[:B]

    def _run(self, batch: PromptBatch, new: int, sampler: Sampler, stops: Sequence[int],
             pad: int, emit: Callable) -> torch.Tensor:
        """Prefill, then up to ``new`` tokens per row; the sequences [B, L + generated].
        The per-token bookkeeping (stop tokens, positions, the sequences) runs in NumPy
        on views of the step's input tensors: right after a decode step has streamed the
        weights through the caches, each small torch op cost 20-40 µs (six of them: ~0.25
        ms a token, 1.5% of a 125M Llama's step on 2 cores)."""
        start = self.stats.begin_call()
        B, bs = batch.batch, smallest(self.batch_sizes, batch.batch)
        L = batch.sequences.shape[1]
        seqs = torch.empty(B, L + new, dtype=torch.long)
        seqs[:, :L] = batch.sequences
        seq_np, stop = seqs.numpy(), np.asarray(stops, dtype=np.int64)
        logits = self._prefill(batch)
        prefill_s = time.perf_counter() - start
        alive = np.ones(B, dtype=bool)
        ids = torch.zeros(bs, 1, dtype=torch.long)
        positions = torch.zeros(bs, dtype=torch.long)
        positions[:B] = batch.lengths
        lengths, decode = positions + 1, None
        ids_np, pos_np, len_np = ids.numpy(), positions.numpy(), lengths.numpy()
        t0, steps, rows, warm, n = 0.0, 0, 0, None, L
        for i in range(new):
            tok = sampler(seqs[:, :n] if sampler.processors else None, logits).numpy()
            tok = np.where(alive, tok, pad)
            seq_np[:, n] = tok
            n += 1
            if i == 0:
                self.stats.prefill_done(start, int(batch.lengths.sum()), prefill_s)
                t0 = time.perf_counter()
            if len(stop):   # not np.isin: it sorts (80 µs a token)
                alive &= ~(tok[:, None] == stop).any(axis=1)
            ids_np[:B, 0], ids_np[B:, 0] = tok, tok[0]   # batch padding: a real row's token
            # streamed after every use of ``tok`` (as transformers' generate appends the
            # tokens before it streams them): a streamer writing into its tensor changes
            # neither the result, the stop check nor the next step's input
            emit(torch.from_numpy(tok))
            if i == new - 1 or not alive.any():
                break
            if decode is None:   # the call's first step: the decode graph's guards run
                decode = self._step(bs, 1)
                logits = decode(ids, positions, lengths)
                # nothing they watch changes inside a call: later steps skip them
                decode = getattr(decode, "unguarded", decode)
            else:
                logits = decode(ids, positions, lengths)
            if bs != B:
                logits = logits[:B]
            pos_np[:B] += 1
            len_np[:B] += 1
            steps, rows = steps + 1, rows + int(alive.sum())
            if warm is None:
                warm = (self.stats.graphs_built, self.stats.memory_plans)
        self.stats.decode_done(steps, rows, time.perf_counter() - t0)
        if warm is not None:
            self.stats.graphs_built_after_warmup = self.stats.graphs_built - warm[0]
            self.stats.plans_built_after_warmup = self.stats.memory_plans - warm[1]
        # a copy of its own: a view of the buffer (what .contiguous() gives for one row)
        # would hold, and torch.save would write, the unused L + new - n columns
        return seqs if n == L + new else seqs[:, :n].clone(memory_format=torch.contiguous_format)


def _gib(nbytes: int) -> str:
    x = nbytes / 2 ** 30
    return f"{x:,.1f}" if x >= 0.1 else f"{x:.2g}"


def _check_cache_fits(arch: LLMArch, max_batch: int, max_seq_len: int, loaded: bool) -> None:
    """Raise ValueError (one line) before allocating when the KV caches (2 * layers *
    max_batch * kv_heads * max_seq_len * head_dim * 4 bytes, `LLMArch.kv_cache_bytes`)
    exceed the machine's memory (`devices.cpu.memory_bytes`), naming both in GiB and
    how to shrink the cache (a loaded generator's is the file's)."""
    need, have = arch.kv_cache_bytes(max_batch, max_seq_len), memory_bytes()
    if have and need > have:
        a = arch
        fix = ("save a generator compiled with a smaller max_batch or max_seq_len (a loaded "
               "file's cache size is fixed)" if loaded else
               "compile with a smaller max_batch or max_seq_len")
        raise ValueError(f"the KV cache for max_batch={max_batch} and max_seq_len={max_seq_len} needs "
                         f"{_gib(need)} GiB (2 x {a.num_layers} layers x {max_batch} x {a.num_kv_heads} "
                         f"kv heads x {max_seq_len} x {a.head_dim} head_dim x 4 bytes), more than "
                         f"this machine's {_gib(have)} GiB of memory: {fix}")


def _as_id(x: Any) -> Any:
    """``x`` as a Python int where it is a NumPy integer or a one-element integer tensor
    (a tokenizer's output; transformers' generate takes them), else ``x`` itself."""
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, torch.Tensor) and x.ndim == 0 and not x.dtype.is_floating_point \
            and x.dtype != torch.bool:
        return int(x.item())
    return x


def _streamer(streamer: Any, prompts: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A per-step callback from ``streamer``: None, a callable (called with each step's
    tokens [B]), or a transformers streamer (``put`` the prompts now, then each step)."""
    if streamer is None:
        return lambda tok: None
    if hasattr(streamer, "put"):
        streamer.put(prompts)
        return streamer.put
    if not callable(streamer):
        raise ValueError(f"streamer must be a callable taking a LongTensor of new tokens [batch] "
                         f"or a transformers streamer, got {type(streamer).__name__}")
    return streamer


__all__ = ["DEFAULT_BACKEND", "Generator", "LLM_OPTIONS", "compile"]
