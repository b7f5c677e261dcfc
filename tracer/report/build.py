"""`build_report(paths, options) -> Report`: load -> measure -> fit -> simulate -> decide, in-process.

The CLI and `splitscope demo` both call this; `tracer.report.render.render(report, fmt)` turns the result
into Markdown, HTML or JSON. Blocking; CPU only; a million-span trace takes tens of seconds, dominated by
reading it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from tracer.report import prose, selfcheck
from tracer.report.budget import candidate_budgets_tokens
from tracer.report.confidence import (
    MIN_RESAMPLES,
    RERUN_DURATION_S,
    RERUN_REQUESTS,
    Confidence,
    Decided,
    RerunSize,
    bootstrap,
)
from tracer.report.decide import Decision, candidate_layouts, combine_windows, decide, insufficient
from tracer.report.estimate import (
    chunk_budget_tokens,
    estimate_chunked_steps,
    estimate_gaps,
    estimate_steps,
    itl_pass_probability,
)
from tracer.report.fit import (
    STEP_MODELS,
    PrefillFit,
    StepFit,
    TransferFit,
    fit_prefill,
    fit_steps,
    fit_transfers,
    with_roofline,
)
from tracer.report.goodput import GoodputResult, search_goodput
from tracer.report.metrics_file import (
    EngineMetrics,
    Histogram,
    metrics_evidence,
    metrics_sources,
    read_metrics_file,
)
from tracer.report.model_shape import ModelShape
from tracer.report.noise import StepNoise
from tracer.report.simulate import (
    ROUTERS,
    SLO,
    Costs,
    EngineParams,
    Layout,
    StepCosts,
    TransferCosts,
    Workload,
    simulate,
)
from tracer.report.tables import RequestTable, TraceData, load_traces
from tracer.vocabulary import Mode, Pool, Stage, Verdict

# Stated as assumptions whenever they are used.
DEFAULT_LINK_GBPS = 100.0
DEFAULT_KV_BYTES_PER_TOKEN = 131072.0  # Llama-3-8B in bf16: 2 x 32 layers x 8 KV heads x 128 x 2 bytes
DEFAULT_TRANSFER_CONSTANT_S = 0.002
DEFAULT_MAX_BATCH = EngineParams().max_running_requests
DEFAULT_MAX_PREFILL_TOKENS_PER_STEP = EngineParams().max_prefill_tokens_per_step
# A merge priced on steps of a kind no trace ran (prefill beside decodes, from a split's traces) must win by
# this many margins: a decision the evidence cannot check should not ride on a margin's worth of model error.
UNSEEN_MIX_MARGINS = 2.0
# The why-missed section is built without being asked up to this much trace data (a second read of 100 MiB
# takes a few seconds here; bench/report_scale.py's 630 MiB file would add about half a minute).
WHY_MISSED_AUTO_MAX_BYTES = 100 * 2**20


@dataclass(frozen=True)
class ReportOptions:
    slo: SLO
    gpus: int | None = None  # None: the workers seen in the traces
    link_gbps: float | None = None  # per prefill worker; None: measured on transfers, else DEFAULT_LINK_GBPS
    kv_bytes_per_token: float | None = None  # None: measured on transfers, else the default
    window_s: float | None = None  # hysteresis windows; None: the whole trace is one window
    margin: float = 0.15
    skip_bad: bool = False
    sim_requests: int = 300  # fewest requests per simulation
    sim_duration_s: float = 30.0  # simulated arrivals per run: rate x this many seconds ...
    sim_max_requests: int = 20000  # ... up to this many requests
    seed: int = 0
    min_requests: int = 20  # per window
    min_steps: int = 50
    # Empty: power-of-two budgets around the largest one whose worst step keeps the ITL SLO (budget.py).
    chunk_budgets_tokens: tuple[int, ...] = ()
    # Running requests one worker admits (vLLM --max-num-seqs, SGLang --max-running-requests); past it,
    # arrivals queue. The default is vLLM's.
    max_batch: int = DEFAULT_MAX_BATCH
    # Prompt tokens one colocated or prefill-only step takes whole (vLLM --max-num-batched-tokens); the first
    # waiting prompt always joins. The default is the simulator's.
    max_prefill_tokens_per_step: int = DEFAULT_MAX_PREFILL_TOKENS_PER_STEP
    extra_evidence: tuple[str, ...] = ()  # e.g. lines from Prometheus
    # A capture of the engine's /metrics (Prometheus text): vLLM's gap and tokens-per-step histograms.
    metrics_file: str | None = None
    # Bootstrap re-runs behind `confidence` (confidence.py); 0 skips it (confidence then null).
    confidence_resamples: int = MIN_RESAMPLES
    # How the simulated router places requests on a pool's workers (simulate.ROUTERS): the reference
    # router's least-outstanding by default; traces carry no signal of the policy, so it is never inferred.
    router: str = "least-outstanding"
    # How a decode batch past the largest the step spans saw is priced (StepCosts): "linear" extrapolates
    # the fitted slopes (compute-bound hardware: a CPU); "roofline" prices it as an accelerator runs it
    # (memory-bound until the knee, a prefill token's cost past it); "auto": roofline when the traces' stage
    # spans were timed by CUDA events (our tracer on a GPU), linear otherwise (host-timed spans say nothing
    # of the hardware: an engine's adapted spans on a GPU need the operator's "roofline").
    step_model: str = "auto"
    # "Why requests missed the SLO" (why.py): explain the missing requests' stalls and TTFT parts. It
    # reads the trace files a second time through the generic span reader (2-3x the report's own read), so
    # None (auto) builds it only up to WHY_MISSED_AUTO_MAX_BYTES of traces; True always, False never.
    why_missed: bool | None = None
    # A Hugging Face config.json of the served model (`--model-config`): with the roofline step model, the
    # fit prices the KV read and a prompt's attention from the model's bytes and arithmetic (model_shape.py),
    # and the KV size of a transfer comes from it when `kv_bytes_per_token` is not given.
    model_config: str | None = None

    @cached_property
    def model_shape(self) -> ModelShape | None:
        return ModelShape.from_hf_config(Path(self.model_config)) if self.model_config is not None else None

    def __post_init__(self) -> None:
        if self.model_config is not None:
            _ = self.model_shape  # a bad config fails here, before any trace is read
        if self.gpus is not None and self.gpus < 1:
            raise ValueError("--gpus must be at least 1")
        for name in ("link_gbps", "kv_bytes_per_token", "window_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_batch < 1:
            raise ValueError("--max-batch must be at least 1")
        if self.step_model not in STEP_MODELS:
            raise ValueError(f"--step-model must be one of {', '.join(STEP_MODELS)}")
        if self.max_prefill_tokens_per_step < 1:
            raise ValueError("max_prefill_tokens_per_step must be at least 1")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}")
        if self.margin < 0:
            raise ValueError("margin must not be negative")
        if self.confidence_resamples and self.confidence_resamples < MIN_RESAMPLES:
            raise ValueError(f"confidence needs at least {MIN_RESAMPLES} resamples (or 0 to skip it)")


@dataclass
class Measured:
    requests: int
    failed: int
    rate_per_s: float
    ttft_s: dict[str, float]  # p50/p90/p99
    itl_s: dict[str, float]  # of the per-request ITL statistic chosen by the SLO
    tpot_s: dict[str, float]
    attainment: float
    stage_mean_s: dict[str, float]
    prompt_tokens_mean: float


@dataclass
class OptionResult:
    label: str
    mode: str
    ratio: str | None
    chunk_budget_tokens: int | None
    gpus: int
    rate_per_s: float
    goodput_per_gpu: float


@dataclass
class WindowResult:
    start_s: float
    end_s: float
    requests: int
    decision: Decision
    options: list[OptionResult]
    results: list[GoodputResult] = field(default_factory=list, repr=False)  # the simulations behind `options`


@dataclass
class Report:
    verdict: str
    ratio: str | None
    from_ratio: str | None
    chunk_budget_tokens: int | None
    current: Layout | None
    recommended: Layout | None
    slo: SLO
    margin: float
    goodput: list[OptionResult]
    fits: dict[str, Any]
    evidence: list[str]
    assumptions: list[str]
    measured: Measured | None
    network: dict[str, float]
    windows: list[WindowResult]
    read: dict[str, Any]
    win_margin: float | None = None
    model_check: dict[str, float] = field(default_factory=dict)
    # insufficient-data because the self-check failed: what the model would have recommended (selfcheck.py).
    unconfirmed: str | None = None
    confidence: float | None = None  # share of bootstrap re-runs reaching the same verdict
    confidence_resamples: int = 0
    data: TraceData | None = field(default=None, repr=False)  # for plots; not serialised
    step_fit: StepFit | None = field(default=None, repr=False)
    # How the self-check ended (selfcheck.py): misses, those that matter, the correction, the outcome.
    # Empty when no decision got that far.
    self_check: dict[str, Any] = field(default_factory=dict)
    # Why the requests that missed the SLO missed it (why.py); None when not computed (no trace files
    # read, or ReportOptions.why_missed off).
    why_missed: dict[str, Any] | None = None
    # The model the decision was taken with (predict.py replays it on other arrivals); not serialised.
    # None when no layout was simulated.
    costs: Costs | None = field(default=None, repr=False)
    engine_params: EngineParams | None = field(default=None, repr=False)


def _quantiles(values: np.ndarray) -> dict[str, float]:
    values = values[~np.isnan(values)]
    if not len(values):
        return {}
    p50, p90, p99 = np.percentile(values, (50, 90, 99))
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def measure(requests: RequestTable, slo: SLO) -> Measured:
    """Per-request TTFT, gaps and SLO attainment as the traces recorded them (failed requests miss)."""
    itl = requests.itl(slo.itl_stat)
    if slo.itl_stat == "mean":
        itl = np.where(np.isnan(itl), requests.tpot_s, itl)
    ok = (requests.ttft_s <= slo.ttft_s) & (np.nan_to_num(itl, nan=np.inf) <= slo.itl_s) & ~requests.failed
    span_s = (requests.arrival_ns.max() - requests.arrival_ns.min()) / 1e9 if len(requests) > 1 else 0.0
    stages = {
        Stage.QUEUE: requests.queue_s,
        Stage.PREFILL: requests.prefill_s,
        Stage.KV_TRANSFER: requests.transfer_s,
        Stage.DECODE: requests.decode_s,
    }
    return Measured(
        requests=len(requests),
        failed=int(requests.failed.sum()),
        rate_per_s=(len(requests) - 1) / span_s if span_s > 0 else 0.0,
        ttft_s=_quantiles(requests.ttft_s),
        itl_s=_quantiles(itl),
        tpot_s=_quantiles(requests.tpot_s),
        attainment=float(ok.mean()) if len(requests) else 0.0,
        stage_mean_s={k: float(np.nanmean(v)) for k, v in stages.items() if np.any(~np.isnan(v))},
        prompt_tokens_mean=float(requests.input_tokens.mean()) if len(requests) else 0.0,
    )


def current_layout(data: TraceData) -> Layout | None:
    """The deployed layout: distinct workers per pool seen in the window (architecture.md §7)."""
    workers = data.workers
    if workers.get(Pool.PREFILL) and workers.get(Pool.DECODE):
        return Layout(
            Mode.DISAGGREGATED, prefill_workers=len(workers[Pool.PREFILL]), decode_workers=len(workers[Pool.DECODE])
        )
    colocated = workers.get(Pool.COLOCATED)
    if not colocated:
        return None
    modes = [m for m in data.requests.mode if m]
    if modes and max(set(modes), key=modes.count) == Mode.CHUNKED:
        steps = data.steps
        budget = int((steps.prefill_tokens + steps.decode_requests).max()) if len(steps) else 512
        return Layout(Mode.CHUNKED, workers=len(colocated), chunk_budget_tokens=max(budget, 1))
    return Layout(Mode.COLOCATED, workers=len(colocated))


def _workload(requests: RequestTable) -> Workload:
    arrival = (requests.arrival_ns - requests.arrival_ns.min()) / 1e9
    return Workload(arrival, requests.input_tokens, requests.cached_tokens, np.maximum(requests.output_tokens, 1))


def build_report(paths: Sequence[str | os.PathLike[str]], options: ReportOptions) -> Report:
    """Read `paths` and decide. Raises TraceFileError / TraceDataError on bad input unless skip_bad."""
    data = load_traces(paths, skip_bad=options.skip_bad)
    report = report_from_data(data, options)
    if _wants_why_missed(paths, options.why_missed, report.assumptions):
        from tracer.report.why import why_missed

        report.why_missed = why_missed(paths, options.slo, skip_bad=options.skip_bad)
    return report


def _wants_why_missed(paths: Sequence[str | os.PathLike[str]], asked: bool | None, assumptions: list[str]) -> bool:
    """Whether to build the why-missed section: as asked, or (None) when the files are small enough for a
    second read to cost little beside the first; a skip is stated in `assumptions`."""
    if asked is not None:
        return asked
    total_bytes = sum(os.path.getsize(path) for path in paths)
    if total_bytes <= WHY_MISSED_AUTO_MAX_BYTES:
        return True
    assumptions.append(prose.why_missed_skipped_line(total_bytes, WHY_MISSED_AUTO_MAX_BYTES))
    return False


@dataclass
class _Findings:
    """What the traces say before any layout is simulated: the fields every Report carries."""

    data: TraceData
    options: ReportOptions
    requests: RequestTable
    current: Layout | None
    step_fit: StepFit | None
    prefill_fit: PrefillFit | None
    transfer_fit: TransferFit | None
    transfer: TransferCosts
    gpus: int
    fits: dict[str, Any]
    measured: Measured | None
    read: dict[str, Any]
    evidence: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    missing: list[str] = field(default_factory=list)  # why no decision can be made at all
    engine_metrics: EngineMetrics | None = None  # --metrics-file

    @property
    def merge_margin(self) -> float:
        """What a merge must win by: `UNSEEN_MIX_MARGINS` margins when no traced step ran prefill beside
        decodes (a split's traces, or no step spans), since the merged pool's steps are then all extrapolation
        (a GPU's GEMMs near their knee cost what no trace of long prompts and small batches shows)."""
        steps = self.data.steps
        mixed_seen = bool(np.any((steps.prefill_tokens > 0) & (steps.decode_requests > 0)))
        return self.options.margin * (1.0 if mixed_seen else UNSEEN_MIX_MARGINS)

    def report(self, verdict: str, reasons: Sequence[str] = (), **fields: Any) -> Report:
        """The Report: these findings plus the decision's own fields (keywords of Report)."""
        values: dict[str, Any] = dict(
            ratio=None,
            from_ratio=None,
            chunk_budget_tokens=None,
            recommended=None,
            goodput=[],
            network={},
            windows=[],
        )
        values.update(fields)
        return Report(
            verdict=verdict,
            current=self.current,
            slo=self.options.slo,
            margin=self.options.margin,
            fits=self.fits,
            evidence=self.evidence + list(reasons),
            assumptions=self.assumptions,
            measured=self.measured,
            read=self.read,
            data=self.data,
            step_fit=self.step_fit,
            **values,
        )


def report_from_data(data: TraceData, options: ReportOptions) -> Report:
    """Decide from loaded traces: fit, simulate every candidate layout per window, check the model on the
    current layout (correcting it where a miss matters, selfcheck.py), and say how sure the verdict is.
    Blocking, CPU only."""
    found = _findings(data, options)
    current, step_fit = found.current, found.step_fit
    if found.missing or step_fit is None or current is None:
        return found.report(Verdict.INSUFFICIENT_DATA, found.missing)
    slo, requests = options.slo, found.requests
    frontend_s = _frontend_s(requests)
    if frontend_s > 0:
        found.evidence.append(prose.frontend_line(frontend_s))
    joined_share, joined_requests = _joined_token_share(requests)
    if joined_share > 0:
        found.evidence.append(prose.joined_tokens_line(joined_share, joined_requests))
    found.fits["stream"] = {"frontend_s": frontend_s, "joined_token_share": joined_share, "requests": joined_requests}
    costs = Costs(step_fit.costs, found.transfer, frontend_s, joined_share)
    params = EngineParams(
        max_running_requests=options.max_batch,
        max_prefill_tokens_per_step=options.max_prefill_tokens_per_step,
        router=options.router,
    )
    budgets = options.chunk_budgets_tokens or _budgets(step_fit, slo, requests, data)
    run = _Run.of(found, costs, params, budgets)
    found.assumptions += prose.extrapolation_lines(step_fit, run.windows)
    found.evidence += prose.evidence_lines(
        found.measured, step_fit, found.prefill_fit, found.transfer_fit, run.network, current, run.final, run.windows
    )
    gap_histogram = found.engine_metrics.gaps if found.engine_metrics is not None else None
    check = model_check(
        current,
        requests,
        costs,
        slo,
        step_fit.noise_sigma,
        params,
        gap_histogram,
        _served_attainment(found, requests),
        step_noise=step_fit.noise,
    )
    if check:
        found.evidence.append(prose.model_check_line(check, slo))
    if run.final.verdict == Verdict.INSUFFICIENT_DATA:
        return found.report(Verdict.INSUFFICIENT_DATA, run.final.reasons, **run.fields())
    limit = selfcheck.MAX_STEP_TYPICAL_MISS if step_fit.source == "step spans" else selfcheck.MAX_ESTIMATED_TYPICAL_MISS
    judgement = selfcheck.judge(check, step_fit.r2, slo, step_fit.typical_miss, limit)
    if judgement.mattering:
        return _corrected_report(found, run, check, judgement)
    outcome = selfcheck.Outcome.MISSES_DO_NOT_MATTER if judgement.misses else selfcheck.Outcome.PASSED
    found.evidence += judgement.harmless
    confidence = _confidence(run)
    if confidence is not None:
        found.evidence.append(prose.confidence_line(confidence))
    return _answer(found, run, check, confidence, _self_check(judgement, outcome))


@dataclass
class _Run:
    """One decision over every window, at one objective: what the report shows of it and what a bootstrap
    re-runs. `largest` is the window with the most requests: (its size, its goodput results, its workload)."""

    found: _Findings
    costs: Costs
    params: EngineParams
    slo: SLO
    budgets: tuple[int, ...]
    windows: list[WindowResult]
    largest: tuple[int, list[GoodputResult], Workload] | None
    final: Decision
    goodput: list[OptionResult]
    network: dict[str, float]

    @classmethod
    def of(cls, found: _Findings, costs: Costs, params: EngineParams, budgets: tuple[int, ...]) -> _Run:
        """Simulate and decide at `found.options.slo` over the layouts `budgets` make candidates."""
        assert found.current is not None
        windows, largest = _judge_windows(found, costs, params, budgets)
        final = combine_windows(found.current, [w.decision for w in windows])
        with_options = [w for w in windows if w.options]
        goodput = _mean_options(with_options) if with_options else []
        network = _network(found.measured, found.transfer, found.transfer_fit, final, goodput)
        return cls(found, costs, params, found.options.slo, budgets, windows, largest, final, goodput, network)

    def at(self, slo: SLO) -> _Run:
        """The same decision taken again against `slo`, over the same candidate layouts (so that the two
        runs differ in the answer, never in the menu)."""
        options = replace(self.found.options, slo=slo, chunk_budgets_tokens=self.budgets)
        return _Run.of(replace(self.found, options=options), self.costs, self.params, self.budgets)

    def fields(self) -> dict[str, Any]:
        return dict(
            goodput=self.goodput,
            network=self.network,
            windows=self.windows,
            costs=self.costs,
            engine_params=self.params,
        )


def _served_attainment(found: _Findings, requests: RequestTable) -> float | None:
    """The measured attainment among the requests that did not fail (the ones the model check replays):
    failed requests never meet the SLO, so it is the measured share over the served share."""
    served = int((~requests.failed).sum())
    if found.measured is None or not served:
        return None
    return found.measured.attainment * len(requests) / served


def _corrected_report(found: _Findings, run: _Run, check: dict[str, float], judgement: selfcheck.Judgement) -> Report:
    """Misses that matter: correct the model (selfcheck.Correction) and decide again; answer only when the
    corrected decision is the same one, else `insufficient-data` with the original as the unconfirmed guess."""
    guess = prose.decision_headline(run.final)
    unconfirmed = prose.unconfirmed_line(guess)
    correction = judgement.correction
    if correction is None:
        stops = judgement.refusals or [prose.NO_QUANTILE_MISSES]
        reasons = judgement.mattering + [r for r in stops if r not in judgement.mattering] + [unconfirmed]
        self_check = _self_check(judgement, selfcheck.Outcome.REFUSED_FIT)
        return _refuse(found, run, check, reasons, guess, self_check)
    corrected = run.at(correction.slo(run.slo))
    said = prose.decision_headline(corrected.final)
    correction_line = prose.correction_line(correction, run.slo, corrected.slo)
    if corrected.final.verdict != Verdict.INSUFFICIENT_DATA and _same_decision(run.final, corrected.final):
        self_check = _self_check(judgement, selfcheck.Outcome.CORRECTED_SAME_VERDICT, correction, said)
        found.evidence += judgement.mattering + judgement.harmless + [correction_line]
        found.evidence.append(prose.corrected_agrees_line(said, corrected.final.reasons))
        if corrected.final.key != run.final.key:
            found.evidence.append(prose.budget_moved_line(guess, said))
        confidence = _lower_confidence(_confidence(run), _confidence(corrected))
        if confidence is not None:
            found.evidence.append(prose.confidence_line(confidence) + prose.LOWER_OF_BOOTSTRAPS)
        return _answer(found, corrected, check, confidence, self_check)
    if _margin_erased(run, corrected):
        outcome = selfcheck.Outcome.REFUSED_MARGIN
        why = prose.margin_erased_line(guess, said, found.options.margin)
    else:
        outcome, why = selfcheck.Outcome.REFUSED_FLIPS, prose.flips_line(guess, said)
    self_check = _self_check(judgement, outcome, correction, said)
    reasons = judgement.mattering + [correction_line, why, unconfirmed]
    return _refuse(found, run, check, reasons, guess, self_check)


def _same_decision(first: Decision, corrected: Decision) -> bool:
    """Whether the corrected decision is the same one: the same key, or chunked prefill both times at
    another token budget. A budget is a scheduler setting of the same layout, and the corrected model's
    is the one that meets the objective as measured, so the report answers with it (and says it moved);
    another split ratio is another deployment, and stays a flip."""
    if corrected.key == first.key:
        return True
    return first.verdict == corrected.verdict == Verdict.ENABLE_CHUNKED_PREFILL and first.ratio == corrected.ratio


def _margin_erased(run: _Run, corrected: _Run) -> bool:
    """Whether the corrected run still ranks the original change first and only its margin is gone: with
    no margin to clear, the corrected windows would decide the same change."""
    current = run.found.current
    if not run.final.changes_layout or current is None:
        return False
    at_zero = [decide(current, w.results, 0.0) if w.results else w.decision for w in corrected.windows]
    return combine_windows(current, at_zero).key == run.final.key


def _self_check(
    judgement: selfcheck.Judgement,
    outcome: selfcheck.Outcome,
    correction: selfcheck.Correction | None = None,
    corrected_verdict: str | None = None,
) -> dict[str, Any]:
    """The report's `self_check` field (docs/architecture.md, section 7)."""
    return {
        "misses": list(judgement.misses),
        "mattering": list(judgement.mattering),
        "correction": None
        if correction is None
        else {"ttft_factor": correction.ttft_factor, "itl_factor": correction.itl_factor},
        "corrected_verdict": corrected_verdict,
        "outcome": outcome,
    }


def _refuse(
    found: _Findings, run: _Run, check: dict[str, float], reasons: list[str], guess: str, self_check: dict[str, Any]
) -> Report:
    return found.report(
        Verdict.INSUFFICIENT_DATA,
        reasons,
        model_check=check,
        unconfirmed=guess,
        self_check=self_check,
        **run.fields(),
    )


def _confidence(run: _Run) -> Confidence | None:
    """Bootstrap the run's verdict (confidence.py); None when skipped or no window had data."""
    options, step_fit, current = run.found.options, run.found.step_fit, run.found.current
    if not options.confidence_resamples or run.largest is None or step_fit is None or current is None:
        return None
    largest_results, observed = run.largest[1], run.largest[2]
    decided = Decided(
        run.final,
        current,
        largest_results,
        observed,
        step_fit,
        run.costs,
        run.slo,
        options.margin,
        run.params,
        run.found.merge_margin,
    )
    size = RerunSize(min(options.sim_requests, RERUN_REQUESTS), min(options.sim_duration_s, RERUN_DURATION_S))
    return bootstrap(decided, options.confidence_resamples, options.seed, size)


def _lower_confidence(one: Confidence | None, other: Confidence | None) -> Confidence | None:
    """The less sure of two bootstraps of the same verdict: a corrected answer is as sure as its weaker side
    (a factor on the corrected one would be a number nobody measured)."""
    if one is None or other is None:
        return one or other
    return one if one.share <= other.share else other


def _answer(
    found: _Findings,
    run: _Run,
    check: dict[str, float],
    confidence: Confidence | None,
    self_check: dict[str, Any],
) -> Report:
    final = run.final
    return found.report(
        final.verdict,
        ratio=final.ratio,
        from_ratio=final.from_ratio,
        chunk_budget_tokens=final.chunk_budget_tokens,
        recommended=final.recommended,
        win_margin=final.win_margin,
        model_check=check,
        confidence=confidence.share if confidence else None,
        confidence_resamples=confidence.resamples if confidence else 0,
        self_check=self_check,
        **run.fields(),
    )


def _findings(data: TraceData, options: ReportOptions) -> _Findings:
    """Fits, measurements and assumptions from the traces; `missing` says what rules a decision out."""
    slo = options.slo
    requests = data.requests
    current = current_layout(data)
    missing: list[str] = []
    assumptions: list[str] = []
    if len(requests) < options.min_requests:
        missing.append(prose.too_few_requests_line(len(requests), options.min_requests))
    if current is None:
        missing.append(prose.NO_WORKER_SPANS)
    engine_metrics = read_metrics_file(options.metrics_file) if options.metrics_file else None
    prefill_fit = fit_prefill(requests)
    # A chunked engine without step spans: its prefill windows are several mixed steps, not one stall.
    chunked = current is not None and current.mode == Mode.CHUNKED and len(data.steps) < options.min_steps
    step_fit = _step_costs(data, options, missing, assumptions, chunked)
    if chunked and step_fit is not None and current is not None:
        current = _with_inferred_budget(current, requests, step_fit, assumptions)
    requests, estimated_itl, estimated = _with_estimated_gaps(
        requests, slo, step_fit.costs if chunked and step_fit is not None else None
    )
    if estimated_itl:
        assumptions.append(prose.estimated_gaps_line(estimated_itl, len(requests), chunked))
    transfer_fit = fit_transfers(data.transfers)
    transfer = _transfer_costs(options, transfer_fit, assumptions)
    gpus = options.gpus or (current.gpus if current else 0)
    assumptions += prose.run_lines(options, gpus if options.gpus is None and current is not None else None)
    if data.read.skipped_lines or data.skipped_spans:
        first = data.read.first_error or data.first_skip
        assumptions.append(prose.skipped_line(data.read.skipped_lines, data.skipped_spans, first))
    measured = measure(requests, slo) if len(requests) else None
    evidence = list(options.extra_evidence)
    if engine_metrics is not None:
        evidence += metrics_evidence(engine_metrics, slo.itl_s)
        assumptions += _use_metrics_file(engine_metrics, requests, estimated, slo, measured)
    fits = _fits_dict(step_fit, prefill_fit, transfer_fit, transfer)
    return _Findings(
        data,
        options,
        requests,
        current,
        step_fit,
        prefill_fit,
        transfer_fit,
        transfer,
        gpus,
        fits,
        measured,
        _read_counts(data, len(requests)),
        evidence,
        assumptions,
        missing,
        engine_metrics,
    )


def _read_counts(data: TraceData, requests: int) -> dict[str, Any]:
    """The report's `read` field: what was read, what was skipped and what it made."""
    return {
        "files": data.files,
        "lines": data.read.lines,
        "spans": data.read.spans,
        "skipped_lines": data.read.skipped_lines,
        "skipped_spans": data.skipped_spans,
        "requests": requests,
        "steps": len(data.steps),
        "transfers": len(data.transfers),
    }


def _use_metrics_file(
    engine_metrics: EngineMetrics,
    requests: RequestTable,
    estimated_gaps: list[np.ndarray] | None,
    slo: SLO,
    measured: Measured | None,
) -> list[str]:
    """What the report took from the metrics file, as assumption lines. Where the per-request gaps were
    estimated and the SLO is on a request's p99 or max gap, the measured attainment counts the gaps over
    the SLO from the engine's histogram instead (`measured` is updated in place)."""
    lines = [prose.metrics_file_line(engine_metrics.path, metrics_sources(engine_metrics))]
    gaps = engine_metrics.gaps
    if gaps is None or not gaps.count or estimated_gaps is None or measured is None or slo.itl_stat == "mean":
        return lines
    share = gaps.share_above(slo.itl_s)
    passes = itl_pass_probability(estimated_gaps, slo.itl_s, slo.itl_stat, share)
    by_spans = np.isnan(passes)
    itl_ok = np.nan_to_num(requests.itl(slo.itl_stat), nan=np.inf) <= slo.itl_s
    p_itl = np.where(by_spans, itl_ok.astype(float), passes)
    ttft_ok = (requests.ttft_s <= slo.ttft_s) & ~requests.failed
    measured.attainment = float(np.mean(ttft_ok * p_itl)) if len(requests) else 0.0
    lines.append(prose.metrics_attainment_line(int((~by_spans).sum()), gaps.family, share, gaps.count, slo))
    return lines


def _with_inferred_budget(current: Layout, requests: RequestTable, step_fit: StepFit, assumptions: list[str]) -> Layout:
    """The deployed chunked layout with its token budget inferred from request overlap (said so)."""
    budget = chunk_budget_tokens(requests, step_fit.costs)
    if budget is None:
        assumptions.append(prose.unknown_budget_line(current.chunk_budget_tokens))
        return current
    assumptions.append(prose.inferred_budget_line(budget))
    return replace(current, chunk_budget_tokens=max(budget, 1))


def _step_costs(
    data: TraceData, options: ReportOptions, missing: list[str], assumptions: list[str], chunked: bool = False
) -> StepFit | None:
    """The step model: fitted on step spans, else estimated from how requests overlap (said so)."""
    if len(data.steps) >= options.min_steps:
        assumptions.append(prose.fitted_steps_line(int(data.steps.decode_requests.max())))
        model = _step_model(data, options, assumptions)
        if model == "roofline":
            assumptions.append(prose.roofline_shape_line(options.model_shape))
        return fit_steps(data.steps, model, options.model_shape)
    roofline = _step_model(data, options, assumptions) == "roofline"
    shape = options.model_shape if roofline else None
    if not len(data.requests):
        step_fit = None
    elif chunked:
        step_fit = estimate_chunked_steps(data.requests, shape)
    else:
        step_fit = estimate_steps(data.requests, shape=shape)
    if step_fit is None:
        missing.append(prose.no_step_costs_line(len(data.steps), options.min_steps))
        return None
    assumptions.append(prose.estimated_steps_line(len(data.steps), chunked))
    if roofline:
        assumptions.append(prose.roofline_shape_line(shape))
    return with_roofline(step_fit) if roofline and not step_fit.costs.gemm_knee_tokens else step_fit


def _step_model(data: TraceData, options: ReportOptions, assumptions: list[str]) -> str:
    """The step model asked for, or the one the traces call for (`auto`, said in an assumption)."""
    if options.step_model != "auto":
        return options.step_model
    model = "roofline" if data.device_timed else "linear"
    assumptions.append(prose.auto_step_model_line(model))
    return model


def _judge_windows(
    found: _Findings, costs: Costs, params: EngineParams, budgets: tuple[int, ...]
) -> tuple[list[WindowResult], tuple[int, list[GoodputResult], Workload] | None]:
    """Every window's decision over the candidate layouts (chunked at each of `budgets`), and the largest
    window's goodput results."""
    options, requests, data, current = found.options, found.requests, found.data, found.current
    assert current is not None
    layouts = candidate_layouts(found.gpus, budgets)
    if current.label not in {layout.label for layout in layouts}:
        layouts.append(current)
    window_results: list[WindowResult] = []
    largest: tuple[int, list[GoodputResult], Workload] | None = None  # the window with the most requests
    for start_ns, end_ns in _windows(data, options):
        selected = requests.select((requests.arrival_ns >= start_ns) & (requests.arrival_ns < end_ns))
        bounds = ((start_ns - data.start_ns) / 1e9, (end_ns - data.start_ns) / 1e9)
        if len(selected) < options.min_requests:
            decision = insufficient(
                [f"window {bounds[0]:.0f}-{bounds[1]:.0f} s: {len(selected)} requests (need {options.min_requests})"]
            )
            window_results.append(WindowResult(*bounds, len(selected), decision, []))
            continue
        observed = _workload(selected)
        sample = observed.resample(max(options.sim_requests, options.sim_max_requests), options.seed)
        results = [
            search_goodput(
                layout,
                sample,
                costs,
                options.slo,
                start_rate_per_s=max(observed.rate_per_s, 1e-3),
                min_requests=options.sim_requests,
                duration_s=options.sim_duration_s,
                params=params,
            )
            for layout in layouts
        ]
        decision = decide(current, results, options.margin, found.merge_margin)
        if largest is None or len(selected) > largest[0]:
            largest = (len(selected), results, observed)
        window_results.append(WindowResult(*bounds, len(selected), decision, [_option(r) for r in results], results))
    return window_results, largest


def _with_estimated_gaps(
    requests: RequestTable, slo: SLO, chunked_costs: StepCosts | None = None
) -> tuple[RequestTable, int, list[np.ndarray] | None]:
    """`requests` with the inter-token statistics their spans lack estimated (estimate.py), how many, and
    the estimated gaps of each (empty for requests whose spans had the statistic; None when none had)."""
    missing = np.isnan(requests.itl(slo.itl_stat)) & (requests.output_tokens > 1) & ~requests.failed
    if not missing.any():
        return requests, 0, None
    gaps = estimate_gaps(requests, chunked_costs)
    columns = {}
    for name, estimate in (
        ("itl_p50_s", gaps.p50_s),
        ("itl_p99_s", gaps.p99_s),
        ("itl_max_s", gaps.max_s),
        ("itl_mean_s", gaps.mean_s),
    ):
        current = getattr(requests, name)
        columns[name] = np.where(np.isnan(current), estimate, current)
    filled = replace(requests, **columns)
    gap_lists = [g if missing[i] else np.zeros(0) for i, g in enumerate(gaps.gaps_s)]
    return filled, int((missing & ~np.isnan(filled.itl(slo.itl_stat))).sum()), gap_lists


def _budgets(step_fit: StepFit, slo: SLO, requests: RequestTable, data: TraceData) -> tuple[int, ...]:
    """Chunk budgets to simulate, around the ITL bound at the decode batch the traces show."""
    steps = data.steps
    if len(steps) and np.any(steps.decode_requests > 0):
        decoding = steps.decode_requests > 0
        batch = int(np.ceil(np.average(steps.decode_requests[decoding], weights=steps.weight[decoding])))
        context = int(np.average(steps.context_tokens[decoding], weights=steps.weight[decoding]))
    else:
        batch = 8
        context = int(batch * np.mean(requests.input_tokens + requests.output_tokens / 2)) if len(requests) else 0
    prompts = np.maximum(requests.input_tokens - requests.cached_tokens, 1)
    return candidate_budgets_tokens(step_fit.costs, slo.itl_s, prompts, batch, context)


def _transfer_costs(options: ReportOptions, fit: TransferFit | None, assumptions: list[str]) -> TransferCosts:
    if options.kv_bytes_per_token is not None:
        per_token = options.kv_bytes_per_token
        assumptions.append(prose.kv_bytes_line(per_token, assumed=False))
    elif options.model_shape is not None:
        per_token = options.model_shape.kv_bytes_per_token
        assumptions.append(prose.kv_bytes_line(per_token, assumed=False, source="the model's config"))
    elif fit is not None:
        per_token = fit.kv_bytes_per_token
    else:
        per_token = DEFAULT_KV_BYTES_PER_TOKEN
        assumptions.append(prose.kv_bytes_line(per_token, assumed=True))
    if options.link_gbps is not None:
        bandwidth = options.link_gbps * 1e9 / 8
        assumptions.append(prose.link_line(options.link_gbps, assumed=False))
    elif fit is not None:
        bandwidth = fit.bandwidth_bytes_per_s
    else:
        bandwidth = DEFAULT_LINK_GBPS * 1e9 / 8
        assumptions.append(prose.link_line(DEFAULT_LINK_GBPS, assumed=True))
    constant = fit.constant_s if fit is not None else DEFAULT_TRANSFER_CONSTANT_S
    if fit is None:
        assumptions.append(prose.transfer_constant_line(constant))
    return TransferCosts(per_token, bandwidth, constant)


def _windows(data: TraceData, options: ReportOptions) -> list[tuple[int, int]]:
    start, end = data.start_ns, int(data.requests.arrival_ns.max()) + 1
    if options.window_s is None:
        return [(start, end)]
    width = int(options.window_s * 1e9)
    return [(s, min(s + width, end)) for s in range(start, end, width)]


def _option(result: GoodputResult) -> OptionResult:
    layout = result.layout
    return OptionResult(
        layout.label,
        layout.mode,
        layout.ratio,
        layout.chunk_budget_tokens or None,
        layout.gpus,
        result.rate_per_s,
        result.goodput_per_gpu,
    )


def _mean_options(windows: list[WindowResult]) -> list[OptionResult]:
    out = []
    for i, first in enumerate(windows[0].options):
        rates = [w.options[i].rate_per_s for w in windows]
        per_gpu = [w.options[i].goodput_per_gpu for w in windows]
        out.append(
            OptionResult(
                first.label,
                first.mode,
                first.ratio,
                first.chunk_budget_tokens,
                first.gpus,
                float(np.mean(rates)),
                float(np.mean(per_gpu)),
            )
        )
    return out


def _network(
    measured: Measured | None,
    transfer: TransferCosts,
    fit: TransferFit | None,
    decision: Decision,
    goodput: list[OptionResult],
) -> dict[str, float]:
    """Link bandwidth a split needs (KV bytes produced per second) against what is available."""
    if measured is None or measured.requests == 0 or measured.rate_per_s <= 0:
        return {}
    data_bytes_per_request = transfer.kv_bytes_per_token * measured.prompt_tokens_mean
    need_gbps = measured.rate_per_s * data_bytes_per_request * 8 / 1e9
    split = decision.recommended if decision.recommended and decision.recommended.mode == Mode.DISAGGREGATED else None
    prefill_workers = split.prefill_workers if split else 1
    out = {
        "observed_rate_per_s": measured.rate_per_s,
        "kv_bytes_per_request": data_bytes_per_request,
        "required_gbps_total": need_gbps,
        "required_gbps_per_prefill_worker": need_gbps / prefill_workers,
        "link_gbps_per_prefill_worker": transfer.link_bytes_per_s * 8 / 1e9,
    }
    if fit is not None:
        out["measured_gbps"] = fit.bandwidth_bytes_per_s * 8 / 1e9
        out["mean_exposed_transfer_s"] = fit.mean_exposed_s
    return out


def _frontend_s(requests: RequestTable) -> float:
    """Median TTFT the engine stages do not explain (router hop, streaming): measured, then replayed."""
    transfer = np.where(np.isnan(requests.transfer_s), 0.0, requests.transfer_s)
    rest = requests.ttft_s - requests.queue_s - requests.prefill_s - transfer
    rest = rest[~np.isnan(rest) & ~requests.failed]
    return float(max(0.0, np.median(rest))) if len(rest) else 0.0


def _joined_token_share(requests: RequestTable) -> tuple[float, int]:
    """The share of gaps the client saw as 0 (a token in one stream event with the one before;
    `splitscope.itl_joined_tokens`) over the served requests that state it, and how many state it.
    (0.0, 0) when none does (stock vLLM spans): the model then streams every token by itself."""
    known = ~requests.failed & ~np.isnan(requests.itl_joined_tokens) & (requests.output_tokens > 1)
    gaps = float((requests.output_tokens[known] - 1).sum())
    if not gaps:
        return 0.0, 0
    return float(requests.itl_joined_tokens[known].sum()) / gaps, int(known.sum())


def model_check(
    current: Layout,
    requests: RequestTable,
    costs: Costs,
    slo: SLO,
    noise_sigma: float = 0.0,
    params: EngineParams = EngineParams(),
    measured_gaps: Histogram | None = None,
    measured_attainment: float | None = None,
    step_noise: StepNoise | None = None,
) -> dict[str, float]:
    """The fitted model replaying the observed requests on the current layout, against what was measured:
    medians of TTFT and of the per-request ITL statistic, predicted and measured (seconds). Step times
    vary as measured (`step_noise`: each kind's residuals, in streaks where they were correlated; kinds
    without enough residuals, and transfers, by the fit's spread `noise_sigma`; seeded: reproducible). With the engine's
    gap histogram (`measured_gaps`), also every predicted gap's p50/p90/p99 against the bucket that holds
    the measured one (`measured_gap_pXX_low_s` / `_high_s`): a measurement no estimate stands in for. And
    the share of requests meeting both SLOs at the observed rate, `predicted_attainment` against
    `measured_attainment` (given: the report's own measure, e.g. corrected by the gap histogram; else
    counted on these requests' spans)."""
    ok = ~requests.failed
    if ok.sum() < 2:
        return {}
    result = simulate(
        current,
        _workload(requests.select(ok)),
        costs,
        slo,
        params=params,
        noise_sigma=noise_sigma,
        step_noise=step_noise,
        seed=0,
        record=measured_gaps is not None and measured_gaps.count > 0,
    )
    measured_itl = requests.itl(slo.itl_stat)[ok]
    measured_itl = measured_itl[~np.isnan(measured_itl)]
    measured_ttft = requests.ttft_s[ok]
    measured_ttft = measured_ttft[~np.isnan(measured_ttft)]
    out: dict[str, float] = {
        "predicted_attainment": result.attainment_for(slo),
        "measured_attainment": measured_attainment
        if measured_attainment is not None
        else measure(requests.select(ok), slo).attainment,
        "attainment_requests": float(ok.sum()),
    }
    for q in (50, 90):
        out[f"predicted_ttft_p{q}_s"] = float(np.percentile(result.ttft_s, q))
        out[f"measured_ttft_p{q}_s"] = float(np.percentile(measured_ttft, q)) if len(measured_ttft) else float("nan")
        out[f"predicted_itl_p{q}_s"] = float(np.percentile(result.itl(slo.itl_stat), q))
        out[f"measured_itl_p{q}_s"] = float(np.percentile(measured_itl, q)) if len(measured_itl) else float("nan")
    # The share of requests over each objective, predicted and measured: whether a quantile miss moves
    # requests across it (selfcheck.judge).
    for quantity, predicted, measured, threshold in (
        ("ttft", result.ttft_s, measured_ttft, slo.ttft_s),
        ("itl", result.itl(slo.itl_stat), measured_itl, slo.itl_s),
    ):
        predicted = predicted[np.isfinite(predicted)]
        out[f"predicted_{quantity}_over_slo"] = (
            float(np.mean(predicted > threshold)) if len(predicted) else float("nan")
        )
        out[f"measured_{quantity}_over_slo"] = float(np.mean(measured > threshold)) if len(measured) else float("nan")
    gaps = [g for g in (result.token_gaps or []) if len(g)]
    if measured_gaps is not None and gaps:
        predicted = np.concatenate(gaps)
        for q in selfcheck.GAP_QUANTILES:
            low, high = measured_gaps.bucket_of_quantile(q / 100)
            out[f"predicted_gap_p{q}_s"] = float(np.percentile(predicted, q))
            out[f"measured_gap_p{q}_low_s"], out[f"measured_gap_p{q}_high_s"] = low, high
    return out


def _fits_dict(
    step_fit: StepFit | None, prefill_fit: PrefillFit | None, transfer_fit: TransferFit | None, transfer: TransferCosts
) -> dict[str, Any]:
    fits: dict[str, Any] = {}
    if step_fit is not None:
        c = step_fit.costs
        fits["step"] = {
            "source": step_fit.source,
            "samples": step_fit.samples,
            "r2": step_fit.r2,
            "base_s": c.base_s,
            "context_s_per_token": c.context_s_per_token,
            "decode_s_per_request": c.decode_s_per_request,
            "prefill_s_per_token": c.prefill_s_per_token,
            "prefill_s_per_token2": c.prefill_s_per_token2,
            # The largest decode batch and batch context of a fitted step (0: not known, estimated fits);
            # past `max_batch_seen` each request costs `decode_s_per_request_beyond`.
            "max_batch_seen": step_fit.max_batch_seen,
            "max_context_seen": step_fit.max_context_seen,
            "decode_s_per_request_beyond": c.decode_s_per_request_beyond if c.max_batch_seen > 0 else None,
            # "roofline": past `max_batch_seen` a request costs its KV read until `roofline_knee_tokens`.
            "roofline_knee_tokens": c.roofline_knee_tokens if c.roofline_knee_tokens > 0 else None,
            # "roofline" on step spans, pass by pass: every token a step runs past `gemm_knee_tokens` costs
            # `prefill_s_per_token`, and a step with any prefill adds `prefill_floor_s`.
            "gemm_knee_tokens": c.gemm_knee_tokens if c.gemm_knee_tokens > 0 else None,
            "prefill_floor_s": c.prefill_floor_s if c.gemm_knee_tokens > 0 else None,
            # Each step kind's spread and whether consecutive steps' residuals are correlated (noise.py).
            "noise": step_fit.noise.as_json() if step_fit.noise is not None else None,
        }
        fits["interference_factor"] = step_fit.interference_factor
    if prefill_fit is not None:
        fits[Stage.PREFILL] = {
            "a_s": prefill_fit.a_s,
            "b_s_per_token": prefill_fit.b_s_per_token,
            "c_s_per_token2": prefill_fit.c_s_per_token2,
            "r2": prefill_fit.r2,
            "samples": prefill_fit.samples,
        }
    fits["transfer"] = {
        "observed": transfer_fit is not None,
        "bandwidth_gbps": transfer.link_bytes_per_s * 8 / 1e9,
        "constant_s": transfer.constant_s,
        "kv_bytes_per_token": transfer.kv_bytes_per_token,
        "mean_exposed_s": transfer_fit.mean_exposed_s if transfer_fit else None,
        "samples": transfer_fit.samples if transfer_fit else 0,
    }
    return fits
