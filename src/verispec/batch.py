"""Offline batch generation: a JSONL file of prompts in, a JSON line per prompt out, on one machine or Ray.

``verispec batch`` (and ``generate --batch``) read requests (:func:`read_requests`), generate them in the
continuous batch of :meth:`~verispec.api.Speculator.generate_batch` (:func:`generate_requests`) and write
records (:func:`record`). A :class:`BatchJob` cuts the requests into shards of ``shard_size`` in input order;
a malformed line gets an error record naming it, as a prompt too long for the context does, and the others
run; each finished shard is written atomically to ``OUTPUT.parts/``, so an interrupted run continues with the
shards it lacks (a resumed run must ask for what the first one did: the same requests and every setting the
output depends on, its seed included; a shard found corrupt or partial is said so and computed again), and
the output is assembled from the shards, in input order, at the end (atomically too, and checked whole before
``OUTPUT.parts/`` goes): no line is lost or written twice. Ids come back as given, a string or an integer.
Each prompt samples with its own seed, derived from the job's seed and its id (:func:`prompt_seed`), and what
a request gets never depends on the rest of its batch: the output is the same whatever the shard size, the
batch size or the number of workers, sampled with ``k="auto"`` too (whose K follows the batch): every
request has a seed, so its draws are invariant (``SamplingParams.invariant``) unless the job's sampling opts
out with ``invariant=False``.

With ``ray``, the shards are the rows of a Ray Data dataset mapped by ``map_batches`` with a stateful actor
class (:class:`ShardWorker`, which loads the models once) in ``workers`` actors, on a local Ray started here
or the cluster at an address (:func:`connect_ray`, which ``verispec drafter-data --ray`` connects with too).
The driver writes each shard as it comes back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verispec.choice import ModelChoice
from verispec.errors import UsageError
from verispec.files import atomic_path, atomic_write, check_writable
from verispec.grammar.constraint import Constraint
from verispec.inputs import check_int, check_seed, check_text, is_int, parse_json
from verispec.options import DEFAULT_K, DraftLength, GenerationOptions, SamplingParams

if TYPE_CHECKING:  # the models load where a job runs: its settings are checked without them
    from verispec.api import GenerationResult, Speculator

__all__ = [
    "BatchJob",
    "ShardWorker",
    "check_reachable",
    "connect_ray",
    "generate_requests",
    "prompt_seed",
    "read_requests",
    "record",
    "run_job",
]

Body = str | list[dict[str, str]] | dict[str, str]  # a prompt, a conversation, or {"error"} (malformed)
# what a line may not set: the job's generation settings, its flags (a line's other keys are its own metadata)
_PER_LINE = ("sampling", "constraint", "tools")  # the sampling's fields apart; a line's own; no tools
JOB_SETTINGS = frozenset(
    {f.name for f in dataclasses.fields(GenerationOptions) if f.name not in _PER_LINE}
    | {f.name for f in dataclasses.fields(SamplingParams)}
    | {"max_tokens", "drafter", "draft", "tree"}
)
TOOL_KEYS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})  # a line's tool calls: refused
Ident = str | int  # a request's id, as its line gives it
Request = tuple[Ident, Body, Constraint | None]  # (id, body, the line's own constraint)
LOCAL = "local"  # --ray without an address: a Ray started here


def read_requests(path: str | Path) -> list[Request]:
    """(id, prompt or messages, constraint) of every line of a JSONL request file (an id as the line gives it,
    a string or an integer; a line without one gets its line number, a string, or "line-N" where another line
    gives that number as its id; a line's constraint from its
    "json_schema" (an object or its JSON text), "regex" or "grammar" key, at most one, else None; other keys
    are the line's own, ignored, but not a generation setting of the job's: :data:`JOB_SETTINGS`). A
    malformed line (not UTF-8, not JSON, nested too deeply, an integer too long, a prompt that is not valid
    Unicode, a bad schema, regex or grammar, ...) becomes a request whose body is ``{"error": message}``,
    naming the line: it gets an error record and the others run. A file without one well-formed request is a
    UsageError."""
    try:
        lines = Path(path).read_bytes().splitlines()  # lines end at \n, \r\n or \r, never inside a string
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror or err}") from None
    requests: list[Request] = []
    seen: dict[str, str] = {}  # id (as text: 3 and "3" are one id, as their seeds are) → the line that has it
    entries = [_parsed(line) for line in lines]  # each line parsed once (a blank one: an error, skipped)
    given = {str(ident) for entry in entries if (ident := _readable_id(entry, {})) is not None}  # the ids
    for number, (line, entry) in enumerate(zip(lines, entries, strict=True), 1):
        if not line.strip():
            continue
        unnamed = str(number)
        while unnamed in given:  # never a given id's: "3" → "line-3" (→ "line-line-3" ...)
            unnamed = f"line-{unnamed}"
        try:
            request = _request(entry, f"{path}:{number}", unnamed, seen)
        except UsageError as err:  # named by its id where the line gives a readable one not taken before
            request = _readable_id(entry, seen) or f"line-{number}", {"error": str(err)}, None
        seen.setdefault(str(request[0]), f"line {number}'s")
        requests.append(request)
    refused = [body["error"] for _, body, _ in requests if isinstance(body, dict)]
    if refused and len(refused) == len(requests):
        more = f" (and the {len(refused) - 1} other lines)" if len(refused) > 1 else ""
        raise UsageError(refused[0] + more)
    if not requests:
        raise UsageError(f"{path} holds no requests")
    return requests


def _parsed(line: bytes) -> object:
    """A line's JSON value, or the UsageError that says why it is not JSON."""
    try:
        return parse_json(line)
    except UsageError as err:
        return err


