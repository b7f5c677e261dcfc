"""The report's sentences: its headline and every line of evidence and assumption, written from what
`build` measured, fitted and decided. Nothing is decided here: each function takes the numbers and the
decision and only words them, so the headline reads the same wherever it appears (the Markdown verdict, the
JSON `headline`, an unconfirmed guess, a corrected verdict). Pure computation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tracer.report import selfcheck
from tracer.report.noise import STEP_KINDS, StepNoise
from tracer.report.simulate import SLO
from tracer.vocabulary import Verdict

if TYPE_CHECKING:  # build imports this module; these are its types, for annotations only
    from tracer.report.build import Measured, ReportOptions, WindowResult
    from tracer.report.confidence import Confidence
    from tracer.report.decide import Decision
    from tracer.report.fit import PrefillFit, StepFit, TransferFit
    from tracer.report.model_shape import ModelShape
    from tracer.report.simulate import Layout


def headline(verdict: str, ratio: str | None, from_ratio: str | None, chunk_budget_tokens: int | None) -> str:
    """The verdict and its parameter in a few words, e.g. `split 1:3`, `rebalance 3:1 -> 1:3` or
    `enable-chunked-prefill (token budget 256)`."""
    if verdict == Verdict.REBALANCE:
        return f"rebalance {from_ratio} -> {ratio}"
    if verdict == Verdict.SPLIT:
        return f"split {ratio}"
    if verdict == Verdict.ENABLE_CHUNKED_PREFILL:
        return f"{verdict} (token budget {chunk_budget_tokens})"
    if verdict == Verdict.MERGE and chunk_budget_tokens:
        return f"{verdict} (colocated with chunked prefill, token budget {chunk_budget_tokens})"
    return str(verdict)


def decision_headline(decision: Decision) -> str:
    return headline(decision.verdict, decision.ratio, decision.from_ratio, decision.chunk_budget_tokens)


ROUTER_WORDS = {
    "least-outstanding": "to the worker with the fewest requests in flight (a prefill pool: fewest prompt tokens), "
    "as the reference router does",
    "round-robin": "round-robin in arrival order (a split's decode workers in KV-ready order)",
    "session": "by session (rendezvous hashing; the traces carry no session, so each request is its own)",
}


def extrapolation_lines(step_fit: StepFit, windows: list[WindowResult]) -> list[str]:
    """What the goodput runs simulated past the largest batch and context the step fit saw: stated, with
    how the step cost is extended there (an assumption: nothing measured it)."""
    ran = [r.at_rate for w in windows for r in w.results if r.at_rate is not None]
    if not ran or step_fit.max_batch_seen <= 0:
        return []
    lines = []
    batch = max(result.max_batch for result in ran)
    c = step_fit.costs
    if batch > step_fit.max_batch_seen and c.max_batch_seen > 0:
        past = f"decode batches up to {batch} simulated, past the largest fitted ({step_fit.max_batch_seen}): "
        if c.gemm_knee_tokens > 0:
            lines.append(
                past + "priced pass by pass as an accelerator runs them (--step-model roofline): each request past it "
                f"adds its KV read, and its GEMMs once the step runs more than {c.gemm_knee_tokens:.0f} tokens (the "
                f"fitted knee), {c.prefill_s_per_token * 1e6:.3g} us a token as every token past it; EXTRAPOLATED"
            )
        elif c.roofline_knee_tokens > 0:
            lines.append(
                past + f"priced as an accelerator runs them (--step-model roofline): each request past it adds its KV "
                f"read only, until the step runs {c.roofline_knee_tokens:.0f} tokens (the knee: {c.base_s * 1e3:.3g} "
                f"ms per step over {c.prefill_s_per_token * 1e6:.3g} us per prefill token), then a prefill token's "
                f"cost; the fitted small-batch slope ({c.decode_s_per_request * 1e3:.3g} ms/request) is not extended; "
                "EXTRAPOLATED"
            )
        else:
            lines.append(
                past + f"each request past it is priced at {c.decode_s_per_request_beyond * 1e3:.3g} ms, the marginal "
                f"cost measured at the largest batches (fitted slope {c.decode_s_per_request * 1e3:.3g} ms), never "
                "below it; EXTRAPOLATED, and the bootstrap re-measures that slope"
            )
    context = max(result.max_context_tokens for result in ran)
    if step_fit.max_context_seen > 0 and context > step_fit.max_context_seen:
        lines.append(
            f"batch context up to {context} tokens simulated, past the largest fitted ({step_fit.max_context_seen}): "
            "the per-token context cost is EXTRAPOLATED linearly"
        )
    return lines


def correction_line(correction: selfcheck.Correction, slo: SLO, corrected: SLO) -> str:
    return (
        f"self-check correction {correction.describe()}: for the deployment to meet TTFT <= {slo.ttft_s:.3g} s "
        f"and ITL {slo.itl_stat} <= {slo.itl_s:.3g} s, the model must meet TTFT <= {corrected.ttft_s:.3g} s and "
        f"ITL {slo.itl_stat} <= {corrected.itl_s:.3g} s; the decision is taken again against those "
        f"(factors clipped to 1/{selfcheck.MAX_CORRECTION:g}..{selfcheck.MAX_CORRECTION:g})"
    )


def model_check_line(check: dict[str, float], slo: SLO) -> str:
    return (
        f"model check on the current layout (pass: {selfcheck.describe_tolerance()}): TTFT p50/p90 predicted "
        f"{check['predicted_ttft_p50_s']:.3g}/{check['predicted_ttft_p90_s']:.3g} s vs measured "
        f"{check['measured_ttft_p50_s']:.3g}/{check['measured_ttft_p90_s']:.3g} s; ITL {slo.itl_stat} p50/p90 predicted "
        f"{check['predicted_itl_p50_s']:.3g}/{check['predicted_itl_p90_s']:.3g} s vs measured "
        f"{check['measured_itl_p50_s']:.3g}/{check['measured_itl_p90_s']:.3g} s"
        + "".join(
            f"; every gap's p{q} predicted {check[f'predicted_gap_p{q}_s']:.3g} s vs the engine's "
            f"{check[f'measured_gap_p{q}_low_s']:.3g}-{check[f'measured_gap_p{q}_high_s']:.3g} s bucket"
            for q in selfcheck.GAP_QUANTILES
            if f"predicted_gap_p{q}_s" in check
        )
        + (
            f"; SLO attainment at the observed rate predicted {check['predicted_attainment']:.1%} vs measured "
            f"{check['measured_attainment']:.1%}"
            if "predicted_attainment" in check and "measured_attainment" in check
            else ""
        )
    )


def step_noise_line(noise: StepNoise) -> str:
    spreads = ", ".join(f"{kind} {noise.spread(kind):.3g}" for kind in STEP_KINDS if not math.isnan(noise.spread(kind)))
    if math.isnan(noise.lag1_autocorrelation):
        streaks = f"too few consecutive steps ({noise.pairs}) to tell streaks: drawn one at a time"
    else:
        streaks = (
            f"consecutive steps' lag-1 autocorrelation {noise.lag1_autocorrelation:.2f} over {noise.pairs} pairs: "
            + (
                f"drawn in runs of {noise.block_steps} consecutive steps"
                if noise.block_steps > 1
                else "drawn one at a time"
            )
        )
    return f"step noise as measured (log residual spread by kind: {spreads or 'too few steps of any kind'}); {streaks}"


def confidence_line(confidence: Confidence) -> str:
    said = ", ".join(
        f"{verdict} x{count}" for verdict, count in sorted(confidence.verdicts.items(), key=lambda kv: -kv[1])
    )
    return (
        f"confidence {confidence.share:.0%}: {round(confidence.share * confidence.resamples)} of {confidence.resamples} "
        f"re-runs on resampled requests and step-fit residuals reach the same verdict ({said})"
    )


def evidence_lines(
    measured: Measured | None,
    step_fit: StepFit,
    prefill_fit: PrefillFit | None,
    transfer_fit: TransferFit | None,
    network: dict[str, float],
    current: Layout,
    final: Decision,
    windows: list[WindowResult],
) -> list[str]:
    lines = [f"current layout: {current.label} ({current.gpus} GPUs)"]
    if measured is not None:
        lines.append(
            f"measured: {measured.requests} requests at {measured.rate_per_s:.3g} req/s, SLO attainment {measured.attainment:.1%}, "
            f"TTFT p90 {measured.ttft_s.get('p90', float('nan')):.3g} s, per-request ITL p90 {measured.itl_s.get('p90', float('nan')):.3g} s"
        )
    lines.append(step_fit_line(step_fit))
    if step_fit.interference_factor is not None:
        lines.append(
            f"interference: steps with prefill tokens take {step_fit.interference_factor:.2f}x a decode-only step at equal batch "
            f"and context ({step_fit.interference_samples} samples)"
        )
    if step_fit.noise is not None:
        lines.append(step_noise_line(step_fit.noise))
    if prefill_fit is not None:
        lines.append(
            f"prefill fit ({prefill_fit.samples} requests, R^2 {prefill_fit.r2:.3f}): {prefill_fit.a_s * 1e3:.3g} ms + "
            f"{prefill_fit.b_s_per_token * 1e6:.3g} us/token + {prefill_fit.c_s_per_token2 * 1e9:.3g} ns/token^2"
        )
    if transfer_fit is not None:
        lines.append(
            f"KV transfers: {transfer_fit.samples} observed, {transfer_fit.bandwidth_bytes_per_s * 8 / 1e9:.3g} Gb/s effective, "
            f"{transfer_fit.constant_s * 1e3:.3g} ms constant, {transfer_fit.mean_exposed_s * 1e3:.3g} ms exposed on average"
        )
    if network:
        lines.append(
            f"network: a split needs {network['required_gbps_total']:.3g} Gb/s of KV traffic at the observed rate "
            f"({network['required_gbps_per_prefill_worker']:.3g} Gb/s per prefill worker) against "
            f"{network['link_gbps_per_prefill_worker']:.3g} Gb/s per prefill worker"
        )
    lines += final.reasons
    if len(windows) > 1:
        lines.append(
            "windows: "
            + "; ".join(
                f"{w.start_s:.0f}-{w.end_s:.0f} s: {w.decision.verdict}"
                + (f" {w.decision.ratio}" if w.decision.ratio else "")
                for w in windows
            )
        )
    return lines


# ------------------------------------------------------------------ what rules a decision out (`missing`)

NO_WORKER_SPANS = "no worker spans (splitscope.prefill/decode/step with splitscope.pool and splitscope.worker): current layout unknown"


def too_few_requests_line(requests: int, needed: int) -> str:
    return f"{requests} requests with a root `text_completion` span; need at least {needed}"


def no_step_costs_line(steps: int, needed: int) -> str:
    return f"{steps} splitscope.step spans (need {needed}) and too few prefill/decode spans to estimate step costs"


# ------------------------------------------------------------------------------------------ assumptions


def fitted_steps_line(largest_batch: int) -> str:
    # Measured on the reference server (bench/verdict_ab.py): a fit on a light run's small batches
    # under-priced steps at the batch cap, and the goodput predicted there was too high.
    return (
        f"step costs are fitted on decode batches of up to {largest_batch} requests; "
        "rates that need larger batches extrapolate the fit (linear in batch and context)"
    )


def estimated_steps_line(steps: int, chunked: bool) -> str:
    return (
        f"no splitscope.step spans ({steps} seen): step costs and interference are ESTIMATED from how requests "
        "overlap on each worker (decode time against the decode batch and context it ran with, net of the prefills "
        "that ran on the same worker in its decode window"
        + (
            "; chunked prefill (splitscope.mode on the engine's stage spans): the prompt tokens prefilled there "
            "in its window priced as chunks)"
            if chunked
            else ")"
        )
    )


def unknown_budget_line(assumed_tokens: int) -> str:
    return f"the deployed chunk budget is unknown (no step spans, too little overlap): {assumed_tokens} assumed"


def inferred_budget_line(budget_tokens: int) -> str:
    return (
        f"the deployed chunk budget is INFERRED from request overlap: about {budget_tokens} tokens per step (prefill "
        "tokens per mixed step plus the decodes sharing it)"
    )


def estimated_gaps_line(estimated: int, requests: int, chunked: bool) -> str:
    how = (
        "its steps under prefill windows on its worker (chunked prefill: one chunk each) as long as that time net of "
        "the chunk work over their count, the others decode-only"
        if chunked
        else "decode-only iterations of each request's own measured length, plus one stall per prefill that ran on its "
        "worker during its decode, as long as that prefill"
    )
    return (
        f"per-request inter-token gaps ESTIMATED for {estimated} of {requests} requests (their spans carry none): "
        + how
    )


def kv_bytes_line(per_token: float, assumed: bool, source: str = "--kv-bytes-per-token") -> str:
    if assumed:
        return f"KV bytes per token = {per_token:.0f} (assumed: Llama-3-8B bf16; no transfer observed, no --kv-bytes-per-token)"
    return f"KV bytes per token = {per_token:.0f} ({source})"


def link_line(gbps: float, assumed: bool) -> str:
    if assumed:
        return f"link between pools = {gbps:g} Gb/s per prefill worker (assumed: no transfer observed, no --link-gbps)"
    return f"link between pools = {gbps:g} Gb/s per prefill worker (--link-gbps)"


def transfer_constant_line(constant_s: float) -> str:
    return f"KV transfer constant = {constant_s * 1e3:g} ms per request (assumed)"


def run_lines(options: ReportOptions, gpus_seen: int | None) -> list[str]:
    """The assumptions every decision makes: the GPUs (`gpus_seen`: the workers the traces showed, when
    --gpus did not say), the objective, the router, the batch cap, the step costs and the prefill step."""
    slo = options.slo
    lines = [f"GPUs = {gpus_seen}, the workers seen in the traces (--gpus to change)"] if gpus_seen is not None else []
    return lines + [
        f"ITL SLO applies to each request's {slo.itl_stat} inter-token gap; goodput needs {slo.attainment:.0%} of requests within both SLOs",
        f"requests are routed {ROUTER_WORDS[options.router]} (--router); each simulation replays {options.sim_duration_s:g} s of arrivals "
        f"({options.sim_requests}-{options.sim_max_requests} requests) resampled from the observed ones in blocks that keep their bursts",
        f"each worker runs at most {options.max_batch} requests at once; later arrivals queue (--max-batch)",
        # Measured on the reference server on 2 shared CPU cores (bench/verdict_ab.py): workers that share
        # cores slow each other, so step costs depend on how busy the neighbours were when they were fitted.
        "step costs are those fitted on the current layout, as its workers shared their hardware: a layout whose "
        "workers share cores or a GPU differently (CPU serving, several workers per device) runs at other costs, "
        "not modelled",
        f"a colocated or prefill step takes whole prompts up to {options.max_prefill_tokens_per_step} tokens "
        "(the first waiting prompt always joins)",
    ]


def skipped_line(skipped_lines: int, skipped_spans: int, first: object) -> str:
    return f"--skip-bad skipped {skipped_lines} bad lines and {skipped_spans} bad spans (first: {first})"


def metrics_file_line(path: str, sources: list[str]) -> str:
    return f"from the metrics file {path}: " + "; ".join(sources)


def metrics_attainment_line(requests: int, family: str, share: float, gaps: float, slo: SLO) -> str:
    return (
        f"SLO attainment: for the {requests} requests whose gaps are estimated, the gaps over the ITL SLO "
        f"are counted from {family} ({share:.2%} of {gaps:.0f} gaps over {slo.itl_s:g} s, interpolated "
        f"within its bucket) and placed where the estimate puts stalls; a request meets the SLO when its {slo.itl_stat} "
        "gap stays within it (expected value over where they fall)"
    )


def why_missed_skipped_line(total_bytes: int, auto_max_bytes: int) -> str:
    return (
        f"why requests missed the SLO: not built for {total_bytes / 2**20:.0f} MiB of traces (it reads them a "
        f"second time, span by span; automatic up to {auto_max_bytes / 2**20:.0f} MiB): --why-missed "
        "builds it"
    )


# ----------------------------------------------------------------------------------- evidence, self-check


def frontend_line(frontend_s: float) -> str:
    return f"front-end overhead (TTFT not spent in queue, prefill or transfer; median): {frontend_s * 1e3:.1f} ms per request"


def step_fit_line(step_fit: StepFit) -> str:
    c = step_fit.costs
    head = (
        f"step fit ({step_fit.source}, {step_fit.samples} samples, R^2 {step_fit.r2:.3f}): {c.base_s * 1e3:.3g} ms + "
    )
    if c.gemm_knee_tokens > 0:
        return head + (
            f"{c.context_s_per_token * 1e6:.3g} us/context token + {c.decode_s_per_request * 1e3:.3g} ms/request + "
            f"{c.prefill_s_per_token * 1e6:.3g} us per token past the first {c.gemm_knee_tokens:.0f} a step runs "
            f"(decodes and prefill: the GEMMs' knee, --step-model roofline) + {c.prefill_floor_s * 1e3:.3g} ms per step "
            f"with prefill + {c.prefill_s_per_token2 * 1e9:.3g} ns/prefill token^2"
        )
    return head + (
        f"{c.context_s_per_token * 1e6:.3g} us/context token + {c.decode_s_per_request * 1e3:.3g} ms/request + "
        f"{c.prefill_s_per_token * 1e6:.3g} us/prefill token + {c.prefill_s_per_token2 * 1e9:.3g} ns/prefill token^2"
    )


def auto_step_model_line(model: str) -> str:
    if model == "roofline":
        return (
            "step model: roofline, from the traces (their stage spans were timed by CUDA events: an accelerator ran "
            "them); --step-model linear to price them as a CPU's"
        )
    return (
        "step model: linear, from the traces (host-timed spans: no sign of an accelerator); --step-model "
        "roofline if a GPU ran them (an engine's adapted spans are always host-timed)"
    )


def roofline_shape_line(shape: ModelShape | None) -> str:
    if shape is None:
        return (
            "roofline without the model's config: decode attention and a prompt's attention are priced as the "
            "traced steps' slopes show them, which small batches and whole prompts overstate; --model-config "
            "(the model's config.json) prices them by its bytes and arithmetic"
        )
    return (
        f"roofline from the model's config ({shape.weight_bytes / 1e9:.3g} GB of weights, "
        f"{shape.kv_bytes_per_token / 1024:.4g} KiB of KV a token): a context token's KV read costs "
        f"{shape.kv_read_per_weight_read:.3g} of a step's weights' read (one bandwidth), an attention pair "
        f"{shape.attention_per_gemm_token:.3g} of a token's GEMMs (one FLOP rate: attention kernels often run "
        "slower, so chunks deep in long prompts may cost more than priced)"
    )


def joined_tokens_line(share: float, requests: int) -> str:
    return (
        f"streaming: {share:.1%} of tokens reached the client in one event with the token before (text held "
        f"back for an incomplete character or a stop string; {requests} requests), so the gap before that event "
        "spans two steps; every simulated layout streams the same share"
    )


NO_QUANTILE_MISSES = "no quantile misses to correct the model by: the misses that matter are unexplained"
LOWER_OF_BOOTSTRAPS = " (the lower of the bootstrap at the measured and at the corrected SLO)"


def unconfirmed_line(guess: str) -> str:
    return f"unconfirmed best guess (not a recommendation while the model misses): {guess}"


def corrected_agrees_line(said: str, reasons: list[str]) -> str:
    return f"the corrected decision agrees: {said} ({'; '.join(reasons)})"


def budget_moved_line(guess: str, said: str) -> str:
    return f"the correction moves the token budget and keeps the verdict: {guess} -> {said}"


def margin_erased_line(guess: str, said: str, margin: float) -> str:
    return (
        f"the correction erases its margin: {guess} still ranks first, by less than the "
        f"{margin:.0%} margin ({guess} -> {said})"
    )


def flips_line(guess: str, said: str) -> str:
    return f"the correction flips the verdict: {guess} -> {said}"