def _readable_id(entry: object, seen: dict[str, str]) -> Ident | None:
    """The id a line's JSON value gives (a string or an integer, not taken by a line before it), else None."""
    ident = entry.get("id") if isinstance(entry, dict) else None
    readable = isinstance(ident, str) or is_int(ident)
    return ident if readable and str(ident) not in seen else None


def _request(entry: object, where: str, unnamed: str, seen: dict[str, str]) -> Request:
    """One line's request from its JSON value (:func:`_parsed`; ``unnamed``: its id where it gives none);
    UsageError naming ``where`` when it is malformed (``seen``: the ids of the lines before it, and which
    line has each)."""
    if isinstance(entry, UsageError):
        raise UsageError(f"{where}: {entry}")
    if not isinstance(entry, dict) or ("prompt" in entry) == ("messages" in entry):
        raise UsageError(f'{where}: a request is an object with "prompt" or "messages" (one of them)')
    body = entry.get("prompt", entry.get("messages"))
    if "prompt" in entry and not isinstance(body, str):
        raise UsageError(f'{where}: "prompt" must be a string')
    if "messages" in entry and not (
        isinstance(body, list)
        and body
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in body)
    ):
        raise UsageError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    assert isinstance(body, (str, list))  # checked above
    if calls := sorted(TOOL_KEYS & entry.keys()):
        raise UsageError(
            f'{where}: a batch job makes no tool calls ({calls[0]!r}): a line holds "id", "prompt" or '
            '"messages", and "json_schema", "regex" or "grammar"'
        )
    settings = sorted(JOB_SETTINGS & entry.keys())
    if settings:
        raise UsageError(
            f"{where}: {settings[0]!r} is the whole job's setting (its flag), not a line's: "
            'a line holds "id", "prompt" or "messages", and "json_schema", "regex" or "grammar"'
        )
    for text in [body] if isinstance(body, str) else [m["content"] for m in body]:
        check_text(text, f"{where}: the prompt")
    ident = entry.get("id", unnamed)
    if not (isinstance(ident, str) or is_int(ident)):
        raise UsageError(f'{where}: "id" must be a string or an integer, got {json.dumps(ident)[:40]}')
    if str(ident) in seen:
        raise UsageError(f"{where}: id {ident!r} repeats {seen[str(ident)]}")
    try:
        constraint = Constraint.of(entry.get("json_schema"), entry.get("regex"), entry.get("grammar"))
    except UsageError as err:
        raise UsageError(f"{where}: {err}") from None
    return ident, body, constraint


def prompt_seed(seed: int, ident: Ident) -> int:
    """The seed of the request ``ident`` in a job of seed ``seed``: the same wherever and with whatever the
    request is generated."""
    digest = hashlib.sha256(f"{seed}\x00{ident}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # [0, 2**63)


def generate_requests(
    speculator: Speculator,
    requests: Sequence[Request],
    options: GenerationOptions,
    *,
    slots: int,
    seeds: Sequence[int] | None = None,
) -> list[GenerationResult]:
    """Every request's :class:`~verispec.api.GenerationResult`, in order, in one continuous batch: each with
    ``options``, a conversation (or every prompt, with ``options.chat``) in the chat template, a request's own
    constraint instead of the options' one; ``seeds``: one per request, or None (the options' sampling seed
    for all). A request that cannot run gets a result with ``error``."""
    from verispec.api import GenerationResult

    results: dict[int, GenerationResult] = {}
    chosen: list[int] = []
    prompts: list[str | list[dict[str, str]]] = []
    each: list[GenerationOptions] = []
    for i, (_, body, constraint) in enumerate(requests):
        if isinstance(body, dict):  # a malformed line: its error record
            results[i] = GenerationResult("", [], {}, error=body["error"])
            continue
        chat = options.chat or isinstance(body, list)
        own = dataclasses.replace(options, chat=chat, constraint=constraint or options.constraint)
        chosen.append(i)
        prompts.append(body)
        each.append(own)
    if chosen:
        chosen_seeds = None if seeds is None else [seeds[i] for i in chosen]
        done = speculator.generate_batch(prompts, each, slots=slots, seeds=chosen_seeds)
        results.update(zip(chosen, done, strict=True))
    return [results[i] for i in range(len(requests))]


def record(ident: Ident, result) -> dict:
    """A request's JSON record: id, text, token ids and stats, or id and error."""
    if result.error:
        return {"id": ident, "error": result.error}
    return {"id": ident, "text": result.text, "token_ids": result.token_ids, "stats": result.stats}


# ---------------------------------------------------------------------------------------------- the job


@dataclass(frozen=True, kw_only=True)
class BatchJob(ModelChoice):
    """What ``verispec batch`` runs (the models and drafter, then these); validated with UsageError.
    ``ray``: None (in-process), ``"local"`` (a Ray started here) or a cluster's address."""

    input: str
    output: str
    k: DraftLength = DEFAULT_K  # its text parsed on construction
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    chat: bool = False
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None  # every request's, unless its line brings its own
    max_batch: int = 8
    shard_size: int = 64
    ray: str | None = None
    workers: int = 1
    progress: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sampling.follows_seed:  # every request has a seed: invariant draws, unless opted out
            object.__setattr__(self, "sampling", dataclasses.replace(self.sampling, invariant=True))
        object.__setattr__(self, "k", DraftLength.parse(self.k))
        for name, low in (("max_batch", 1), ("shard_size", 1), ("workers", 1), ("max_new_tokens", 1)):
            value = getattr(self, name)
            check_int(value, name.replace("_", "-"), low)
        self.options  # noqa: B018 (checks k, max-new-tokens, the sampling and the stop strings)
        if self.workers > 1 and self.ray is None:
            raise UsageError("--workers N runs N Ray workers: give --ray too")
        if Path(self.output).resolve() == Path(self.input).resolve():
            raise UsageError("the output would overwrite the input")

    @property
    def options(self) -> GenerationOptions:
        """What each request of the job is generated with (its own seed apart)."""
        return GenerationOptions(
            k=self.k,
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            chat=self.chat,
            stop=self.stop,
            constraint=self.constraint,
        )

    @property
    def parts(self) -> Path:
        """Where finished shards wait for the output to be assembled."""
        return Path(f"{self.output}.parts")

    def settings(self, requests: Sequence[Request], seed: int) -> dict:
        """What the shards depend on (``seed``: the job's, drawn where ``sampling`` has none): a resumed run
        must have the same."""
        fields = dataclasses.asdict(self)
        for name in (
            "output",
            "ray",
            "workers",
            "progress",
            "max_batch",
            "suffix_cache_file",
            "suffix_budget",
        ):
            fields.pop(name)  # the output does not depend on them
        fields["k"] = str(self.k)  # as --k spells it
        fields["sampling"] = {**dataclasses.asdict(self.sampling), "seed": seed}
        fields["requests"] = hashlib.sha256(json.dumps(_plain(requests)).encode()).hexdigest()
        return fields


Done = tuple[int, str, int, str]  # a shard's index, JSONL text, generated tokens and suffix cache additions


def _shard_lines(job: BatchJob, speculator, index: int, shard: Sequence[Request], seed: int) -> Done:
    """A shard done: its JSONL text, generated tokens and what it added to the worker's suffix cache (JSON:
    its tokenizer's identity and the sequences; empty without a cache file to merge them into)."""
    seeds = [prompt_seed(seed, ident) for ident, _, _ in shard]
    cache = speculator.suffix_cache if job.suffix_cache_file is not None else None
    mark = cache.added if cache is not None else 0
    results = generate_requests(speculator, shard, job.options, slots=job.max_batch, seeds=seeds)
    lines = "".join(json.dumps(record(r[0], result)) + "\n" for r, result in zip(shard, results, strict=True))
    added = json.dumps([cache.vocabulary, cache.sequences(since=mark)]) if cache is not None else ""
    return index, lines, sum(len(r.token_ids) for r in results), added


class ShardWorker:
    """A Ray Data actor: loads the job's models once, then generates one shard per row it is given."""

    def __init__(self, job: dict, seed: int, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        constraint = job["constraint"] and Constraint(**job["constraint"])
        self.job = BatchJob(
            **{**job, "sampling": SamplingParams(**job["sampling"]), "constraint": constraint}
        )
        self.seed = seed
        from verispec.api import Speculator
        from verispec.resolve import Target

        self.speculator = Speculator.on(Target.load(self.job))

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, list]:
        done = []
        for index, requests in zip(batch["shard"], batch["requests"], strict=True):
            shard = [(i, body, c and Constraint(*c)) for i, body, c in json.loads(requests)]
            done.append(_shard_lines(self.job, self.speculator, int(index), shard, self.seed))
        return dict(
            zip(("shard", "lines", "tokens", "added"), map(list, zip(*done, strict=True)), strict=True)
        )


def _plain(requests: Sequence[Request]) -> list[tuple[Ident, Body, tuple[str, str] | None]]:
    """``requests`` as JSON holds them (a constraint as its kind and text)."""
    return [(i, body, None if c is None else (c.kind, c.text)) for i, body, c in requests]


def _shards(requests: Sequence[Request], size: int) -> list[list[Request]]:
    return [list(requests[i : i + size]) for i in range(0, len(requests), size)]


def _prepare(
    job: BatchJob, requests: Sequence[Request], shards: Sequence[Sequence[Request]]
) -> tuple[int, set[int]]:
    """(the job's seed, the shards already done) after checking ``OUTPUT.parts`` (made when absent) and that
    the output can be written (its directory exists and is writable). Resuming, the interrupted run's
    settings must be this one's (its seed too, where this run asks for one: a run without ``seed`` takes the
    kept one), else UsageError naming the first that differs; each shard on disk is checked
    (:func:`_lines_problem`), and one that is not whole is said so on stderr and left to compute again."""
    check_writable(job.output)
    parts = job.parts
    settings_path = parts / "job.json"
    if parts.exists():
        try:
            saved = json.loads(settings_path.read_text())
            seed = saved["sampling"]["seed"]
            check_seed(seed)
        except (OSError, ValueError, TypeError, KeyError):  # UsageError (check_seed's) is a ValueError
            raise UsageError(f"{parts} is not a run's directory: remove it to start afresh") from None
        asked = seed if job.sampling.seed is None else job.sampling.seed
        changed = _changed(saved, json.loads(json.dumps(job.settings(requests, asked))))  # lists, not tuples
        if changed is not None:
            raise UsageError(
                f"{parts} holds an interrupted run {changed}: run it with the same ones to resume it, "
                f"or remove {parts} to start afresh"
            )
        return seed, {i for i, shard in enumerate(shards) if _shard_done(parts, i, shard)}
    if Path(job.output).exists():
        raise UsageError(f"{job.output} exists: remove it or choose another output")
    seed = job.sampling.seed
    if seed is None:  # drawn once, kept in job.json for a resumed run
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    try:
        parts.mkdir()
    except OSError as err:
        raise UsageError(f"cannot write {parts}: {err.strerror or err}") from None
    _write_text(settings_path, json.dumps(job.settings(requests, seed)))
    return seed, set()


def _changed(saved: dict, now: dict) -> str | None:
    """How the settings ``now`` differ from the ``saved`` ones (job.json's), the first that does, in the
    words of :func:`_prepare`'s error (``"with other settings: --seed was 7, now 8"``); None: they do not."""
    if saved.get("requests") != now.get("requests"):
        return "of other requests (the lines of --input changed)"
    old, new = _flat(saved), _flat(now)
    name = next((n for n in [*new, *old] if n not in old or n not in new or _differ(old[n], new[n])), None)
    if name is None:
        return None
    flag = {
        "constraint": "the constraint (--json-schema, --regex or --grammar)",
        "input": "--input (the file)",
    }.get(name, f"--{name.replace('_', '-')}")
    hint = " (a run without --seed resumes with the kept one)" if name == "seed" else ""
    return f"with other settings: {flag} was {_shown(old.get(name))}, now {_shown(new.get(name))}{hint}"


def _flat(settings: dict) -> dict:
    """A job's settings with its sampling's among them (the flags name them so)."""
    sampling = settings.get("sampling")
    rest = {name: value for name, value in settings.items() if name != "sampling"}
    return {**rest, **sampling} if isinstance(sampling, dict) else settings


def _differ(a: Any, b: Any) -> bool:
    """Whether two JSON values differ (1, 1.0 and true are three values)."""
    return json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True)


def _shown(value: Any) -> str:
    text = "none" if value is None else value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shard_path(parts: Path, index: int) -> Path:
    return parts / f"shard-{index:06d}.jsonl"


def _shard_done(parts: Path, index: int, shard: Sequence[Request]) -> bool:
    """Whether shard ``index`` lies whole in ``parts`` (a resumed run's); one that does not is said so on
    stderr and removed, to be computed again."""
    path = _shard_path(parts, index)
    if not path.exists():
        return False
    problem = _shard_problem(path, shard)
    if problem is not None:
        print(f"verispec: {path} is {problem}: computing it again", file=sys.stderr)
        path.unlink()
    return problem is None


def _shard_problem(path: Path, shard: Sequence[Request]) -> str | None:
    """Why the file ``path`` is not the output of ``shard`` (:func:`_lines_problem`), None when it is."""
    try:
        return _lines_problem(path.read_bytes(), shard)
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror or err}") from None


def _lines_problem(data: bytes, requests: Sequence[Request]) -> str | None:
    """Why ``data`` is not the output of ``requests`` (a shard's, the job's) — a whole JSON object per line,
    naming its request's id and holding its tokens or its error, one per request, in order — as "partial
    (...)" or "corrupt (...)"; None when it is."""
    lines = data.split(b"\n")
    cut = lines.pop() != b""  # what follows the last newline: a line cut short
    for number, (line, (ident, _, _)) in enumerate(zip(lines, requests, strict=False), 1):  # counted below
        try:
            entry = parse_json(line)
        except UsageError:
            return f"corrupt (line {number} is not JSON)"
        if not (isinstance(entry, dict) and not _differ(entry.get("id"), ident)) or not (
            "token_ids" in entry or "error" in entry
        ):
            return f"corrupt (line {number} is not the record of request {ident!r})"
    if len(lines) > len(requests):
        return f"corrupt ({len(lines)} lines for {len(requests)} requests)"
    if cut or len(lines) < len(requests):
        return f"partial ({len(lines)} of {len(requests)} lines whole{', then one cut short' if cut else ''})"
    return None


def _write_text(path: Path, text: str) -> None:
    """``text`` in ``path``, atomically."""
    atomic_write(path, text)


def _finish(job: BatchJob, requests: Sequence[Request], shards: Sequence[Sequence[Request]]) -> None:
    """The output assembled from the shards, in order, atomically, and checked whole (:func:`_lines_problem`)
    before the shards are removed. A shard that is not whole (changed on disk meanwhile: it is removed) or an
    output that is not is a UsageError, the output not written and ``OUTPUT.parts`` kept for the same run
    started again to compute what it lacks."""
    again = f"run the same command again to compute it ({job.parts} is kept)"
    with atomic_path(job.output) as tmp:
        with open(tmp, "wb") as out:
            for index, shard in enumerate(shards):
                path = _shard_path(job.parts, index)
                problem = _shard_problem(path, shard)
                if problem is not None:
                    path.unlink(missing_ok=True)
                    raise UsageError(f"{path} is {problem} since it was written: {again}")
                out.write(path.read_bytes())
        problem = _lines_problem(tmp.read_bytes(), requests)
        if problem is not None:  # what was written is not what was read: the disk's doing
            raise UsageError(f"the output assembled in {tmp} is {problem}: {again}")
    shutil.rmtree(job.parts)


def run_job(job: BatchJob) -> dict:
    """Run ``job`` (resuming an interrupted run of it); returns a summary: requests, refused, shards run
    now and before, tokens and seconds of this run."""
    requests = read_requests(job.input)  # a malformed line: an error record
    shards = _shards(requests, job.shard_size)
    # an unreachable address fails before any file
    ray = connect_ray(job.ray) if job.ray is not None else None
    seed, done = _prepare(job, requests, shards)
    pending = [i for i in range(len(shards)) if i not in done]
    started, tokens = time.perf_counter(), 0
    merged = _merged_cache(job) if pending else None
    with _progress(job, requests, shards, done) as bar:
        run = _here(job, shards, pending, seed) if ray is None else _on_ray(ray, job, shards, pending, seed)
        for index, lines, count, added in run:
            _write_text(_shard_path(job.parts, index), lines)
            if merged is not None:  # each worker's additions, saved as they come: a resumed job starts warm
                vocabulary, sequences = json.loads(added)
                merged.merge(sequences, vocabulary)
                job.save_suffix_cache(merged)
            tokens += count
            bar.update(len(shards[index]))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - started):.1f} tok/s")
    _finish(job, requests, shards)
    refused = sum(1 for line in Path(job.output).read_text().splitlines() if "error" in json.loads(line))
    return {"requests": len(requests), "refused": refused, "shards": len(shards), "resumed": len(done),
            "tokens": tokens, "seconds": time.perf_counter() - started}  # fmt: skip


def _merged_cache(job: BatchJob):
    """The suffix cache that every worker's additions are merged into and saved: ``suffix_cache_file``'s
    (each worker starts from it too), None without one."""
    from verispec.drafting.suffix_files import open_suffix_cache

    return (
        None
        if job.suffix_cache_file is None
        else open_suffix_cache(job.suffix_cache_file, job.suffix_budget, "")
    )


def _here(job: BatchJob, shards, pending: Sequence[int], seed: int) -> Iterator[Done]:
    speculator = None
    if pending:
        from verispec.api import Speculator  # loads torch: once the job's settings are checked
        from verispec.resolve import Target

        speculator = Speculator.on(Target.load(job))
    for index in pending:
        yield _shard_lines(job, speculator, index, shards[index], seed)


def connect_ray(address: str):
    """Ray, connected to ``address`` (or a local Ray started here); UsageError when that fails."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'ray[data]'") from None
    check_reachable(address)
    try:
        if not ray.is_initialized():
            if address == LOCAL:
                ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
            else:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise UsageError(f"cannot connect to Ray at {address}: {str(err).splitlines()[0]}") from None
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the job's own bar counts prompts and tokens
    context.print_on_execution_start = False
    logging.getLogger("ray").setLevel(logging.WARNING)
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # not even "progress bars disabled"
    return ray


def check_reachable(address: str) -> None:
    """UsageError, at once, when a cluster's HOST:PORT does not answer (Ray itself waits for minutes)."""
    host, _, port = address.rpartition(":")
    if address in (LOCAL, "auto") or "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as err:
        raise UsageError(f"cannot reach Ray at {address}: {err.strerror or err}") from None


def _on_ray(ray, job: BatchJob, shards, pending: Sequence[int], seed: int) -> Iterable[Done]:
    """The pending shards through Ray Data: one row per shard, ``workers`` ShardWorker actors."""
    if not pending:
        return
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // job.workers)
    rows = [{"shard": i, "requests": json.dumps(_plain(shards[i]))} for i in pending]
    spec = {**dataclasses.asdict(job), "k": str(job.k), "sampling": dataclasses.asdict(job.sampling)}
    dataset = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(  # a block per shard
        ShardWorker,
        fn_constructor_kwargs={"job": spec, "seed": seed, "threads": cpus},
        batch_size=1,
        concurrency=job.workers,
        num_cpus=cpus,
    )
    for row in dataset.iter_rows():
        yield int(row["shard"]), str(row["lines"]), int(row["tokens"]), str(row["added"])


def _progress(job: BatchJob, requests, shards, done: set[int]):
    from tqdm import tqdm

    already = sum(len(shards[i]) for i in done)
    return tqdm(total=len(requests), initial=already, unit="prompt", desc="batch", disable=not job.progress)
